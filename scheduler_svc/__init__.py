"""scheduler_svc: the scheduler process (``python -m scheduler_svc``).

- :mod:`.core`: the pure core: requests and their states, the admission budget
  (``PrefillAdder``), the ``new_token_ratio`` tracker, retract policy and cost; no I/O;
- :mod:`.engine`: the normal-mode loop over memsvc and model_svc: admit, prefill
  (``engine.prefill_round``), check decode memory, retract, decode
  (``engine.decode_round``), and the repairs after a fault (``engine.base``);
- :mod:`.pd`: the PD prefill and decode engines, and the router in front of them;
- :mod:`.service`, :mod:`.protocol`, :mod:`.client`: the generate API, its wire
  messages and its sync / async clients; :mod:`.intake` (SGLang's checks on a
  request, the request it becomes) and :mod:`.replies` (chunks, done, errors);
- :mod:`.recovery`, :mod:`.resilient`: surviving a dead memsvc or model worker;
- :mod:`.metrics`: the scheduler's Prometheus collector.

It imports model_svc (the worker's client and tokenizer) and memsvc, never
the ``kvstack`` front door.
"""
