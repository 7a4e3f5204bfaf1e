"""The chance a verdict owes to noise: the rank test, its exact size, and a notebook's family.

``helpers.findings`` states verdicts in words; this module holds the statistics under them. The
rank test (Mann–Whitney) with its exact two-sided chance (``rank_test``), the exact chance that n
repeats against m of the same thing come out separated at a level (``null_separation_chance``),
the repeats a separation needs at all and by Lehr's rule (``repeats_to_separate``,
``repeats_needed``), and the family a notebook's comparisons are judged in: one per process, its
level the family's error over its declared size (Bonferroni; the reasons are in findings' doc).

The rule for "separated": a rank test (Mann–Whitney). Count the pairs, one repeat of each
configuration, that come out in the other order (U); with no real difference every split of the
pooled repeats between the two is equally likely, and the chance of a split at least as lopsided
as the one measured is computed exactly (by enumerating the splits; the normal approximation past
20,000 of them). Separated means that chance is at most the comparison's level: 0.1 judged
alone, 0.1 / K in a family of K (findings explains why). With few repeats only fully disjoint ranges get there:
their chance is 2 / C(n + m, n) (0.1 for 3 against 3, 0.03 for 4 against 4); with more repeats a
few pairs may fall the other way, so more repeats always help (a rule that needed disjoint ranges
would get *stricter* with more repeats, as the extremes spread). The repeats needed to tell a
relative difference d apart with a run-to-run coefficient of variation c follow Lehr's rule,
n ≈ 2(z₀.₉₅ + z₀.₈)² c² / d², for this test at 0.1 with an 80 % chance to see it, and the rank
test's efficiency against a t-test on normal data (3/π): about 13 c² / d² per configuration
(at a family's level, z at 1 − level/2: 28 c² / d² at 0.005).

Trusts: the samples it is given are finite numbers (findings checks them first).
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
from dataclasses import dataclass, field

MAX_CHANCE = 0.1  # the most a notebook's "separated" verdicts may owe to chance, all together
EXACT_SPLITS = 20_000  # up to this many splits the rank test's chance is counted exactly


def lehr(level: float = MAX_CHANCE) -> float:
    """Lehr's constant for a two-sided test at ``level`` with 80 % power, over the rank test's
    efficiency against a t-test on normal data, 3/π: 2 (z_(1-level/2) + z_0.8)² π / 3."""
    z = statistics.NormalDist().inv_cdf
    return 2 * (z(1 - level / 2) + z(0.8)) ** 2 * math.pi / 3


LEHR = lehr()  # ≈ 12.95 at MAX_CHANCE, a comparison judged alone


@dataclass(frozen=True)
class Comparison:
    """One rank test of the family: which pair, its chance, the repeats, the level it met."""

    label: str  # "A against B (step time)"
    chance: float
    n: tuple[int, int]
    level: float
    separated: bool


@dataclass
class Family:
    """A notebook's comparisons (one per kernel): ``expected`` declared, or None (judged alone)."""

    expected: int | None = None
    error: float = MAX_CHANCE
    comparisons: list[Comparison] = field(default_factory=list)

    @property
    def level(self) -> float:
        """The most one comparison may owe to chance: the family's error over its size."""
        return self.error / (self.expected or 1)

    def add(self, label: str, chance: float, n: tuple[int, int], separated: bool) -> None:
        self.comparisons.append(Comparison(label, chance, n, self.level, separated))


_FAMILY = Family()  # per process: a notebook's kernel, a test's process


def family(expected: int | None = None, error: float = MAX_CHANCE) -> Family:
    """Start a new family for this notebook's comparisons: call it at the top with ``expected``,
    the comparisons the notebook will make (each ``compare()`` one, each ``order()`` of k
    configurations k(k-1)/2). Each is then judged at ``error / expected`` (see the module doc).
    ``family()`` with no count goes back to judging each comparison alone at ``error``."""
    global _FAMILY
    if expected is not None and (isinstance(expected, bool) or not isinstance(expected, int)):
        raise ValueError(f"expected must be a whole number of comparisons, not {expected!r}")
    if expected is not None and expected < 1:
        raise ValueError(f"expected must be at least 1 comparison, not {expected}")
    if not 0 < error < 1:
        raise ValueError(f"error must be a chance between 0 and 1, such as 0.1, not {error!r}")
    _FAMILY = Family(expected, error)
    return _FAMILY


def current() -> Family:
    """The family this process's comparisons are judged in (and recorded into)."""
    return _FAMILY


def _within(chance: float, level: float) -> bool:
    return chance <= level * (1 + 1e-9)  # 2/20 against 0.1/1: equal, not a rounding apart


