"""model_svc: the model worker over the shared KV pool (``python -m model_svc``).

- :mod:`.config`, :mod:`.checkpoint`, :mod:`.tiny`: a Llama checkpoint's shape and
  weights (Hugging Face layout), and the bundled tiny one;
- :mod:`.model`, :mod:`.sampling`: the paged decoder over memsvc's pool, and
  next-token choice; :mod:`.reference`: a dense reference for tests;
- :mod:`.tokenizer`: byte-level, or the checkpoint's ``tokenizer.json``;
- :mod:`.handlers`, :mod:`.protocol`, :mod:`.client`: the forward API, its wire
  messages and its clients.

It imports memsvc (the pool layout and its client), never the scheduler.
"""
