"""``kvstack serve``: the stack behind an SGLang-compatible HTTP server.

- :mod:`.cli`: the command (flags, starting the stack, signals);
- :mod:`.app`: the aiohttp application and its routes;
- :mod:`.api`: request bodies, SSE framing and the metrics merge.
"""
