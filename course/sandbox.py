"""Run one submission's notebook in isolation and stream its test results to the grader.

Started by course.grade as ``[unshare --net --mount --fork --] python -m course.sandbox JOB FD``.
This process stays root where the grader is root; it
  1. reads the job (the notebook; its test cells hold only their probes) while it can,
  2. brings loopback up in its new network namespace (no network, ports of its own),
  3. hides the solutions, the other submissions and the grader's files under empty tmpfs mounts,
  4. makes itself non-dumpable (the submission cannot read the secrets in its memory),
  5. starts the kernel through course._kernel_shim, which applies the resource limits and drops
     to the job's unprivileged uid before Python starts the kernel,
  6. runs every cell (a failing cell does not stop the run) and, after each test cell's probe,
     writes one JSON line to FD: the probe's error, if any, and the values its check reads, as
     the kernel published them (course.plain). The last line carries the executed notebook.
Nothing here decides a grade: whatever comes out of the kernel may be forged. The grader runs
each test's check on that data in an interpreter of its own (course.verdict).
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import shutil
import socket
import struct
import sys
import tempfile
from pathlib import Path

from course import cells
from course.plain import MAX_BYTES, MIME

OUTPUT_LIMIT = 100_000  # bytes of output kept per cell; the rest is dropped with a note


def loopback_up() -> bool:
    """SIOCSIFFLAGS lo up, as `ip link set lo up` does (a new network namespace starts with it down)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            ifreq = struct.pack(
                "16sH14s", b"lo", 0x1 | 0x8 | 0x40, b"\x00" * 14
            )  # UP | LOOPBACK | RUNNING
            fcntl.ioctl(s, 0x8914, ifreq)  # SIOCSIFFLAGS
        return True
    except OSError:
        return False


def hide(paths: list[str]) -> list[str]:
    """Mount an empty read-only tmpfs over each path (only inside this mount namespace)."""
    libc = ctypes.CDLL(None, use_errno=True)
    hidden = []
    for p in paths:
        if (
            os.path.isdir(p) and libc.mount(b"tmpfs", p.encode(), b"tmpfs", 1, b"size=1k") == 0
        ):  # MS_RDONLY
            hidden.append(p)
    return hidden


MS_BIND, MS_REC = 4096, 16384
MNT_DETACH = 2  # umount2: detach now, free when unused


def _blocked_ancestor(path: str) -> str | None:
    """The first folder above ``path`` that others may not enter (e.g. /root, mode 0700)."""
    parts = os.path.abspath(path).split(os.sep)
    for i in range(2, len(parts)):
        folder = os.sep.join(parts[:i])
        if not os.stat(folder).st_mode & 0o001:
            return folder
    return None


