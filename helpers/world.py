"""Who am I in the world? Rank, world size, local rank, device, and per-rank set-up.

The same functions answer in a plain process (rank 0 of 1), in a rank started by
``helpers.launch``, and in a rank started by torchrun, so lab code has one path for 1 or N.
Introduced in lecture 01.
"""

from __future__ import annotations

import os
from datetime import timedelta

BACKENDS = ("auto", "gloo", "nccl", "mpi")


def cpu_count() -> int:
    """Cores this process may run on (the affinity mask, which containers narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def thread_budget(local_world_size: int, threads: int | None = None) -> int:
    """Threads per rank: ``threads`` if given, else the node's cores shared out (at least 1).

    N ranks each using every core thrash: on 2 cores, 4 ranks × 2 threads run slower than 1 rank.
    """
    if threads is not None:
        if int(threads) < 1:
            raise ValueError(f"threads must be at least 1, not {threads!r}")
        return int(threads)
    return max(1, cpu_count() // max(1, local_world_size))


def choose_backend(requested: str, local_world_size: int) -> str:
    """Resolve ``requested`` (auto, gloo, nccl, mpi) to a backend this node can run, or explain.

    auto: NCCL when every rank on this node can have a GPU of its own, gloo otherwise.
    """
    import torch
    import torch.distributed as dist

    if requested not in BACKENDS:
        raise ValueError(f"backend={requested!r} is not one of {', '.join(BACKENDS)}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "auto":
        return "nccl" if dist.is_nccl_available() and gpus >= local_world_size else "gloo"
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
    import torch
    import torch.distributed as dist

    n_threads = thread_budget(local_world_size, threads)
    torch.set_num_threads(n_threads)
    chosen = choose_backend(backend, local_world_size)
    if chosen == "nccl":
        torch.cuda.set_device(local_rank)  # each rank pinned to its own GPU
    kwargs = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(chosen, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    return {"backend": chosen, "threads": n_threads, "device": str(device())}


def rank() -> int:
    """This process's global rank (0 outside a distributed run)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """Number of ranks in the world (1 outside a distributed run)."""
    import torch.distributed as dist

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
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")
