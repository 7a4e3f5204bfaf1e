"""The course's helper library: ``import helpers`` in any notebook.

- ``launch(fn, *args, world_size=N)`` / ``shutdown()``: run a notebook function on N ranks.
- the device model (world): one CPU rank plays one device with a fixed core budget (default 1).
- measuring: ``StepTimer`` (timing), ``CommRecorder`` (comm), ``trace`` (tracing), repeats and
  spread (``scaling``, ``timing.spread``),
  ``benchmark_collectives`` and ``benchmark_spread`` (bench), ``bandwidth``, ``costmodel``,
  ``memory_limit`` and ``memory.track`` (memory), ``sharding`` (ZeRO / FSDP),
  ``large_batch`` (a global batch on any
  number of ranks, accumulation), ``pipeline`` (schedules, a send/recv engine, the bubble), ``tensor_parallel`` (Megatron's
  MLP), ``zoo`` (torchvision's classifiers timed per
  step, a sweep point notebook), ``profiling`` (torch.profiler on DDP), ``multinode``
  (torchrun agents as nodes), ``plots``; ``probe.support_table()``: which backend runs which
  op, asked live; ``findings``: what measured samples allow one to say (a comparison, an
  ordering, a fit), printed from the run, never typed.
- ``rank()``, ``world_size()``, ``local_rank()``, ``is_main()``, ``print0()``, ``device()``:
  the same answers under launch, under torchrun, and in a plain process.
"""

from helpers import (
    bandwidth,
    bench,
    costmodel,
    data,
    dataparallel,
    findings,
    large_batch,
    memory,
    models,
    multinode,
    pipeline,
    plots,
    probe,
    profiling,
    ring,
    scaling,
    sharding,
    tensor_parallel,
    timing,
    world,
    zoo,
)
from helpers.bench import benchmark_collectives, memcpy_bandwidth
from helpers.comm import CommRecorder
from helpers.costmodel import predict_step
from helpers.errors import LaunchError, LaunchTimeout, RankDied, RankError
from helpers.launch import launch, shutdown
from helpers.memory import memory_limit
from helpers.timing import StepTimer
from helpers.tracing import trace
from helpers.world import device, is_main, local_rank, print0, rank, world_size

__all__ = [
    "CommRecorder",
    "StepTimer",
    "bandwidth",
    "bench",
    "benchmark_collectives",
    "costmodel",
    "data",
    "dataparallel",
    "findings",
    "large_batch",
    "models",
    "multinode",
    "pipeline",
    "ring",
    "scaling",
    "sharding",
    "tensor_parallel",
    "memcpy_bandwidth",
    "memory",
    "memory_limit",
    "plots",
    "probe",
    "profiling",
    "predict_step",
    "timing",
    "trace",
    "world",
    "zoo",
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
