"""``kvstack up`` and ``kvstack status``: one supervised stack.

- :mod:`.cli`: ``kvstack up`` (the run directory, options, the supervisor's loop);
- :mod:`.supervisor`: starts each process, pings it, restarts what dies;
- :mod:`.health`: the per-service health pings;
- :mod:`.status`: ``kvstack status``, each supervised process and its health;
- :mod:`.cluster`: ``kvstack up --nodes N``'s process list (nodes, Mooncake master, SMG);
- :mod:`.external`: runs a program that writes no ready file (SMG, the master) supervised.
"""
