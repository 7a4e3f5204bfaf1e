"""One rank of a ``helpers.launch`` pool: forked by the rank server (never a fork of the kernel).

The rank server (``helpers._rankserver``) imported torch once; each rank joins the process group, then runs the functions the launcher ships to
it until told to stop. Protocol, over two socket pairs passed as file descriptors:
  task: parent -> ("port", p) | ("task", id, payload, opts) | ("stop",)
        rank   -> ("port", p) [rank 0] | ("ready", info) | ("setup_error", err)
                  | ("ok", id, pickled result, dirty) | ("error", id, err, dirty)
  diag: parent -> "snapshot";  rank -> where the main thread is (answered by a helper thread,
        so a rank blocked inside a C++ collective still answers).
After each task the rank writes an end marker on stdout and stderr, so the parent knows it has
every line of that task before it hands back the result.
"""

from __future__ import annotations

import faulthandler
import io
import os
import random
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

STATUS = {"state": "starting", "since": time.time()}
HERE = os.path.dirname(os.path.abspath(__file__))
TORCH = os.path.dirname(torch.__file__) + os.sep


def end_marker(task_id: int) -> bytes:
    return f"\x1e{task_id}\x1e\n".encode()


# the rank server forks each rank from inside its serve loop: its frames sit under every rank's
INTERNAL = {os.path.join(HERE, f) for f in ("_worker.py", "watch.py", "_rankserver.py")}


def _internal(filename: str) -> bool:
    """Frames of the launcher, of runpy and of torch's own wrappers: noise for a student."""
    return filename in INTERNAL or filename.startswith(("<frozen", "<string>", TORCH))


def user_frames(tb_or_stack) -> list[tuple[str, int, str, str | None]]:
    frames = [
        (f.filename, f.lineno, f.name, f.line or None)
        for f in tb_or_stack
        if not _internal(f.filename)
    ]
    return frames


def error_info(exc: BaseException) -> dict:
    import cloudpickle

    try:
        cls = cloudpickle.dumps(type(exc))
    except Exception:
        cls = None
    frames = user_frames(traceback.extract_tb(exc.__traceback__))
    chained = ""
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if cause is not None:
        chained = "".join(traceback.format_exception(cause))
    message = str(exc)
    if isinstance(exc, SystemExit):
        message = f"sys.exit({exc.code!r}) was called inside the launched function"
    return {
        "type": type(exc).__name__,
        "cls": cls,
        "message": message,
        "frames": frames,
        "chained": chained,
    }


def _to_cpu(t):
    return t


