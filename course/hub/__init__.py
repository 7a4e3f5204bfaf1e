"""The course on a JupyterHub: start and stop it, add students, and each student's cgroup.

`scripts/hub.sh` (docs/hub.md) is the command; these are the functions it calls.
"""

from course.hub.accounts import add_student, remove_student
from course.hub.server import api_token, start, stop

__all__ = ["add_student", "api_token", "remove_student", "start", "stop"]