def expose(needed: list[str]) -> list[str]:
    """Make ``needed`` folders reachable by an unprivileged uid, hiding their blocked parents.

    A base interpreter under /root (pyenv) is unreachable for another uid. In this private
    mount namespace: keep each needed folder aside with a bind mount, cover its blocked
    ancestor with an empty world-readable tmpfs, recreate the path and bind the folder back.
    Everything else under that ancestor stays invisible.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    groups: dict[str, list[str]] = {}
    for p in needed:
        blocked = _blocked_ancestor(p)
        if blocked:
            groups.setdefault(blocked, []).append(os.path.abspath(p))
    done = []
    for blocked, paths in groups.items():
        stashes = []
        for p in paths:
            stash = tempfile.mkdtemp(prefix="expose-")
            if libc.mount(p.encode(), stash.encode(), None, MS_BIND | MS_REC, None) != 0:
                raise OSError(ctypes.get_errno(), f"bind {p}")
            stashes.append((p, stash))
        if libc.mount(b"tmpfs", blocked.encode(), b"tmpfs", 0, b"mode=755") != 0:
            raise OSError(ctypes.get_errno(), f"tmpfs over {blocked}")
        for p, stash in stashes:
            os.makedirs(p, mode=0o755, exist_ok=True)
            if libc.mount(stash.encode(), p.encode(), None, MS_BIND | MS_REC, None) != 0:
                raise OSError(ctypes.get_errno(), f"bind back {p}")
            # The stash was only a handle: drop it, so no expose-* folder outlives the job.
            libc.umount2(stash.encode(), MNT_DETACH)
            os.rmdir(stash)
            done.append(p)
    return done


def needed_paths() -> list[str]:
    """What a kernel must read: the base interpreter, the environment, the course."""
    import course

    return [
        sys.base_prefix,
        sys.prefix,
        os.path.dirname(os.path.dirname(os.path.abspath(course.__file__))),
    ]


def not_dumpable() -> None:
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no ptrace, no /proc/pid/mem


def hidden_error(ename: str):
    import nbformat

    return nbformat.v4.new_output(
        "error", ename=ename or "Error", evalue="a hidden test failed", traceback=[]
    )


def run_test_cell(client, cell, index: int, names: list[str], timeout_output) -> dict:
    """Run a test cell's probe piece by piece, then read back the values its check needs.

    Returns {'probe_error': text or None, 'data': what the kernel published, or None}. Nothing
    here decides whether the test passed: the kernel could fake any status. The grader's
    checker decides, from ``data`` alone. What hidden pieces print or raise is not shown.
    """
    import nbformat
    from nbclient.exceptions import CellTimeoutError

    merged, error = [], None
    # A value left by an earlier cell must not stand in for one the probe failed to assign.
    # (This runs in the kernel, so a submission could undo it: it only spares an honest check
    # from stale values. A forged value still has to be right to pass a check.)
    forget = f"__import__('course.plain', fromlist=['forget']).forget({names!r})"
    try:
        client.execute_cell(nbformat.v4.new_code_cell(forget), index)
    except CellTimeoutError:
        error = "TimeoutError: the kernel did not answer before the probe"
    for code, hidden in cells.segments(cell.source) if error is None else []:
        piece = nbformat.v4.new_code_cell(code)
        try:
            client.execute_cell(piece, index)
        except CellTimeoutError:
            piece.outputs.append(timeout_output())
        errors = [o for o in piece.outputs if o.get("output_type") == "error"]
        if errors:
            ename = str(errors[0].get("ename", "Error"))
            evalue = "a hidden test failed" if hidden else str(errors[0].get("evalue", ""))
            error = f"{ename}: {evalue}"
        if hidden:
            piece.outputs = [hidden_error(errors[0].get("ename"))] if errors else []
        merged += piece.outputs
        if errors:
            break
    data = None
    if error is None:
        export = nbformat.v4.new_code_cell(
            f"__import__('course.plain', fromlist=['publish']).publish({names!r})"
        )
        client.published = []
        try:
            client.execute_cell(export, index)
        except CellTimeoutError:
            pass
        data = client.published[0] if client.published else None
        client.published = None
        if data is None:
            failed = [o for o in export.outputs if o.get("output_type") == "error"]
            error = "ProbeError: the probe's values could not be read from the kernel" + (
                f" ({failed[0].get('ename')}: {failed[0].get('evalue')})" if failed else ""
            )
    cell.outputs = merged
    client.nb.cells[index] = cell  # nbclient stores the cell it executed: put the real one back
    return {"probe_error": error, "data": data}


def kernelspec_dir(job: dict) -> str:
    """A private kernelspec 'graded' whose argv goes through the shim (limits, uid)."""
    root = tempfile.mkdtemp(prefix="graded-kernels-")
    spec = Path(root, "kernels", "graded")
    spec.mkdir(parents=True)
    argv = [
        sys.executable,
        "-m",
        "course._kernel_shim",
        json.dumps(job["limits"]),
        "-f",
        "{connection_file}",
    ]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "graded", "language": "python"})
    )
    return root


def run(job: dict, emit) -> None:
    """Execute the job's notebook in a kernel (test cells' probes piece by piece), emit results."""
    import nbformat

    nb = nbformat.from_dict(job["notebook"])
    probes = {}  # test cells (their probes only: the checks never come here) -> names to send
    for cell in nb.cells:
        test = cell.get("metadata", {}).get("grader_test")
        if test:
            probes[id(cell)] = list(test["exports"])

    def timeout_output():
        return nbformat.v4.new_output(
            "error",
            ename="TimeoutError",
            evalue=f"cell took over {job['cell_timeout']} s",
            traceback=[],
        )

    specs = kernelspec_dir(job)
    os.environ["JUPYTER_PATH"] = specs
    try:
        _run(job, emit, nb, probes, timeout_output)
    finally:
        shutil.rmtree(specs, ignore_errors=True)  # no graded-kernels-* left behind


def _run(job: dict, emit, nb, probes: dict, timeout_output) -> None:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    class Client(NotebookClient):
        published = None  # a list while a probe's values are being read back

        def output(self, outs, msg, display_id, cell_index):
            data = msg.get("content", {}).get("data") or {}
            if msg.get("msg_type") in ("display_data", "execute_result") and MIME in data:
                text = data[MIME]  # capped here: the kernel's own cap could be patched away
                if self.published is not None and isinstance(text, str) and len(text) <= MAX_BYTES:
                    self.published.append(text)
                return None  # never an output of the notebook
            size = sum(len(json.dumps(o)) for o in outs)
            if size > OUTPUT_LIMIT:
                if not any(o.get("name") == "grader" for o in outs):
                    outs.append(
                        nbformat.v4.new_output(
                            "stream", name="stdout", text="[grader] output truncated\n"
                        )
                    )
                    outs[-1]["name"] = "grader"
                return None
            return super().output(outs, msg, display_id, cell_index)

    workdir = job["workdir"]
    # The connection file must be readable by the kernel's uid: keep it in the work folder.
    os.environ["JUPYTER_RUNTIME_DIR"] = workdir
    client = Client(
        nb,
        kernel_name="graded",
        timeout=job["cell_timeout"],
        allow_errors=True,
        interrupt_on_timeout=True,
        resources={"metadata": {"path": workdir}},
    )
    dead = None
    with client.setup_kernel(cwd=workdir):
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            probe = {"probe_error": dead, "data": None}
            if dead is None:
                try:
                    if id(cell) in probes:
                        probe = run_test_cell(client, cell, index, probes[id(cell)], timeout_output)
                    else:
                        client.execute_cell(cell, index)
                except CellTimeoutError:
                    cell.outputs.append(timeout_output())
                except DeadKernelError as exc:
                    dead = f"the kernel died ({exc})"
                    probe = {"probe_error": dead, "data": None}
            if id(cell) in probes:
                if dead is not None and not cell.outputs:
                    cell.outputs = [
                        nbformat.v4.new_output(
                            "error", ename="KernelDied", evalue=dead, traceback=[]
                        )
                    ]
                cell.source = cells.without_hidden(cell.source)
                emit({"grade_id": cell.metadata["nbgrader"]["grade_id"], **probe})
    emit({"notebook": nb, "dead": dead})


def probe(uid: int) -> None:
    """Exit 0 if a kernel could run as ``uid`` here (called inside the namespaces)."""
    expose(needed_paths())
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    import ipykernel  # noqa: F401

    import helpers  # noqa: F401


def main() -> None:
    if sys.argv[1] == "--probe":
        probe(int(sys.argv[2]))
        return
    job_path, fd = sys.argv[1], int(sys.argv[2])
    job = json.loads(Path(job_path).read_text())
    for group in job.get("cgroups", []):  # first: every process started from here inherits it
        Path(group, "cgroup.procs").write_text(str(os.getpid()))
    out = os.fdopen(fd, "w", buffering=1)

    def emit(obj):
        out.write(json.dumps(obj) + "\n")

    applied = list(job.get("isolation", []))
    if job.get("expose"):
        exposed = expose(needed_paths())
        if exposed:
            applied.append(
                f"made readable for the submission's uid (parents hidden): {', '.join(exposed)}"
            )
    if job.get("netns"):
        applied.append(
            "network: private namespace, loopback only"
            if loopback_up()
            else "network: private namespace, loopback DOWN"
        )
    if job.get("hide"):
        hidden = hide(job["hide"])
        applied.append(
            f"hidden from the submission: {', '.join(hidden)}" if hidden else "hiding failed"
        )
    not_dumpable()
    emit({"isolation": applied})
    sys.stdout = sys.stderr  # nothing may write into the result channel but emit()
    try:
        run(job, emit)
    except Exception as exc:  # the kernel could not start, etc.: a grade with a reason, not a crash
        emit({"fatal": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    main()
