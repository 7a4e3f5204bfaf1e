"""A rendezvous address that cannot be reached: a clear error naming it, in seconds, never a hang
(helpers/tools/rendezvous.py; scripts/slurm/torchrun.sbatch runs it on every node first).

The name that does not resolve is checked everywhere; the address with no host behind it needs a
network of its own (two namespaces, root, COURSE_CLUSTER_TESTS=1), as the host's own network may
answer for any address (a sandbox's gateway refuses at once, which counts as an answer).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from helpers.tools import interconnect, multinode, rendezvous


def test_a_name_that_does_not_resolve_is_named_at_once():
    start = time.monotonic()
    with pytest.raises(rendezvous.RendezvousUnreachable, match="'no-such-node.invalid' is not a"):
        rendezvous.reach("no-such-node.invalid:29400", timeout=30)
    assert time.monotonic() - start < 15  # the resolver's answer, not the 30 s


def test_agents_check_their_endpoint_before_any_agent_starts():
    with pytest.raises(rendezvous.RendezvousUnreachable, match="no-such-node.invalid"):
        multinode.agents("helpers.tools.multinode:whoami", endpoint="no-such-node.invalid:29400")


def test_an_endpoint_without_a_port_is_refused():
    with pytest.raises(ValueError, match="HOST:PORT"):
        rendezvous.reach("node1", timeout=1)


def test_a_listening_endpoint_is_reached(tmp_path):
    port = multinode.free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", f"import socket,time; s=socket.create_server(('127.0.0.1',{port}));"
         "print('up', flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert server.stdout.readline().strip() == "up"
        rendezvous.reach(f"127.0.0.1:{port}", timeout=5)  # returns: no exception
    finally:
        server.kill()
        server.wait()


@pytest.mark.skipif(
    os.environ.get("COURSE_CLUSTER_TESTS") != "1" or interconnect.cannot_run() is not None,
    reason="needs two namespaces: root and COURSE_CLUSTER_TESTS=1",
)
def test_an_address_no_node_has_fails_after_the_timeout_naming_it():
    nobody = f"{interconnect.SUBNET}.99:29400"
    code = "import sys; from helpers.tools.rendezvous import main; sys.exit(main(sys.argv[1:]))"
    with interconnect.nodes() as (node, _):
        start = time.monotonic()
        proc = subprocess.run(
            ["nsenter", f"--net=/run/netns/{node.netns}", sys.executable, "-c", code]
            + ["reach", nobody, "--timeout", "4"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        took = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr
    assert f"the rendezvous endpoint {nobody} cannot be reached from" in proc.stderr
    assert "ip route get" in proc.stderr and "port 29400" in proc.stderr
    assert took < 60  # the 4 s asked for, plus the interpreter's start on a busy machine
