"""Who am I in the world? Rank, world size, local rank, device, and per-rank set-up.

The same functions answer in a plain process (rank 0 of 1), in a rank started by
``helpers.launch``, and in a rank started by torchrun, so lab code has one path for 1 or N.
Introduced in lecture 01.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from helpers.launcher.limits import cpu_limit

BACKENDS = ("auto", "gloo", "nccl", "mpi")


def cpu_count() -> int:
    """Devices this process has: the cores it may run on, capped by its CPU quota.

    The affinity mask (which containers and Slurm narrow) and the CFS quota of its cgroups
    (which JupyterHub and Kubernetes set), the tightest of them in whole cores: see limits.py.
    """
    return cpu_limit().count


def cpu_limit_text() -> str:
    """Which limit ``cpu_count`` read, and why: the sentence lecture 00 and the notices print."""
    return cpu_limit().describe()


def fit_threads_to_devices() -> int:
    """Cap this process's torch threads at its devices, and return the count it now uses.

    torch sizes its thread pool from the node's cores, not from a CPU quota: a notebook kernel
    on a hub server with 2 CPUs of a 64-core node would run 64 threads on 2 CPUs of time, each
    throttled in turn, and its one-process references would crawl. Called once by ``import
    helpers``; ranks set their own budget (``init_rank``).
    """
    if torch.get_num_threads() > cpu_count():
        torch.set_num_threads(cpu_count())
    return torch.get_num_threads()


def thread_budget(local_world_size: int = 1, threads: int | None = None) -> int:
    """Threads per CPU rank: ``threads`` if given, else $HELPERS_THREADS, else 1.

    The course's device model: one CPU rank plays one device with a fixed budget of cores, the
    same at every world size (the 1-rank baseline included). Sharing the machine's cores out
    instead (cores // world_size) would give the baseline all the hardware and 2 ranks half
    each, so "1 rank vs 2" would compare the same hardware and a scaling plot would show only
    overhead. ``local_world_size`` is kept for callers that pass it; it no longer matters.
    """
    if threads is None:
        threads = os.environ.get("HELPERS_THREADS", 1)
    try:
        n = int(threads)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or isinstance(threads, bool):
        raise ValueError(
            f"threads must be a whole number of cores per rank, at least 1, not {threads!r} "
            "(check $HELPERS_THREADS)"
        )
    return n


def oversubscribed(world_size: int, threads: int = 1) -> bool:
    """True when ``world_size`` ranks of ``threads`` cores each need more cores than we may use.

    Such a world runs, but its ranks take turns on the cores: time it if you like, never call
    it scaling. Counts the ranks on this node (a launch, or torchrun's LOCAL_WORLD_SIZE).
    """
    return world_size * threads > cpu_count()


def pinned_cores(local_rank: int, local_world_size: int, threads: int) -> list[int] | None:
    """The cores rank ``local_rank`` is pinned to: its own ``threads`` of them, or None.

    Pinning keeps a rank on its "device" (no migration between cores, warm caches); an
    oversubscribed world is not pinned, the OS spreads it best. Under a CPU quota the mask
    can hold more cores than the quota pays for: the world is judged by ``cpu_count()``.
    """
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS: no affinity API
        return None
    if local_world_size * threads > min(len(cores), cpu_count()):
        return None
    return cores[local_rank * threads : (local_rank + 1) * threads]


def budget() -> dict:
    """This process's device budget: threads, the cores it is pinned to, whether oversubscribed."""
    limit = cpu_limit()
    return {
        "threads": torch.get_num_threads(),
        "cores": list(limit.cores) if limit.cores is not None else None,
        "oversubscribed": os.environ.get("HELPERS_OVERSUBSCRIBED") == "1",
    }


def choose_backend(requested: str, local_world_size: int, gpus: int | None = None) -> str:
    """Resolve ``requested`` (auto, gloo, nccl, mpi) to a backend this node can run, or explain.

    auto: when every rank on this node can have a GPU of its own, one group with two backends,
    "cpu:gloo,cuda:nccl": collectives on CUDA tensors go through NCCL, those on CPU tensors
    through gloo, so a notebook's CPU demos stay correct unchanged on a GPU node. Otherwise
    gloo. ``gpus`` overrides the GPU count (tests simulate a GPU node with it).
    """
    if requested not in BACKENDS:
        raise ValueError(f"backend={requested!r} is not one of {', '.join(BACKENDS)}")
    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "auto":
        if dist.is_nccl_available() and gpus >= local_world_size:
            return "cpu:gloo,cuda:nccl" if dist.is_gloo_available() else "nccl"
        return "gloo"
    if requested == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError(
                "backend='nccl' is not available: this torch was built without NCCL "
                "(a CPU-only build). Use backend='gloo', which runs on CPU."
            )
        if gpus < local_world_size:
            raise RuntimeError(
                f"backend='nccl' needs one CUDA GPU per rank: {local_world_size} ranks on this "
                f"node but {gpus} GPU{'s' if gpus != 1 else ''} visible. Use backend='gloo' "
                f"(CPU, or CUDA tensors shared on one GPU) or at most {gpus} ranks per node."
            )
    if requested == "gloo" and not dist.is_gloo_available():
        raise RuntimeError("backend='gloo' is not available in this torch build; try 'nccl'.")
    if requested == "mpi" and not dist.is_mpi_available():
        raise RuntimeError(
            "backend='mpi' needs a torch built from source against an MPI library; pip and "
            "conda builds have none. Use 'gloo' (CPU) or 'nccl' (GPUs)."
        )
    return requested


def uses_nccl(backend: str) -> bool:
    """Whether CUDA tensors go through NCCL under ``backend`` (e.g. "cpu:gloo,cuda:nccl")."""
    return "nccl" in str(backend)


def use_loopback() -> None:
    """Make gloo and NCCL talk over loopback on a single node (unless the user chose already).

    Without it gloo resolves the host name, which fails in sandboxes without a network.
    """
    for name in ("lo", "lo0"):
        if os.path.exists(f"/sys/class/net/{name}") or (
            name == "lo0" and os.uname().sysname == "Darwin"
        ):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", name)
            return


def init_rank(
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    backend: str = "auto",
    threads: int | None = None,
    store=None,
    timeout: timedelta = timedelta(minutes=30),
) -> dict:
    """Set threads and device, initialise the default process group; return what was chosen.

    With ``store`` None the rendezvous comes from the environment (torchrun's MASTER_ADDR etc.).
    """
    n_threads = thread_budget(local_world_size, threads)
    torch.set_num_threads(n_threads)
    over = oversubscribed(local_world_size, n_threads)
    os.environ["HELPERS_OVERSUBSCRIBED"] = "1" if over else "0"
    cores = pinned_cores(local_rank, local_world_size, n_threads)
    if cores:
        os.sched_setaffinity(0, cores)  # this rank's "device": its own cores
    chosen = choose_backend(backend, local_world_size)
    if uses_nccl(chosen):
        torch.cuda.set_device(local_rank)  # each rank pinned to its own GPU
    kwargs = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(chosen, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    return {
        "backend": chosen,
        "threads": n_threads,
        "cores": cores,
        "oversubscribed": over,
        "device": str(device()),
    }


def rank() -> int:
    """This process's global rank (0 outside a distributed run)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """Number of ranks in the world (1 outside a distributed run)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def local_rank() -> int:
    """Rank on this node: picks the GPU. Set by torchrun and helpers.launch as LOCAL_RANK."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    """True on rank 0, the rank that prints, plots and saves."""
    return rank() == 0


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only."""
    if is_main():
        print(*args, **kwargs, flush=True)


def device():
    """The device this rank computes on: its own GPU when there are GPUs, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")
