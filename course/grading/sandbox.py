"""Run one submission's notebook in isolation and stream its test results to the grader.

Started by course.grading.runner as
``[unshare --net --mount --fork --] python -m course.grading.sandbox JOB FD`` (and by
course.grading.isolation as ``... course.grading.sandbox --probe UID``, to learn whether a kernel
can start here as another uid). This process stays root where the grader is root; no student
code ever runs in it. It
  1. reads the job (the notebook; its test cells hold only their probes) while it can,
  2. brings loopback up in its new network namespace (no network, ports of its own),
  3. makes itself non-dumpable (the submission cannot read the secrets in its memory),
  4. starts the kernel in bubblewrap (``bwrap_argv``: a file view built from an allowlist,
     private /tmp, PID namespace and /proc, an empty environment), through
     course.grading._kernel_shim, which applies the resource limits and the job's cores, sets
     the environment's allowlist and drops to the job's unprivileged uid before the kernel
     starts,
  5. runs every cell (a failing cell does not stop the run) and, after each test cell's probe,
     writes one JSON line to FD: the probe's error, if any, and the values its check reads, as
     the kernel published them (course.grading.plain). The last line carries the executed
     notebook.
Trusts: the job file (the grader wrote it, in a folder only root can enter). Does not trust:
anything that comes out of the kernel (every message is the submission's to forge: outputs are
capped and filtered as they arrive, by course.grading.client). Nothing here decides a grade: the
grader runs each test's check on the published data in an interpreter of its own
(course.grading.verdict).
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from course.grading import _kernel_shim, cells

# The caps are re-exported: the reports and tests read them here, where a submission runs.
from course.grading.client import (  # noqa: F401
    FIGURE_LIMIT,
    OUTPUT_LIMIT,
    SUBMISSION_OUTPUT_LIMIT,
    Guarded,
    bounded,
)
from course.grading.isolation import bwrap_sizes, sized_work_folder


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


# What a kernel may see of /etc: the dynamic loader's cache, names of users and hosts (gloo
# resolves "localhost"), the time zone, fontconfig's configuration (without it every plot prints
# "Fontconfig error: Cannot load default config file" into the feedback). Nothing else of the
# machine's configuration.
ETC = (
    "fonts",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "passwd",
    "group",
    "hosts",
    "host.conf",
    "nsswitch.conf",
    "gai.conf",
    "localtime",
)
# Of the course, only the code a kernel imports: never its git history, tests, solutions, built
# notebooks or the instructor's folders (they hold the answers).
COURSE_CODE = ("helpers", "course")


def course_root() -> str:
    import course

    return os.path.dirname(os.path.dirname(os.path.abspath(course.__file__)))


def needed_paths() -> list[str]:
    """What a kernel must read: the base interpreter, the environment, the course's code."""
    paths = [sys.base_prefix, sys.prefix] + [os.path.join(course_root(), n) for n in COURSE_CODE]
    return list(dict.fromkeys(os.path.realpath(p) for p in paths))


def _ancestors(paths: list[str]) -> set[str]:
    """Every folder above ``paths`` but / and /usr (bound whole) and the paths themselves."""
    out = set()
    for p in paths:
        parent = os.path.dirname(p)
        while parent not in ("/", "/usr") and not parent.startswith("/usr/"):
            out.add(parent)
            parent = os.path.dirname(parent)
    return out - set(paths)


