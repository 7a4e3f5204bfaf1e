"""Start a graded kernel: apply resource limits and cores, drop to the job's uid, become ipykernel.

argv: LIMITS_JSON -f CONNECTION_FILE. Runs inside bubblewrap as root when the grader is root
(then the connection file is handed to the uid first), otherwise as the grader's own user with
the limits only.
"""

import json
import os
import resource
import sys


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
    os.environ.update(limits.get("env", {}))
    os.execv(sys.executable, [sys.executable, "-m", "ipykernel_launcher", "-f", connection_file])


if __name__ == "__main__":
    main()
