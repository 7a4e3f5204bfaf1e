"""The launcher: everything that starts, watches and stops ranks (lecture 01 on).

- ``launch.launch`` / ``launch.shutdown``: a notebook function on N ranks, results back;
  ``pool``: a warm world and one run of a task on it; ``_rankserver``: the process that forks
  ranks; ``_worker``: a rank's loop; ``_pickling``: a cell's function shipped by value.
- ``world``: the device model (one CPU rank plays one device), the same answers under launch,
  torchrun or a plain process; ``watch`` and ``diagnose``: what a stuck rank is waiting for;
  ``errors``: the exceptions a launch raises.
- ``run``: the entry point torchrun starts on every node (``python -m helpers.run``).

The lowest layer with ``workloads``: it imports nothing else of the course.
"""
