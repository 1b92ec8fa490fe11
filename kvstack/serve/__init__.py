"""``kvstack serve``: the stack behind an SGLang-compatible HTTP server.

- :mod:`.cli`: the command (flags, starting the stack, signals);
- :mod:`.app`: the aiohttp application and SGLang's native routes;
- :mod:`.openai_routes`: the ``/v1`` routes (a base class of the application);
- :mod:`.api`: request bodies, SSE framing and the metrics merge;
- :mod:`.sglang_fields`: SGLang's request fields, which are honoured, which refused;
- :mod:`.openai_api`: the OpenAI-compatible request and answer shapes.
"""
