"""kvstack: the ``kvstack`` command and what it composes from the three services.

- :mod:`kvstack.cli`: the dispatcher behind the ``kvstack`` console script;
- :mod:`kvstack.serve`: ``kvstack serve``, the HTTP front (SGLang's native API);
- :mod:`kvstack.up`: ``kvstack up`` and ``kvstack status``, the supervisor and its health pings;
- :mod:`kvstack.stack`: what runs in each mode (``spec``) and how to start it (``launch``);
- :mod:`kvstack.demo`: ``kvstack demo``, the main job;
- :mod:`kvstack.sim`: ``kvstack sim``, the policy lab.

Imports run one way: kvstack -> scheduler_svc -> model_svc -> memsvc
(checked in ``make test`` by the import-linter contracts in pyproject.toml).
"""

__version__ = "0.1.0"
