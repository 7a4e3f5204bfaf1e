"""The course's helper library: ``import helpers`` in any notebook.

- ``launch(fn, *args, world_size=N)`` / ``shutdown()``: run a notebook function on N ranks.
- the device model (world): one CPU rank plays one device with a fixed core budget (default 1).
- measuring: ``StepTimer`` (timing), ``CommRecorder`` (comm), ``trace`` (tracing), repeats and
  spread (``scaling``, ``timing.spread``), ``benchmark_collectives`` and ``benchmark_spread``
  (bench), ``bandwidth``, ``costmodel``, ``memory_limit`` and ``memory.track`` (memory);
  ``probe.support_table()``: which backend runs which op, asked live; ``findings``: what
  measured samples allow one to say (a comparison, an ordering, a fit), printed from the run,
  never typed.
- parallelism: ``sharding`` (ZeRO / FSDP), ``pipeline`` (schedules, a send/recv engine, the
  bubble; interleaved 1F1B and ZB-H1 simulated), ``tensor_parallel`` (Megatron's MLP),
  ``transformer`` (a block, its activation memory, tensor and sequence parallelism),
  ``context`` (ring attention), ``moe`` (experts over all-to-all), ``layout`` (data × tensor
  parallel on a DeviceMesh, a planner of layouts).
- large batches (``helpers.optimisation``): ``large_batch`` (a global batch on any number of
  ranks, accumulation), ``noise_scale`` (the gradient noise scale, the critical batch),
  ``stability`` (sharpness, trust ratios).
- tools and figures: ``zoo`` (torchvision's classifiers timed per step, a sweep point
  notebook), ``profiling`` (torch.profiler on DDP), ``multinode`` (torchrun agents as nodes),
  ``plots``.
- ``rank()``, ``world_size()``, ``local_rank()``, ``is_main()``, ``print0()``, ``device()``:
  the same answers under launch, under torchrun, and in a plain process.
"""

from helpers import plots
from helpers.launcher import world
from helpers.launcher.errors import LaunchError, LaunchTimeout, RankDied, RankError
from helpers.launcher.launch import launch, shutdown
from helpers.launcher.world import device, is_main, local_rank, print0, rank, world_size
from helpers.measure import (
    bandwidth,
    bench,
    comm,
    costmodel,
    findings,
    memory,
    probe,
    scaling,
    timing,
    zoo,
)
from helpers.measure.bench import benchmark_collectives, memcpy_bandwidth
from helpers.measure.comm import CommRecorder
from helpers.measure.costmodel import predict_step
from helpers.measure.memory import memory_limit
from helpers.measure.timing import StepTimer
from helpers.measure.tracing import trace
from helpers.optimisation import large_batch, noise_scale, stability
from helpers.parallel import (
    context,
    dataparallel,
    layout,
    moe,
    pipeline,
    ring,
    sharding,
    tensor_parallel,
    transformer,
)
from helpers.tools import multinode, profiling
from helpers.workloads import data, models

world.fit_threads_to_devices()  # torch counts the node's cores, not a hub server's CPU quota

__all__ = [
    "CommRecorder",
    "StepTimer",
    "bandwidth",
    "bench",
    "benchmark_collectives",
    "comm",
    "context",
    "costmodel",
    "data",
    "dataparallel",
    "findings",
    "large_batch",
    "layout",
    "models",
    "moe",
    "multinode",
    "noise_scale",
    "pipeline",
    "ring",
    "scaling",
    "sharding",
    "stability",
    "tensor_parallel",
    "transformer",
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
