"""``kvstack serve``: the stack behind an SGLang-compatible HTTP server.

One module per endpoint family over one shared request path:

- :mod:`.cli`: the command (its flags; start or find the stack, then serve);
- :mod:`.backends`: the stack behind the front, started or fronted, and its tokenizer;
- :mod:`.server`: the serve loop on its listening socket, and the signals;
- :mod:`.app`: the aiohttp application: routes, error replies, both families built;
- :mod:`.request_path`: the one path to the scheduler both families are given;
- :mod:`.sglang`: SGLang's native ``/generate`` and admin endpoints, its request fields;
- :mod:`.openai`: the OpenAI-compatible ``/v1`` endpoints, vLLM's layout;
- shared pieces: :mod:`.body` (reading and decoding bodies), :mod:`.errors`,
  :mod:`.streaming` (SSE, streamed text and ``meta_info``), :mod:`.metrics`,
  :mod:`.limits`, :mod:`.connections`.
"""
