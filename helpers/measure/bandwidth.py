"""Bandwidth the way nccl-tests reports it, and the α-β model of a collective's time.

For a collective over n ranks moving a buffer of S bytes in t seconds:
    algbw = S / t                      (GB/s, 1 GB = 1e9 bytes)
    busbw = algbw × factor(op, n)      the bandwidth each link must sustain,
so busbw is comparable across ops and world sizes, and with the hardware's link bandwidth.
S is the per-rank buffer for all_reduce, broadcast, reduce and send/recv, and the *full*
buffer (n × the per-rank piece) for all_gather, reduce_scatter, gather, scatter and all_to_all.
Introduced in lecture 01; the lab fits α and β on this machine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

GB = 1e9


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for ``op`` on ``n`` ranks (nccl-tests, doc/PERFORMANCE.md)."""
    if n < 1:
        raise ValueError(f"n must be at least 1, not {n}")
    if op == "all_reduce":
        return (
            2 * (n - 1) / n
        )  # a ring sends and receives S(n-1)/n twice: reduce-scatter + all-gather
    if op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n  # each rank gets (or gives) the n-1 pieces it does not hold
    if op in ("broadcast", "reduce", "send_recv"):
        return 1.0  # bounded by one link: the root's, or the sender's
    raise ValueError(f"no bus bandwidth factor for {op!r}")


def buffer_bytes(op: str, piece_bytes: int, n: int) -> int:
    """S for ``op`` when each rank contributes (or receives) ``piece_bytes``."""
    full = ("all_gather", "reduce_scatter", "gather", "scatter", "all_to_all")
    return piece_bytes * n if op in full else piece_bytes


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in GB/s."""
    return nbytes / seconds / GB


def busbw(op: str, nbytes: float, seconds: float, n: int) -> float:
    """Bus bandwidth in GB/s."""
    return algbw(nbytes, seconds) * bus_factor(op, n)


def ring_allreduce_wire_bytes(nbytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``nbytes``: 2(n−1)/n × S."""
    return 2 * (n - 1) / n * nbytes


@dataclass
class AlphaBeta:
    """t(S) = alpha + S / beta: alpha in seconds (latency), beta in bytes/s (bandwidth)."""

    alpha: float
    beta: float
    r2: float  # goodness of fit on log(t): 1 is perfect
    op: str = "all_reduce"
    n: int = 2

    def predict(self, nbytes):
        """Predicted seconds for a message of ``nbytes`` (a number or a numpy array)."""
        return self.alpha + nbytes / self.beta

    @property
    def beta_gbps(self) -> float:
        return self.beta / GB

    @property
    def algbw_gbps(self) -> float:
        """The algbw large messages approach, S/t -> beta (GB/s): the same number as beta_gbps."""
        return self.beta / GB

    @property
    def busbw_gbps(self) -> float:
        """The busbw large messages approach (GB/s): beta × the op's bus factor, as plotted."""
        return self.beta * bus_factor(self.op, self.n) / GB

    @property
    def link_latency(self) -> float:
        """α per ring step (seconds): the fitted α shared out over the ring's steps."""
        return self.alpha / ring_steps(self.op, self.n)

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "beta_GBps": self.beta_gbps,
            "busbw_GBps": self.busbw_gbps,
            "link_latency": self.link_latency,
        }


def ring_steps(op: str, n: int) -> int:
    """Steps of the ring algorithm for ``op``: 2(n−1) for all_reduce, n−1 for all_gather etc."""
    if op == "all_reduce":
        return max(1, 2 * (n - 1))
    if op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return max(1, n - 1)
    return 1


def ring_allreduce_time(nbytes, n: int, link_latency: float, link_bandwidth: float):
    """Ring all-reduce seconds: 2(n−1)·α_link + 2(n−1)/n · S / B_link (B in bytes/s).

    Each of the 2(n−1) steps starts one message (α_link) and moves a chunk of S/n bytes over
    one link. So the latency term grows with n, the bandwidth term hardly does; B_link is the
    busbw large messages reach.
    """
    return 2 * (n - 1) * link_latency + 2 * (n - 1) / n * nbytes / link_bandwidth


def fit_alpha_beta(sizes, seconds, op: str = "all_reduce", n: int = 2) -> AlphaBeta:
    """Least-squares fit of t = α + S/β, weighted by 1/t so small messages (α) count too.

    Unweighted, the largest messages dominate and α comes out as noise, possibly negative.
    """
    import numpy as np

    s = np.asarray(sizes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if s.shape != t.shape or s.size < 2:
        raise ValueError("need at least two (size, time) pairs of the same length")
    if np.any(t <= 0):
        raise ValueError("times must be positive")
    w = 1.0 / t  # minimise relative error
    design = np.stack([np.ones_like(s), s], axis=1) * w[:, None]
    (alpha, slope), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    alpha = max(float(alpha), 0.0)
    slope = max(float(slope), 1e-30)
    pred = alpha + s * slope
    log_res = np.log(t) - np.log(pred)
    log_tot = np.log(t) - np.log(t).mean()
    r2 = 1.0 - float((log_res**2).sum() / max((log_tot**2).sum(), 1e-30))
    return AlphaBeta(alpha=alpha, beta=1.0 / slope, r2=r2, op=op, n=n)
