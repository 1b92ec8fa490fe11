"""``kvstack demo``: normal and PD stacks under KV pressure.

- :mod:`.cli`: the command (flags, the run, the report printed);
- :mod:`.workload`: the requests;
- :mod:`.runs`: the three runs, each on its own stack, and the sampler;
- :mod:`.report`: the table, the aborts, the answers and the identical-output check;
- :mod:`.plots`: the PNG plots of a run.
"""
