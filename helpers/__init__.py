"""The course's helper library: ``import helpers`` in any notebook.

- ``launch(fn, *args, world_size=N)`` / ``shutdown()``: run a notebook function on N ranks.
- ``rank()``, ``world_size()``, ``local_rank()``, ``is_main()``, ``print0()``, ``device()``:
  the same answers under launch, under torchrun, and in a plain process.
"""

from helpers import world
from helpers.errors import LaunchError, LaunchTimeout, RankDied, RankError
from helpers.launch import launch, shutdown
from helpers.world import device, is_main, local_rank, print0, rank, world_size

__all__ = [
    "world",
    "LaunchError",
    "LaunchTimeout",
    "RankDied",
    "RankError",
    "device",
    "is_main",
    "launch",
    "local_rank",
    "print0",
    "rank",
    "shutdown",
    "world_size",
]
