"""SGLang's native endpoints of ``kvstack serve``.

- :mod:`.fields`: SGLang's request fields, which are honoured, which refused;
- :mod:`.protocol`: the ``/generate`` and ``/abort_request`` bodies;
- :mod:`.generate`: ``/generate``, single and batch, whole or streamed;
- :mod:`.admin`: ``/health``, ``/health_generate``, ``/model_info``, ``/server_info``,
  ``/flush_cache``, ``/abort_request``, ``/metrics``.
"""
