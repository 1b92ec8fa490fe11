"""The OpenAI-compatible endpoints of ``kvstack serve``, as SGLang's OpenAI server has them.

- :mod:`.protocol`: the request bodies, and the scheduler requests they become;
- :mod:`.serving`: what the two generating endpoints share (answering, whole or streamed);
- :mod:`.serving_completion`: ``/v1/completions``;
- :mod:`.serving_chat`: ``/v1/chat/completions``;
- :mod:`.models`: ``/v1/models``.
"""
