"""Start a graded kernel: apply resource limits and cores, drop to the job's uid, become ipykernel.

argv: LIMITS_JSON -f CONNECTION_FILE. Runs inside bubblewrap as root when the grader is root
(then the connection file is handed to the uid first), otherwise as the grader's own user with
the limits only. Started by course.grading.sandbox as ``python -m course.grading._kernel_shim``.
Trusts: its argv (the sandbox runner wrote the kernelspec). Does not trust what comes after it:
every limit, the environment's allowlist and the uid are in place before ``execv`` hands the
process to the kernel that runs the submission's code.
"""

import json
import os
import resource
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
