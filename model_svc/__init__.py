"""model_svc: the model worker over the shared KV pool (to come)."""