def bwrap_argv(workdir: str, size: int | None = None) -> list[str]:
    """bubblewrap's command line for one job: a file view built from an allowlist.

    Read-only: /usr (and the /bin, /lib... that point into it), the interpreter, the venv, the
    course's code and a few files of /etc. Writable: the job's work folder only. Private: /tmp,
    /var/tmp and /dev/shm (empty tmpfs, gone with the job), the PID namespace and its /proc, IPC,
    the host name. The environment is emptied (the shim sets the job's allowlist); bwrap sets
    no_new_privs. The network namespace is the runner's (made by `unshare --net`): the kernel
    must reach the runner on loopback, and nothing else."""
    argv = ["bwrap", "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc"]
    argv += ["--unshare-uts", "--hostname", "sandbox", "--unshare-cgroup-try"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    # bwrap mounts in order: the private tmpfs first, so that a course or venv that lives under
    # /tmp (a CI clone) is bound on top of it rather than hidden beneath it.
    argv += ["--perms", "0755", "--dir", "/etc", "--perms", "0755", "--dir", "/var"]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    private, sized = ("/dev/shm", "/tmp", "/var/tmp"), ["--size", str(size)] if size else []
    for folder in private:  # writable by anyone, as on the host; as big as the work folder
        argv += ["--perms", "1777", *(sized if bwrap_sizes() else []), "--tmpfs", folder]
    # Folders bwrap creates on the way to a bind are 0700 (root's): make them enterable, or the
    # job's uid cannot reach an interpreter under /root, a venv under /work, or a work folder
    # that TMPDIR put below /tmp.
    for folder in sorted(_ancestors([*needed_paths(), workdir]) - {"/etc", "/var", *private}):
        argv += ["--perms", "0755", "--dir", folder]
    for p in needed_paths():
        argv += ["--ro-bind", p, p]
    for name in ETC:
        if os.path.exists(os.path.join("/etc", name)):
            argv += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    argv += ["--bind", workdir, workdir, "--chdir", workdir, "--clearenv"]
    return argv


def not_dumpable() -> None:
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no ptrace, no /proc/pid/mem


def hidden_error(ename: str):
    import nbformat

    return nbformat.v4.new_output(
        "error", ename=ename or "Error", evalue="a hidden test failed", traceback=[]
    )


def stopped_at_the_limit(client, cell) -> str:
    """The words for a cell the runner interrupted at its time limit, also put in its outputs."""
    import nbformat

    text = (
        f"[grader] stopped at the {client.timeout:g} s cell limit (the grader interrupted the "
        "kernel; a launch that was still waiting says above where each rank was)"
    )
    cell.outputs.append(nbformat.v4.new_output("stream", name="stdout", text=f"{text}\n"))
    cell.outputs[-1]["name"] = "grader"
    return text


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
    forget = f"__import__('course.grading.plain', fromlist=['forget']).forget({names!r})"
    try:  # the grader's own cells stay out of the kernel's history: In is the notebook's
        client.execute_cell(nbformat.v4.new_code_cell(forget), index, store_history=False)
    except CellTimeoutError:
        error = "TimeoutError: the kernel did not answer before the probe"
    for code, hidden in cells.segments(cell.source) if error is None else []:
        piece = nbformat.v4.new_code_cell(code)
        client.timed_out = False
        try:  # a hidden piece goes as a file: its lines stay out of the kernel's history
            _kernel_shim.execute_piece(client, piece, hidden, index)
        except CellTimeoutError:
            piece.outputs.append(timeout_output())
        errors = [o for o in piece.outputs if o.get("output_type") == "error"]
        if client.timed_out:  # interrupted at the limit: "KeyboardInterrupt" alone says nothing
            error = stopped_at_the_limit(client, piece)
        elif errors:
            ename = str(errors[0].get("ename", "Error"))
            evalue = "a hidden test failed" if hidden else str(errors[0].get("evalue", ""))
            error = f"{ename}: {evalue}"
            if error.startswith("[grader]"):  # the grader's voice is the grader's alone
                error = "your code raised " + error
        if hidden:
            piece.outputs = [hidden_error(errors[0].get("ename"))] if errors else []
        merged += piece.outputs
        if errors or client.timed_out:
            break
    data = None
    if error is None:
        export = nbformat.v4.new_code_cell(
            f"__import__('course.grading.plain', fromlist=['publish']).publish({names!r})"
        )
        client.published = []
        try:
            client.execute_cell(export, index, store_history=False)
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
    """A private kernelspec 'graded' whose argv goes through bwrap (file view) and the shim
    (limits, cores, uid)."""
    root = tempfile.mkdtemp(prefix="graded-kernels-")
    spec = Path(root, "kernels", "graded")
    spec.mkdir(parents=True)
    argv = bwrap_argv(job["workdir"], job.get("work_size")) if job.get("bwrap") else []
    argv += [
        sys.executable,
        "-m",
        "course.grading._kernel_shim",
        json.dumps(job["limits"]),
        "-f",
        "{connection_file}",
    ]
    # Interrupts go as a message on the control channel (the kernel signals itself): a signal
    # to bwrap's process group would not reach into its PID namespace, or would kill bwrap.
    spec_json = {"argv": argv, "display_name": "graded", "language": "python"}
    (spec / "kernel.json").write_text(json.dumps({**spec_json, "interrupt_mode": "message"}))
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
    """Run every code cell of the assembled notebook in the sandboxed kernel, emitting each test
    cell's probe and then the notebook."""
    from nbclient import NotebookClient

    from course.kernel import guard_missed_wakeups

    guard_missed_wakeups()

    class Client(Guarded, NotebookClient):
        pass

    workdir = job["workdir"]
    client = Client(
        nb,
        kernel_name="graded",
        timeout=job["cell_timeout"],
        allow_errors=True,
        interrupt_on_timeout=True,
        resources={"metadata": {"path": workdir}},
    )
    client.cell_bytes, client.noted, client.work_folder = {}, set(), workdir
    dead = None
    # The kernel's own stdout and stderr go nowhere: it must hold no descriptor of ours.
    with client.setup_kernel(cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL):
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            names = probes.get(id(cell))
            probe, dead = _run_cell(client, cell, index, names, timeout_output, dead)
            if names is not None:
                _emit_probe(cell, probe, dead, emit)
    emit({"notebook": bounded(nb), "dead": dead})


def _run_cell(client, cell, index: int, names, timeout_output, dead):
    """One code cell (a test cell's probe piece by piece when ``names`` lists what it sends);
    nothing once the kernel is dead. Returns (the probe's result, why the kernel died or None)."""
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    probe = {"probe_error": dead, "data": None}
    if dead is not None:
        return probe, dead
    try:
        if names is not None:
            probe = run_test_cell(client, cell, index, names, timeout_output)
        else:
            client.timed_out = False
            client.execute_cell(cell, index)
            if client.timed_out:
                stopped_at_the_limit(client, cell)
    except CellTimeoutError:
        cell.outputs.append(timeout_output())
    except DeadKernelError as exc:
        dead = f"the kernel died ({exc})"
        probe = {"probe_error": dead, "data": None}
    return probe, dead


def _emit_probe(cell, probe: dict, dead, emit) -> None:
    """A test cell's line to the grader; the cell keeps its visible probe (and says the kernel
    died, when it did)."""
    import nbformat

    if dead is not None and not cell.outputs:
        error = nbformat.v4.new_output("error", ename="KernelDied", evalue=dead, traceback=[])
        cell.outputs = [error]
    cell.source = cells.without_hidden(cell.source)
    emit({"grade_id": cell.metadata["nbgrader"]["grade_id"], **probe})


def probe(uid: int) -> None:
    """Exit 0 if a kernel could run as ``uid`` in the file view (called inside the namespaces)."""
    work = tempfile.mkdtemp(prefix="grade-probe-")
    try:
        os.chmod(work, 0o755)
        inside = f"import os; os.setgroups([]); os.setgid({uid}); os.setuid({uid}); "
        inside += "import ipykernel, helpers"
        argv = bwrap_argv(work) + [sys.executable, "-c", inside]
        sys.exit(subprocess.run(argv, stdin=subprocess.DEVNULL, timeout=60).returncode)
    finally:
        shutil.rmtree(work, ignore_errors=True)


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
    if job.get("netns"):
        applied.append(
            "network: private namespace, loopback only"
            if loopback_up()
            else "network: private namespace, loopback DOWN"
        )
    if job.get("netns") and job.get("work_size") and os.geteuid() == 0:
        applied.append(
            sized_work_folder(job["workdir"], job["work_size"], job["limits"].get("uid"))
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
