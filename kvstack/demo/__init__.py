"""``kvstack demo``: normal and PD stacks under KV pressure.

- :mod:`.cli`: the workload, the three runs and their table;
- :mod:`.plots`: the PNG plots of a run.
"""
