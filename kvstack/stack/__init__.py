"""What a stack is made of and how to start it.

- :mod:`.spec`: the processes that run in each mode, in start order;
- :mod:`.launch`: starts services as child processes, waits for their ready
  files, and always reaps them (and any shared-memory segment they left).
"""
