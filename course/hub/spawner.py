"""CourseSpawner: JupyterHub's LocalProcessSpawner with each student's server in a cgroup of its
own, enforcing ``Spawner.cpu_limit`` and ``Spawner.mem_limit`` as hub spawners do.

LocalProcessSpawner only passes the limits on as $CPU_LIMIT and $MEM_LIMIT, which nothing
enforces. SystemdSpawner and KubeSpawner enforce them with the kernel's CFS quota and memory
limit; this spawner does the same with a cgroup per server (course.hub.cgroups), plus a cap on
tasks so a fork storm stays inside one student. The server joins its cgroup in the forked child
before the switch to the student's uid and before exec, so its kernels, their launcher ranks
and everything else it starts are counted from the first instruction. Stopping the server kills
what is left in the cgroup and removes it.
"""

from __future__ import annotations

import asyncio

from jupyterhub.spawner import LocalProcessSpawner
from traitlets import Dict, Integer

from course.hub import cgroups


class CourseSpawner(LocalProcessSpawner):
    """A local process per student, limited by a cgroup of its own."""

    pids_limit = Integer(
        1024,
        help="Most tasks (processes and threads) a student's server and all it starts may have.",
    ).tag(config=True)

    cgroup_tree = Dict(
        help="The hub's cgroup tree (course.hub.cgroups.Group.dirs): students' cgroups go below "
        "it. Set by jupyterhub_config.py.",
    ).tag(config=True)

    def limits(self) -> cgroups.Limits:
        """The limits configured for this server (cpu_limit, mem_limit, pids_limit)."""
        return cgroups.Limits(
            cpu=self.cpu_limit or None,
            memory=self.mem_limit or None,
            pids=self.pids_limit or None,
        )

    def cgroup(self) -> cgroups.Group:
        if not self.cgroup_tree:
            raise RuntimeError("CourseSpawner.cgroup_tree is not set: use course/hub's config")
        return cgroups.user_group(cgroups.Group(self.cgroup_tree), self.user.name)

    def make_preexec_fn(self, name):
        """Join the student's cgroup, then become the student (LocalProcessSpawner's)."""
        join = cgroups.joiner(self.cgroup())
        become = super().make_preexec_fn(name)

        def preexec():
            join()  # still root: a student could not move itself in, nor out
            become()

        return preexec

    async def start(self):
        group = self.cgroup()
        await self._clear(group)  # a server the hub lost track of would share the new limits
        cgroups.make(group, self.limits())
        self.log.info("cgroup %s: %s", group.folders()[0].name, self.limits())
        try:
            return await super().start()
        except BaseException:
            await self._clear(group)
            raise

    async def stop(self, now=False):
        try:
            await super().stop(now=now)
        finally:
            await self._clear(self.cgroup())

    async def _clear(self, group: cgroups.Group) -> None:
        """Kill what is left in ``group`` and remove it (nothing to do if it is gone)."""
        await asyncio.to_thread(cgroups.kill, group)
        await asyncio.to_thread(cgroups.remove, group)
