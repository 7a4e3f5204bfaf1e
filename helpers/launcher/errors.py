"""The exceptions a launch raises in the notebook, and how a rank's exception is rebuilt there."""

from __future__ import annotations

import linecache
import signal


class LaunchError(Exception):
    """A launch could not start, run, or finish."""


class RankError(LaunchError):
    """A rank raised. Raised as a subclass of the remote type too, so ``except ValueError`` works.

    Attributes: ``rank``, ``world_size``, ``remote_type`` (e.g. "ValueError"),
    ``remote_message`` and ``remote_traceback`` (text, formatted with the notebook's sources).
    """

    rank: int
    world_size: int
    remote_type: str
    remote_message: str
    remote_traceback: str

    def __str__(self) -> str:
        return self.message


class RankDied(LaunchError):
    """A rank's process ended without reporting (os._exit, a signal, a segfault)."""

    def __init__(self, message: str, rank: int, returncode: int | None):
        super().__init__(message)
        self.rank, self.returncode = rank, returncode


class LaunchTimeout(LaunchError, TimeoutError):
    """The launch did not finish in time; ``diagnosis`` holds each rank's state."""

    def __init__(self, message: str, diagnosis: dict):
        super().__init__(message)
        self.diagnosis = diagnosis


def format_frames(frames: list[tuple[str, int, str, str | None]]) -> str:
    """Format (file, line, function, source) frames like a Python traceback.

    A frame whose source the rank could not read (a function from a notebook cell, shipped by
    value) takes it from this process's linecache, where IPython keeps the cells.
    """
    out = []
    for filename, lineno, name, line in frames:
        out.append(f'  File "{filename}", line {lineno}, in {name}\n')
        line = line or linecache.getline(filename, lineno).strip()
        if line:
            out.append(f"    {line}\n")
    return "".join(out)


def describe_exit(returncode: int | None) -> str:
    """'exit code 3' or 'signal SIGSEGV (Segmentation fault)' for a Popen return code."""
    if returncode is None:
        return "no exit code"
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode)
            return f"signal {sig.name} ({signal.strsignal(sig)})"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def rank_error(
    rank: int,
    world_size: int,
    remote_cls: type | None,
    type_name: str,
    message: str,
    traceback_text: str,
    also: list[int],
) -> RankError:
    """Build the exception to raise in the notebook for a rank that raised ``type_name``.

    When the remote class is known and is an ``Exception``, the result is an instance of a class
    deriving from both RankError and it (as Ray does), named like it, so the cell shows
    "ValueError: rank 1 of 4 raised ..." and ``except ValueError`` catches it.
    """
    text = f"rank {rank} of {world_size} raised {type_name}: {message}"
    if also:
        text += f"\n(ranks {', '.join(map(str, also))} raised the same error)"
    text += f"\n\nTraceback on rank {rank} (most recent call last):\n{traceback_text}"
    cls = RankError
    if isinstance(remote_cls, type) and issubclass(remote_cls, Exception):
        if issubclass(remote_cls, RankError):
            cls = remote_cls
        else:
            try:
                cls = type(remote_cls.__name__, (RankError, remote_cls), {"__module__": "helpers"})
            except TypeError:  # incompatible layouts: keep the plain RankError
                cls = RankError
    try:
        err = cls.__new__(cls)
        Exception.__init__(err, text)
    except Exception:
        err = RankError.__new__(RankError)
        Exception.__init__(err, text)
    err.message = text
    err.rank, err.world_size = rank, world_size
    err.remote_type, err.remote_message, err.remote_traceback = type_name, message, traceback_text
    return err
