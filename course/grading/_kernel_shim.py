"""Start a graded kernel: apply resource limits and cores, drop to the job's uid, become ipykernel.

argv: LIMITS_JSON -f CONNECTION_FILE. Runs inside bubblewrap as root when the grader is root
(then the connection file is handed to the uid first), otherwise as the grader's own user with
the limits only. Started by course.grading.sandbox as ``python -m course.grading._kernel_shim``.
Trusts: its argv (the sandbox runner wrote the kernelspec). Does not trust what comes after it:
every limit, the environment's allowlist and the uid are in place before ``execv`` hands the
process to the kernel that runs the submission's code.

Also the one way a hidden probe's lines reach that kernel (``hidden_cell`` on the runner's side,
``run_hidden`` on the kernel's): as a file the kernel reads, deletes and runs outside IPython's
run_cell, so that their text enters none of what a later cell can read back (In, _ih, _i*, the
history database, linecache and the tracebacks' source lines). What the hidden lines *do* still
happens in the submission's kernel: its code is called on their inputs, and a kernel hooked in
advance (an audit hook, a patched ``compile``) can watch them run; what defends a hidden test is
that its inputs are drawn from the run's seed (course.grading.seeds), not that they are unseen.
"""

import contextlib
import json
import os
import resource
import secrets
import sys

SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}
KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_CLEAR, KEYCTL_GET_PERSISTENT = 1, 7, 22
KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING = -3, -4, -5


def forget_keys() -> None:
    """Empty this uid's kernel keyrings (its user, user-session and persistent keyrings) and
    start a fresh session keyring; raise OSError if one that exists cannot be emptied.

    Keyrings belong to the uid, not to a process or a mount: without this, a submission could
    leave a key that the next submission graded under the same uid reads. The persistent
    keyring outlives every process of the uid (it is what KEYCTL_GET_PERSISTENT hands out)."""
    import ctypes
    import errno
    import platform

    number = SYS_KEYCTL.get(platform.machine())
    if number is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long

    def keyctl(*args) -> int:
        return libc.syscall(number, *(ctypes.c_long(a) for a in args))

    def clear(ring: int, what: str) -> None:
        if keyctl(KEYCTL_CLEAR, ring) < 0:
            raise OSError(ctypes.get_errno(), f"could not empty the uid's {what}")

    # The uid's own keyrings emptied before anything new is made: keys left by a submission
    # count against the uid's key quota, and a full quota would stop this job's session keyring.
    if keyctl(KEYCTL_CLEAR, KEY_SPEC_USER_KEYRING) < 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM, errno.EACCES):
            return  # no keyctl here (a kernel without keys, or a seccomp filter): no key either
        raise OSError(ctypes.get_errno(), "could not empty the uid's user keyring")
    clear(KEY_SPEC_USER_SESSION_KEYRING, "user session keyring")
    if keyctl(KEYCTL_JOIN_SESSION_KEYRING, 0) < 0:
        raise OSError(ctypes.get_errno(), "could not start a fresh session keyring")
    persistent = keyctl(KEYCTL_GET_PERSISTENT, -1, KEY_SPEC_SESSION_KEYRING)
    if persistent >= 0:
        clear(persistent, "persistent keyring")
    elif ctypes.get_errno() != errno.EOPNOTSUPP:  # a kernel built without persistent keyrings
        raise OSError(ctypes.get_errno(), "could not reach the uid's persistent keyring")


HIDDEN_NAME = "<hidden test>"  # linecache keeps no lines for a name in <...>: none to read back


def execute_piece(client, piece, hidden: bool, index: int) -> None:
    """(The runner's side.) Execute one piece of a probe with nbclient's ``client``; a hidden
    one as a file the kernel reads (``hidden_cell``), never as a cell's text: its lines stay
    out of the kernel's history, where a later cell of the submission could read them and print
    them into its feedback."""
    if not hidden:
        client.execute_cell(piece, index)
        return
    with hidden_cell(piece.source, client.resources["metadata"]["path"]) as source:
        piece.source = source
        client.execute_cell(piece, index, store_history=False)


@contextlib.contextmanager
def hidden_cell(code: str, workdir: str):
    """(The runner's side.) The source of a cell that runs ``code`` in the kernel with
    ``run_hidden``: ``code`` goes into a new file of the kernel's work folder (only the kernel's
    uid enters it: the folder is its own, mode 0700), and the cell names only that file, which
    is removed afterwards whatever the kernel did. Root's O_EXCL | O_NOFOLLOW create, in a
    folder the uid owns, follows no link planted there. A folder the submission filled leaves
    no room for the file: then the cell raises, and the test fails as the piece would have."""
    path = os.path.join(workdir, f".hidden-{secrets.token_hex(16)}.py")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(code)
        cell = f"__import__('course.grading._kernel_shim', fromlist=['run_hidden']).run_hidden({path!r})"
    except OSError as exc:
        why = f"the work folder has no room for a hidden test: {exc.strerror}"
        cell = f"raise OSError({why!r})"
    try:
        yield cell
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def run_hidden(path: str) -> None:
    """(The kernel's side.) Run the hidden piece in ``path`` in the notebook's namespace, as its
    cell would, after deleting the file. Compiled under a name no cache keeps lines for and run
    by ``exec``, not by IPython's run_cell: its text enters no history, no linecache, and no
    traceback's source lines, and no value of it is displayed into ``_`` or Out. An exception
    it raises goes on as it is (its name is the feedback's "a hidden test failed")."""
    from IPython import get_ipython

    with open(path, encoding="utf-8") as f:
        code = compile(f.read(), HIDDEN_NAME, "exec", dont_inherit=True)
    os.unlink(path)
    shell = get_ipython()
    # the text itself is not kept here: a traceback holds this frame's locals, the code only
    exec(code, shell.user_global_ns, shell.user_ns)


def main() -> None:
    limits = json.loads(sys.argv[1])
    connection_file = sys.argv[3]
    uid = limits.get("uid")
    for name, value in limits.get("rlimits", {}).items():
        resource.setrlimit(getattr(resource, name), (value, value))
    if limits.get("cpus"):  # this grading slot's cores: parallel submissions do not share one
        os.sched_setaffinity(0, limits["cpus"])
    if uid is not None and os.geteuid() == 0:
        os.chown(connection_file, uid, uid)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        forget_keys()
    os.environ.update(limits.get("env", {}))
    os.execv(sys.executable, [sys.executable, "-m", "ipykernel_launcher", "-f", connection_file])


if __name__ == "__main__":
    main()
