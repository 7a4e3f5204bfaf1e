"""Start a graded kernel: apply resource limits, drop to the job's uid, then become ipykernel.

argv: LIMITS_JSON -f CONNECTION_FILE. Runs as root when the grader is root (then the connection
file is handed to the uid first), otherwise as the grader's own user with the limits only.
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
    if uid is not None and os.geteuid() == 0:
        os.chown(connection_file, uid, uid)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    os.environ.update(limits.get("env", {}))
    os.execv(sys.executable, [sys.executable, "-m", "ipykernel_launcher", "-f", connection_file])


if __name__ == "__main__":
    main()