def dumps_result(result) -> bytes:
    """Pickle a return value; CUDA tensors come back as CPU tensors (the kernel needs no GPU)."""
    import cloudpickle

    class ResultPickler(cloudpickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
                return _to_cpu, (obj.detach().cpu(),)
            return super().reducer_override(obj)

    buf = io.BytesIO()
    ResultPickler(buf).dump(result)
    return buf.getvalue()


def snapshot() -> dict:
    """Where the main thread is: the torch.distributed call it is in and its Python stack."""
    from helpers.launcher import watch

    frame = sys._current_frames().get(threading.main_thread().ident)
    stack = user_frames(traceback.extract_stack(frame)) if frame else []
    current, last = watch.STATE.current, watch.STATE.last
    return {
        "state": STATUS["state"],
        "since": STATUS["since"],
        "now": time.time(),
        "call": current.describe() if current else None,
        "call_key": (current.group, current.seq, current.op, current.tensors) if current else None,
        "call_peer": current.peer if current else None,
        "call_start": current.start if current else None,
        "last": last.describe() if last else None,
        "last_key": (last.group, last.seq, last.op, last.tensors) if last else None,
        "stack": stack,
    }


def monitor(diag: Connection, parent_pid: int) -> None:
    """Answer snapshot requests; end this rank if its rank server (and so the kernel) is gone."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(70)
        try:
            if diag.poll(0.5):
                diag.recv()
                diag.send(snapshot())
        except (EOFError, OSError):
            os._exit(70)


def flush_all() -> None:
    """Flush Python's and C's stdio buffers, so every line of the task reaches the parent."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except Exception:
        pass


def forbid_reinit(world: str) -> None:
    """A launched function must not initialise the process group again; say so plainly."""
    original = dist.init_process_group

    def init_process_group(*args, **kwargs):
        if dist.is_initialized():
            raise RuntimeError(
                f"helpers.launch already initialised the default process group ({world}); "
                "do not call init_process_group inside a launched function: use dist.get_rank(), "
                "dist.all_reduce(...) etc. directly (helpers.run does the same under torchrun)."
            )
        return original(*args, **kwargs)

    dist.init_process_group = init_process_group


def rendezvous(task: Connection, cfg: dict):
    """Rank 0 opens a store on a free port (port 0: no race, no fixed port); the parent relays it."""
    from datetime import timedelta

    timeout = timedelta(seconds=cfg["start_timeout"])
    if cfg["rank"] == 0:
        store = dist.TCPStore(
            "127.0.0.1",
            0,
            cfg["world_size"],
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
        )
        task.send(("port", store.port))
        return store
    msg = task.recv()
    return dist.TCPStore("127.0.0.1", msg[1], cfg["world_size"], is_master=False, timeout=timeout)


def run_task(task_id: int, payload: bytes, opts: dict, rng: tuple):
    """Run one shipped function; return the reply to send."""
    import cloudpickle
    import numpy

    from helpers.launcher import watch

    os.chdir(opts["cwd"])
    sys.argv[:] = opts["argv"]
    sys.path[:] = opts["sys_path"] + [p for p in sys.path if p not in opts["sys_path"]]
    # Every launch sees the random state of a fresh process: warm and cold runs agree.
    torch.set_rng_state(rng[0])
    random.setstate(rng[1])
    numpy.random.set_state(rng[2])
    watch.reset()
    STATUS.update(state="running", since=time.time())
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        result = fn(*args, **kwargs)
        STATUS.update(state="returning", since=time.time())
        try:
            reply = ("ok", task_id, dumps_result(result))
        except Exception as exc:
            err = error_info(exc)
            err["message"] = (
                f"the return value ({type(result).__name__}) cannot be pickled back to the "
                f"notebook: {exc}. Return plain data: numbers, lists, dicts, tensors, arrays."
            )
            err["type"] = "TypeError"
            err["cls"] = cloudpickle.dumps(TypeError)
            reply = ("error", task_id, err)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt too: the rank must answer
        reply = ("error", task_id, error_info(exc))
    STATUS.update(state="idle", since=time.time())
    return reply


def main(cfg: dict) -> None:
    """Be rank ``cfg["rank"]`` until told to stop (called in a child of the rank server)."""
    faulthandler.enable()  # a segfault prints the Python stack on stderr
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's last-resort stack dump
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when ranks stop
    task = Connection(cfg["task_fd"])
    diag = Connection(cfg["diag_fd"])
    threading.Thread(target=monitor, args=(diag, cfg["parent_pid"]), daemon=True).start()

    try:
        import numpy

        from helpers.launcher import watch, world

        world.use_loopback()
        watch.install()
        rng = (torch.get_rng_state(), random.getstate(), numpy.random.get_state())
        store = rendezvous(task, cfg)
        from datetime import timedelta

        info = world.init_rank(
            cfg["rank"],
            cfg["world_size"],
            cfg["rank"],
            cfg["world_size"],
            cfg["backend"],
            cfg["threads"],
            store=store,
            # The parent's timeout watches for hangs and explains them; the group's own
            # timeout only has to outlive it.
            timeout=timedelta(days=1),
        )
        forbid_reinit(f"backend {info['backend']}, world_size {cfg['world_size']}")
    except BaseException as exc:
        task.send(("setup_error", error_info(exc)))
        flush_all()
        os._exit(1)
    info["pid"] = os.getpid()
    STATUS.update(state="idle", since=time.time())
    task.send(("ready", info))

    while True:
        try:
            msg = task.recv()
        except (EOFError, OSError):
            break
        if msg[0] == "stop":
            break
        _, task_id, payload, opts = msg
        reply = run_task(task_id, payload, opts, rng)
        flush_all()
        marker = end_marker(task_id)
        os.write(1, marker)
        os.write(2, marker)
        # The launched function may have destroyed the process group: the pool must be retired.
        dirty = not dist.is_initialized()
        task.send((*reply, dirty))
    flush_all()
    os._exit(0)
