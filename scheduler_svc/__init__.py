"""scheduler_svc: requests, admission, retract (to come)."""