def chance_separated(n: int, m: int) -> float:
    """Probability that n and m repeats of the same thing come out with disjoint ranges."""
    return min(1.0, 2.0 / math.comb(n + m, n))


def cv(values) -> float:
    """Run-to-run coefficient of variation (sample standard deviation over the mean)."""
    values = list(values)
    if len(values) < 2:
        return math.nan
    mean = statistics.fmean(values)
    return statistics.stdev(values) / abs(mean) if mean else math.nan


def repeats_to_separate(level: float | None = None) -> int:
    """The fewest repeats each of two configurations needs for a "separated" verdict to be
    possible at all at ``level`` (default: the family's): their ranges fully disjoint, the rank
    test's smallest chance 2 / C(2n, n), must come out at most ``level``."""
    level = current().level if level is None else level
    if not 0 < level < 1:
        raise ValueError(f"level must be a chance between 0 and 1, not {level!r}")
    n = 2
    while not _within(chance_separated(n, n), level):
        n += 1
    return n


def repeats_needed(c: float, d: float, level: float | None = None) -> int | None:
    """Lehr's rule for the rank test: repeats per configuration to tell a relative difference
    ``d`` apart at noise ``c`` (an 80 % chance of a separated verdict) at ``level`` (default: the
    family's), and never fewer than the repeats that can separate at all there."""
    if not (c > 0 and d > 0) or not math.isfinite(c):
        return None
    level = current().level if level is None else level
    return max(repeats_to_separate(level), math.ceil(lehr(level) * c * c / (d * d)))


@functools.lru_cache(maxsize=256)
def null_separation_chance(n: int, m: int, level: float) -> float:
    """The chance that n repeats against m of the same thing (no ties) come out separated at
    ``level``: the rank test's exact size, at most ``level`` (less for few repeats: the test is
    discrete). Past EXACT_SPLITS splits, ``level`` itself."""
    if math.comb(n + m, n) > EXACT_SPLITS:
        return level
    # ways[k][s]: subsets of k of the ranks 1..n+m seen so far with rank sum s
    top = sum(range(m + 1, n + m + 1))
    ways = [[0] * (top + 1) for _ in range(n + 1)]
    ways[0][0] = 1
    for r in range(1, n + m + 1):
        for k in range(min(n, r), 0, -1):
            for s in range(top, r - 1, -1):
                ways[k][s] += ways[k - 1][s - r]
    total = math.comb(n + m, n)
    shift, middle = n * (n + 1) / 2, n * m / 2
    dist = {s - shift: w / total for s, w in enumerate(ways[n]) if w}  # U -> probability

    def chance(u: float) -> float:  # two-sided, as rank_test counts it
        return sum(p for v, p in dist.items() if abs(v - middle) >= abs(u - middle) - 1e-9)

    return sum(p for u, p in dist.items() if _within(chance(u), level))


def _midranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):  # tied values share the mean of their ranks
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def rank_test(a, b) -> tuple[float, float]:
    """(U, chance): U counts the pairs (x from ``a``, y from ``b``) with x > y, ties a half; the
    chance is that of a U at least as far from its middle n·m/2 when the two are the same (two-
    sided), exact over every split of the pooled values up to EXACT_SPLITS, else by the normal
    approximation with the correction for ties."""
    a, b = list(a), list(b)
    n, m = len(a), len(b)
    ranks = _midranks(a + b)
    u = sum(ranks[:n]) - n * (n + 1) / 2
    middle = n * m / 2
    far = abs(u - middle) - 1e-9
    if math.comb(n + m, n) <= EXACT_SPLITS:
        hits = total = 0
        for chosen in itertools.combinations(ranks, n):
            total += 1
            hits += abs(sum(chosen) - n * (n + 1) / 2 - middle) >= far
        return u, hits / total
    ties = sum(t**3 - t for t in _tie_sizes(a + b))
    var = n * m / 12 * ((n + m + 1) - ties / ((n + m) * (n + m - 1)))
    if var <= 0:
        return u, 1.0
    z = max(0.0, abs(u - middle) - 0.5) / math.sqrt(var)
    return u, math.erfc(z / math.sqrt(2))


def _tie_sizes(values) -> list[int]:
    counts: dict = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return [c for c in counts.values() if c > 1]


def _pair(a: list[float], b: list[float], level: float) -> tuple[float, bool]:
    """(chance, separated): the rank test's verdict at ``level``, in the direction of the
    medians (as compare() states it)."""
    u_stat, chance = rank_test(a, b)
    ma, mb = statistics.median(a), statistics.median(b)
    agree = ma != mb and (ma < mb) == (u_stat < len(a) * len(b) / 2)
    return chance, _within(chance, level) and agree
