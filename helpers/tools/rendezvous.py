"""Can this node reach the rendezvous? A clear error in seconds instead of torch's after its
timeout (lecture 07, scripts/slurm/torchrun.sbatch).

    reach("node1:29400", timeout=60)           # returns once node1 answers, else raises
    python -m helpers.tools.rendezvous reach node1:29400 --timeout 60

torchrun's agent on a node that cannot reach the rendezvous host waits out its read timeout and
then reports only that the connection to the C10d store failed; ``reach`` names the address, the
reason (the name does not resolve, no route, no answer) and what to check.
"""

from __future__ import annotations

import socket
import sys
import time


class RendezvousUnreachable(RuntimeError):
    """The rendezvous endpoint's host does not answer from here: the message says what to check."""


def _connect_error(host: str, port: int, timeout: float) -> str | None:
    """Why a TCP connection to ``host``:``port`` fails (None: the host answered). A refusal is
    an answer: the host is there, and its agent may simply not have started its store yet."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except ConnectionRefusedError:
        return None
    except TimeoutError:
        return f"no answer in {timeout:g} s"
    except OSError as e:
        return e.strerror or str(e)


def reach(endpoint: str, timeout: float = 60.0) -> None:
    """Return once the host of ``endpoint`` (HOST:PORT) answers a TCP connection (a refusal
    counts: the host is up), else raise ``RendezvousUnreachable`` after ``timeout`` seconds,
    naming the address and what to check. torch's own agent would wait out its read timeout and
    then report only that the store's connection failed."""
    host, sep, port_text = endpoint.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"a rendezvous endpoint is HOST:PORT, not {endpoint!r}")
    here = socket.gethostname()
    try:
        socket.getaddrinfo(host, int(port_text), type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise RendezvousUnreachable(
            f"the rendezvous endpoint {endpoint}: {host!r} is not a name {here} can resolve "
            f"({e.strerror}). Use the head node's address, or check /etc/hosts or DNS on {here}."
        ) from None
    deadline = time.monotonic() + timeout
    while (why := _connect_error(host, int(port_text), min(5.0, timeout))) is not None:
        if time.monotonic() >= deadline:
            raise RendezvousUnreachable(
                f"the rendezvous endpoint {endpoint} cannot be reached from {here}: {why} "
                f"(tried for {timeout:g} s). Check that {host} is the address of the node that "
                "hosts the rendezvous (under Slurm the job's first node: `scontrol show "
                f"hostnames $SLURM_JOB_NODELIST | head -n 1`), that {here} has a route to it "
                f"(`ip route get {host}`), and that nothing drops port {port_text} between them."
            )
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    """``python -m helpers.tools.rendezvous reach HOST:PORT [--timeout S]``: what a node of a
    Slurm job runs before its torchrun agent (scripts/slurm/torchrun.sbatch)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m helpers.tools.rendezvous")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("reach", help="wait until the rendezvous host answers, or say why not")
    r.add_argument("endpoint", help="HOST:PORT of the rendezvous")
    r.add_argument("--timeout", type=float, default=60.0, help="seconds to keep trying")
    args = p.parse_args(argv)
    try:
        reach(args.endpoint, args.timeout)
    except (RendezvousUnreachable, ValueError) as e:
        print(f"rendezvous: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
