"""The link between two nodes as an experiment (lecture 07, section 5).

    reason = interconnect.cannot_run()          # None where this process can make the nodes
    run = interconnect.across_nodes(plan)       # rank 0's numbers, each rate of the plan
    run = interconnect.recorded()               # a run recorded on the course's machine

Two "nodes" are two network namespaces joined by a veth pair, each end with its own address on
a private subnet that exists only inside them; a rank runs on each, pinned to a core of its own,
and the two form one gloo world over the pair (``helpers.run``, as under torchrun). Each rank
shapes its own end with ``tc`` (``link_rank``), so the pair behaves as a link of the plan's
rate. Everything is torn down when the run ends, also when it fails: the ranks are killed, and
deleting the namespaces takes their ends of the pair and the shaping with them.

Needs root, or a kernel that lets users make user namespaces (then the run happens in one, in
which the user is root); ``ip`` and ``tc`` (iproute2), and veth and the ``tbf`` queueing
discipline in the kernel. ``cannot_run()`` says which of these is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from helpers.tools import link_rank
from helpers.tools.multinode import wait_all

SUBNET = "10.237.44"  # private, inside the two namespaces only (the Slurm cluster uses .43)
MTU = 9000  # jumbo frames, as cluster networks use: headers are under 1 % of each packet
PORT = 29500  # the namespaces are new: nothing else listens there
RECORDED = Path(__file__).with_name("interconnect_recorded.json")
# TCP/IPv4 with timestamps: 20 (IP) + 20 (TCP) + 12 (options) bytes of each MTU are headers,
# and tbf also counts the Ethernet header (14 bytes) of every frame it sends
HEADERS, ETHERNET, ACK = 52, 14, 66
# the lecture's quick run: a fast and a slow link (Mbit/s), and the all-reduce sizes as the
# milliseconds each takes on the wire at the link's rate (every one well above tbf's burst)
QUICK_RATES = (1000, 100)
QUICK_WIRE_MS = (4, 16, 64)


def payload_share(mtu: int = MTU) -> float:
    """The share of the bytes ``tbf`` counts that are the application's. Per two full frames
    (MTU + 14 bytes each, MTU − 52 of them payload) a node also sends one ACK (a 66-byte frame,
    delayed ACKs) for the data coming the other way, as both directions carry an all-reduce."""
    return 2 * (mtu - HEADERS) / (2 * (mtu + ETHERNET) + ACK)


def expected_bandwidth(rate_mbit: float, mtu: int = MTU) -> float:
    """Bytes/s of payload a link shaped to ``rate_mbit`` carries: the physical anchor.

    For an all-reduce of S bytes on 2 ranks each rank sends S (half in the reduce-scatter, half
    in the all-gather), so t ≈ α + S / β with β this bandwidth."""
    return rate_mbit * 1e6 / 8 * payload_share(mtu)


@dataclass(frozen=True)
class Node:
    netns: str
    address: str
    core: int

    @property
    def dev(self) -> str:
        return self.netns  # each namespace's end of the pair is named after it


def cannot_run() -> str | None:
    """Why this process cannot make the two nodes (None when it can: as root, or as a user
    where the kernel lets users make namespaces of their own, in which that user is root)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux's, and this is " + sys.platform
    missing = [p for p in ("ip", "tc", "nsenter", "unshare", "taskset") if _which(p) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (Debian: apt-get install iproute2 util-linux)"
    if os.geteuid() != 0 and not _user_namespaces():
        return (
            "this kernel runs as a user, not root, and this machine does not let users make "
            "namespaces of their own (user namespaces): making the nodes' network and shaping "
            "its link with tc need root (CAP_NET_ADMIN)"
        )
    return None


# a user namespace in which this user is root, with a network and mount namespace of its own
# and /run as a fresh tmpfs (``ip netns`` pins namespaces under /run/netns, root's otherwise)
USERNS = ["--user", "--map-root-user", "--net", "--mount", "--propagation", "private", "--",
          "sh", "-c", 'mount -t tmpfs course /run && mkdir /run/netns && exec "$@"', "userns"]  # fmt: skip


def _user_namespaces() -> bool:
    """Whether this user may make the namespaces ``USERNS`` makes (tried, not guessed)."""
    try:
        probe = [_which("unshare") or "unshare", *USERNS, "true"]
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _which(program: str) -> str | None:
    return shutil.which(program, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def _ip(*args: str) -> None:
    proc = subprocess.run([_which("ip") or "ip", *args], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")


def _exists(netns: str) -> bool:
    return Path("/run/netns", netns).exists()


@contextlib.contextmanager
def nodes():
    """Two namespaces joined by a veth pair (MTU ``MTU``); yields their two ``Node``s and
    deletes both namespaces on the way out, whatever happened (their ends and any shaping go
    with them). Names carry this process's id, so two runs never share a namespace."""
    cores = sorted(os.sched_getaffinity(0))
    made = [
        Node(f"cl{os.getpid()}-{i}", f"{SUBNET}.{i + 1}", cores[i % len(cores)]) for i in range(2)
    ]
    a, b = made
    try:
        for n in made:
            _ip("netns", "add", n.netns)
        _ip("link", "add", a.dev, "netns", a.netns, "type", "veth", "peer", "name", b.dev,
            "netns", b.netns)  # fmt: skip
        for n in made:
            _ip("-n", n.netns, "addr", "add", f"{n.address}/24", "dev", n.dev)
            _ip("-n", n.netns, "link", "set", n.dev, "mtu", str(MTU), "up")
            _ip("-n", n.netns, "link", "set", "lo", "up")
        yield made
    finally:
        errors = []
        for n in made:
            try:
                if _exists(n.netns):
                    _ip("netns", "delete", n.netns)
            except RuntimeError as e:  # the other namespace must still go
                errors.append(e)
        if errors:
            raise errors[0]


def rank_command(node: Node, target: str, args: list[str], folder: Path) -> list[str]:
    """The command that runs ``target`` as a rank on ``node``: in its network namespace, on
    its own core, through ``helpers.run`` (the entry point torchrun starts on a cluster).

    ``folder`` holds the results and an empty ``resolv.conf``, bound over /etc/resolv.conf in a
    private mount namespace: the nodes' network has no name server, and c10d asks for its
    peers' names; with the host's resolv.conf each question waits out the resolver's timeouts
    (5 s each, seen here) before failing, with an empty one it fails at once."""
    enter = [_which("nsenter") or "nsenter", f"--net=/run/netns/{node.netns}"]
    private = [_which("unshare") or "unshare", "--mount", "--propagation", "private", "--"]
    resolv = shlex.quote(str(folder / "resolv.conf"))
    bind = ["sh", "-c", f'mount --bind {resolv} /etc/resolv.conf && exec "$@"', node.netns]
    pin = [_which("taskset") or "taskset", "-c", str(node.core)]
    run = [sys.executable, "-m", "helpers.run", target, *args, "--out", str(folder / "out.pkl")]
    return [*enter, *private, *bind, *pin, *run]


def _rank_env(rank: int, node: Node, head: Node) -> dict:
    """torchrun's variables for ``rank`` (one rank per node), gloo on the node's end."""
    return {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": head.address,
        "MASTER_PORT": str(PORT),
        "GLOO_SOCKET_IFNAME": node.dev,  # gloo's address: this node's end of the pair
        "HELPERS_THREADS": "1",
    }


def run_ranks(target: str, args: list[str], timeout: float = 300.0) -> list:
    """Run ``target`` (module:function) with ``args`` as a world of 2, a rank on each node of a
    fresh pair; return what the ranks returned (rank order). Raises with the ranks' output when
    one fails or the time runs out. The ranks are killed before the nodes go (also on an
    interrupt: the stop button), so nothing is left either way."""
    folder = Path(tempfile.mkdtemp(prefix="interconnect-"))
    (folder / "resolv.conf").write_text("# no name server on the nodes' network\n")
    procs = []
    try:
        with nodes() as pair:
            try:
                for rank, node in enumerate(pair):
                    cmd = rank_command(node, target, args, folder)
                    procs.append(subprocess.Popen(cmd, env=_rank_env(rank, node, pair[0]),
                                                  stdout=subprocess.PIPE,
                                                  stderr=subprocess.STDOUT, text=True))  # fmt: skip
                timed_out, logs = wait_all(procs, timeout)  # kills what is left
            finally:
                for p in procs:  # interrupted or failed to start: none outlives its node
                    if p.poll() is None:
                        p.kill()
                        p.wait()
        if timed_out or any(p.returncode for p in procs):
            what = f"did not finish in {timeout:.0f} s" if timed_out else "failed"
            tails = "\n".join(f"--- rank {r}:\n{log[-2000:]}" for r, log in enumerate(logs))
            raise RuntimeError(f"the ranks on the two nodes {what}:\n{tails}")
        return pickle.loads((folder / "out.pkl").read_bytes())
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def plan(rates=QUICK_RATES, wire_ms=QUICK_WIRE_MS, repeats: int = 3, iters: int = 2,
         batch: int = 32, steps: int = 6, warmup: int = 3, setups=None) -> dict:  # fmt: skip
    """The measurements ``link_rank.measure`` makes: see its docstring."""
    return {"rates": list(rates), "fastest": max(rates), "wire_ms": list(wire_ms),
            "repeats": repeats, "iters": iters, "batch": batch, "steps": steps,
            "warmup": warmup,
            "setups": list(link_rank.SETUPS if setups is None else setups)}  # fmt: skip


def across_nodes(p: dict, timeout: float = 300.0, user_namespace: bool | None = None) -> dict:
    """``link_rank.measure(p)`` with a rank on each node, each shaping its own end. As a user
    (not root) the whole run happens in a user namespace of its own (``USERNS``), started as
    a process of its own: a kernel's process has threads, and a threaded process cannot move
    into a new user namespace. ``user_namespace`` True takes that way also as root (a test)."""
    if not (os.geteuid() != 0 if user_namespace is None else user_namespace):
        return run_ranks("helpers.tools.link_rank:measure", [repr({**p, "shape": True})], timeout)[
            0
        ]
    with tempfile.TemporaryDirectory(prefix="interconnect-") as folder:
        out = Path(folder) / "across.pkl"
        me = [sys.executable, "-m", "helpers.tools.interconnect", "across", repr(p), str(out)]
        proc = subprocess.run([_which("unshare") or "unshare", *USERNS, *me], capture_output=True,
                              text=True, timeout=timeout + 60)  # fmt: skip
        if proc.returncode:
            raise RuntimeError(f"the run in a user namespace failed:\n{proc.stderr[-3000:]}")
        return pickle.loads(out.read_bytes())


def recorded() -> dict:
    """The run recorded on the course's machine (``python -m helpers.tools.interconnect``):
    rank 0's numbers across the nodes and within one, the plan, and where it ran."""
    data = json.loads(RECORDED.read_text())
    for key in ("across", "within"):  # JSON keys are strings: the rates were numbers or None
        data[key]["rates"] = {_rate(k): v for k, v in data[key]["rates"].items()}
    return data


def _rate(key: str):
    return None if key == "null" else float(key)


def record(p: dict, path: Path = RECORDED) -> dict:
    """Run ``p`` across the nodes and within one (launch's ranks), and save both as JSON."""
    import platform
    import time

    from helpers.launcher.launch import launch, shutdown

    across = across_nodes(p)
    within = launch(link_rank.measure, {**p, "rates": [None]}, world_size=2, output="none")[0]
    shutdown()

    data = {"plan": p, "across": across, "within": within, "machine": platform.node(),
            "kernel": platform.release(), "cores": os.cpu_count(),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load average": os.getloadavg()[0]}  # fmt: skip
    path.write_text(json.dumps(data, indent=1))
    return data


def link_name(rate) -> str:
    """How a link is called in tables and findings: its rate, or within one node."""
    return "within one node" if rate is None else f"{rate:g} Mbit/s between nodes"


def fits(rates: dict) -> dict:
    """α–β fits (``bandwidth.fit_alpha_beta``) of each link in ``rates`` (a run's "rates"):
    one per repeat of the sweep, and one of every repeat's points together."""
    from helpers.measure.bandwidth import fit_alpha_beta

    out = {}
    for rate, r in rates.items():
        sweeps = r["allreduce"]
        pooled = fit_alpha_beta(r["sizes"] * len(sweeps), [t for s in sweeps for t in s])
        out[rate] = {"pooled": pooled, "repeats": [fit_alpha_beta(r["sizes"], s) for s in sweeps]}
    return out


def allreduce_rows(across: dict, within: dict) -> list[dict]:
    """A row per link: the configured rate's payload bandwidth (the anchor) and the fitted β
    (median and range over the repeats, MB/s), α and R² of the fit of all points. Where that R²
    is below the course's floor (``findings.R2_FLOOR``) α and β are left blank: such a fit
    measures neither."""
    from helpers.measure.findings import R2_FLOOR

    rows = []
    for rate, f in {**fits(across["rates"]), **fits(within["rates"])}.items():
        betas = sorted(a.beta / 1e6 for a in f["repeats"])
        usable = f["pooled"].r2 >= R2_FLOOR
        rows.append({
            "link": link_name(rate),
            "configured payload MB/s": expected_bandwidth(rate) / 1e6 if rate else None,
            "fitted β MB/s (median)": betas[len(betas) // 2] if usable else None,
            "β min": betas[0] if usable else None,
            "β max": betas[-1] if usable else None,
            "α µs (all points)": f["pooled"].alpha * 1e6 if usable else None,
            "R²": f["pooled"].r2,
        })  # fmt: skip
    return rows


def fit_verdict(run: dict, rate):
    """``findings.fit`` of the link's fit of all points, with no prediction: usable or not."""
    from helpers.measure import findings

    r2 = fits(run["rates"])[rate]["pooled"].r2
    return findings.fit(f"t = α + S/β {_over(rate)}", r2)


def _over(rate) -> str:
    return "within one node" if rate is None else f"over the {rate:g} Mbit/s link"


def anchor(across: dict, rate: float):
    """The wire's payload rate R (the configured rate less the headers) against the range of β
    fitted to each sweep, as a one-sided limit: no link carries more than its rate, so β above R
    is the fit's noise, and β below R means the wire did not set the pace. Verdicts: "at the
    limit" (R inside the range), "below the limit", "above the limit", or findings.fit's
    "unusable" where the fit of all points is below the R² floor."""
    from helpers.measure import findings

    f = fits(across["rates"])[rate]
    name = f"t = α + S/β {_over(rate)}"
    r2 = f["pooled"].r2
    if r2 < findings.R2_FLOOR:
        return findings.fit(name, r2)
    wire = expected_bandwidth(rate) / 1e6
    betas = [a.beta / 1e6 for a in f["repeats"]]
    lo, hi = min(betas), max(betas)
    span = f"fitted β {findings.fmt(lo)}–{findings.fmt(hi)} MB/s ({len(betas)} sweeps)"
    head = f"The fit **{name}** (R² = {r2:.3f}): the {span} "
    wire_s = f"the wire's payload rate R = {findings.fmt(wire)} MB/s"
    if lo <= wire <= hi:
        verdict = "at the limit"
        text = f"holds {wire_s}: the wire set the pace, and the fit recovers its rate."
    elif hi < wire:
        verdict = "below the limit"
        text = (f"lies below {wire_s} (by {(wire - hi) / wire:.1%} at the nearest): the wire "
                "was not the bottleneck; something slower set the pace.")  # fmt: skip
    else:
        verdict = "above the limit"
        text = (f"lies above {wire_s} (by {(lo - wire) / wire:.1%} at the nearest): no link "
                "carries more than its rate, so that excess is the fit's noise (or headers "
                "counted wrong), not a faster wire.")  # fmt: skip
    record = {"kind": "fit", "what": name, "verdict": verdict}
    return findings.Finding(head + text, verdict, {"r2": r2, "rate": wire, "beta_min": lo,
                                                    "beta_max": hi}, record)  # fmt: skip


def ddp_rows(across: dict, within: dict) -> list[dict]:
    """A row per link and DDP set-up: median step time and the scaling efficiency, one device's
    median step (no DDP) over it: 1 where communication costs nothing."""
    import statistics

    rows = []
    for run in (within, across):
        alone = statistics.median(run["one device"])
        for rate, r in run["rates"].items():
            for setup, times in r["ddp"].items():
                step = statistics.median(times)
                rows.append({"link": link_name(rate), "DDP set-up": setup,
                             "step ms (median)": step * 1e3, "min": min(times) * 1e3,
                             "max": max(times) * 1e3, "scaling efficiency": alone / step})  # fmt: skip
    return rows


def step_times(across: dict, within: dict, setup: str) -> dict:
    """{link: step times} of ``setup`` on every link, within one node first: for findings."""
    runs = [(rate, r) for run in (within, across) for rate, r in run["rates"].items()]
    return {link_name(rate): r["ddp"][setup] for rate, r in runs}


def plot_allreduce(across: dict, within: dict, ax=None):
    """Seconds per all-reduce against bytes, every repeat's points and the fit of each link."""
    import matplotlib.pyplot as plt
    import numpy as np

    ax = ax or plt.subplots(figsize=(7, 4))[1]
    for rate, f in {**fits(across["rates"]), **fits(within["rates"])}.items():
        r = (across if rate in across["rates"] else within)["rates"][rate]
        for i, sweep in enumerate(r["allreduce"]):
            dots = ax.loglog(
                r["sizes"], sweep, "o", alpha=0.6, label=None if i else link_name(rate)
            )
        s = np.geomspace(min(r["sizes"]), max(r["sizes"]), 50)
        ax.loglog(s, f["pooled"].predict(s), "-", color=dots[0].get_color(), lw=1)
    ax.set_xlabel("bytes per rank (float32 buffer)")
    ax.set_ylabel("seconds per all-reduce (2 ranks)")
    ax.legend(fontsize=8)
    return ax


def main(argv: list[str]) -> int:
    """``python -m helpers.tools.interconnect record``: record the run the lecture shows where
    it cannot make the nodes (on an otherwise idle machine); ``across PLAN OUT``: what
    ``across_nodes`` runs inside a user namespace."""
    import ast

    if argv[:1] == ["record"]:
        record(plan())
        print(f"recorded: {RECORDED}")
    elif argv[:1] == ["across"] and len(argv) == 3:
        Path(argv[2]).write_bytes(pickle.dumps(across_nodes(ast.literal_eval(argv[1]))))
    else:
        print(main.__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
