"""JupyterHub for the course on one machine: local students, the course kernel, limits, culling.

Start it with `scripts/hub.sh start` (docs/hub.md), which chooses the state folder and the
ports and sets the variables below; `jupyterhub -f course/hub/jupyterhub_config.py` as root
works too. Every setting an admin may change is an environment variable, read here once:

  COURSE_HUB_STATE          folder for the database, cookie secret, logs (not in the repo)
  COURSE_HUB_IP, _PORT      where students connect (default all interfaces, 8000)
  COURSE_HUB_CPU_LIMIT      CPUs of quota per student (CFS quota; default 2)
  COURSE_HUB_MEM_LIMIT      memory per student, e.g. 4G (default 4G)
  COURSE_HUB_PIDS_LIMIT     processes and threads per student (default 1024)
  COURSE_HUB_CULL_TIMEOUT   seconds idle before a server is stopped (default 3600)
  COURSE_HUB_CULL_EVERY     seconds between the culler's checks (default 300)
  COURSE_HUB_GROUP          the students' Unix group: who may log in (default course-students)
"""

import os
import secrets
import sys
from pathlib import Path

from course.hub import accounts, cgroups

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv"
PROXY = VENV / "node" / "node_modules" / ".bin" / "configurable-http-proxy"

c = get_config()  # noqa: F821 (JupyterHub's config loader defines it)
env = os.environ.get

state = Path(env("COURSE_HUB_STATE", "/var/lib/multigpu-course-hub")).resolve()
if state == REPO or REPO in state.parents:
    raise ValueError(f"COURSE_HUB_STATE={state} is inside the repository: pick a folder outside it")
state.mkdir(parents=True, exist_ok=True)
state.chmod(0o700)  # the cookie secret and the database are the hub's alone
group = env("COURSE_HUB_GROUP", accounts.DEFAULT_GROUP)

# --- where it listens, what it keeps -------------------------------------------------------
c.JupyterHub.ip = env("COURSE_HUB_IP", "")
c.JupyterHub.port = int(env("COURSE_HUB_PORT", "8000"))
c.JupyterHub.hub_port = int(env("COURSE_HUB_HUB_PORT", "8081"))
c.JupyterHub.db_url = f"sqlite:///{state / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(state / "jupyterhub_cookie_secret")
c.JupyterHub.pid_file = str(state / "jupyterhub.pid")
c.JupyterHub.cleanup_servers = True  # the hub's stop stops every student's server
c.JupyterHub.cleanup_proxy = True

# --- the proxy: the pinned configurable-http-proxy that scripts/setup.sh put in .venv/node ---
if not PROXY.exists():
    raise FileNotFoundError(f"{PROXY} is missing: run scripts/setup.sh (it installs the proxy)")
c.ConfigurableHTTPProxy.command = [str(PROXY)]
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{env('COURSE_HUB_PROXY_API_PORT', '8001')}"
c.ConfigurableHTTPProxy.pid_file = str(state / "proxy.pid")

# --- students: the machine's users in the students' group, logged in with their password -----
c.JupyterHub.authenticator_class = "jupyterhub.auth.PAMAuthenticator"
c.PAMAuthenticator.allowed_groups = {group}

# --- each student's JupyterLab: the course's environment, limited by a cgroup --------------
c.JupyterHub.spawner_class = "course.hub.spawner.CourseSpawner"
c.Spawner.cmd = [str(VENV / "bin" / "jupyterhub-singleuser")]
c.Spawner.default_url = "/lab"
c.Spawner.notebook_dir = "~"
c.Spawner.cpu_limit = float(env("COURSE_HUB_CPU_LIMIT", "2"))
mem_limit = env("COURSE_HUB_MEM_LIMIT", "4G")
c.Spawner.mem_limit = int(mem_limit) if mem_limit.isdigit() else mem_limit  # bytes, or 4G
c.CourseSpawner.pids_limit = int(env("COURSE_HUB_PIDS_LIMIT", "1024"))
c.Spawner.start_timeout = 120  # a loaded machine starts a server in seconds, not minutes
c.Spawner.environment = {
    # .venv first: `python`, `pip` and `jupyter` in a student's terminal are the course's
    "PATH": f"{VENV / 'bin'}:/usr/local/bin:/usr/bin:/bin",
    # how often the server tells the hub it is in use (the culler reads that)
    "JUPYTERHUB_ACTIVITY_INTERVAL": env("COURSE_HUB_ACTIVITY_INTERVAL", "60"),
}

# The hub, its proxy and services go into <tree>/hub, each student's server into
# <tree>/user-<name> (CourseSpawner): scripts/hub.sh stop kills and removes the whole tree.
tree = cgroups.make(cgroups.here().child(f"course-hub-{c.JupyterHub.port}"))
cgroups.join(cgroups.make(tree.child("hub")))
(state / "cgroups.json").write_text(tree.to_json())
c.CourseSpawner.cgroup_tree = tree.dirs

# Students run .venv's Python: let their group pass through the folders above it (accounts).
accounts.grant_passage([VENV / "bin" / "python", REPO], group, state / "acl-grants.json")
accounts.check_can_run(VENV / "bin" / "python", group)
# ...and not the solutions: a student could copy them into ~/course and hand them in.
accounts.hide_from_students(REPO, group)

# --- services: the idle culler, and a token for `course` commands that read the hub's users --
token_file = state / "api_token"
if not token_file.exists():
    token_file.write_text(secrets.token_hex(32))
    token_file.chmod(0o600)
c.JupyterHub.services = [
    {
        "name": "idle-culler",
        "command": [
            sys.executable,
            "-m",
            "jupyterhub_idle_culler",
            f"--timeout={int(env('COURSE_HUB_CULL_TIMEOUT', '3600'))}",
            f"--cull-every={int(env('COURSE_HUB_CULL_EVERY', '300'))}",
        ],
    },
    {"name": "course", "api_token": token_file.read_text().strip()},
]
c.JupyterHub.load_roles = [
    {
        "name": "idle-culler",
        "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"],
        "services": ["idle-culler"],
    },
    {
        "name": "course",
        "scopes": ["list:users", "read:users", "read:servers", "list:services", "read:services"],
        "services": ["course"],
    },
]
