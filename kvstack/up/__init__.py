"""``kvstack up`` and ``kvstack status``: one supervised stack.

- :mod:`.cli`: ``kvstack up`` (the run directory, options, the supervisor's loop);
- :mod:`.supervisor`: starts each process, pings it, restarts what dies;
- :mod:`.health`: the per-service health pings;
- :mod:`.status`: ``kvstack status``, each supervised process and its health.
"""
