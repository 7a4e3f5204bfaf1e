"""Findings: say only what the measurements allow, printed from the run, never typed.

A number measured on a shared 2-core machine moves every time the notebook is run again, and a
sentence typed beside it does not. So a comparison, an ordering or a fit is stated by these
functions from the samples themselves (repeats, seeds, steps): the value with its range, a
difference only where the repeats separate them, "indistinguishable here" where they do not
(a tie is a tie), and how many repeats would settle it. In a notebook the result shows as a
Markdown sentence; ``str()`` gives the same sentence as plain text, for a print.

The rule for "separated": a rank test (Mann–Whitney). Count the pairs, one repeat of each
configuration, that come out in the other order (U); with no real difference every split of the
pooled repeats between the two is equally likely, and the chance of a split at least as lopsided
as the one measured is computed exactly (by enumerating the splits; the normal approximation past
20,000 of them). Separated means that chance is at most 0.1. With few repeats only fully disjoint
ranges get there: their chance is 2 / C(n + m, n) (0.1 for 3 against 3, 0.03 for 4 against 4);
with more repeats a few pairs may fall the other way, so more repeats always help (a rule that
needed disjoint ranges would get *stricter* with more repeats, as the extremes spread).
The repeats needed to tell a relative difference d apart with a run-to-run coefficient of
variation c follow Lehr's rule, n ≈ 2(z₀.₉₅ + z₀.₈)² c² / d², for this test at 0.1 with an 80 %
chance to see it, and the rank test's efficiency against a t-test on normal data (3/π): about
13 c² / d² per configuration.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field

MAX_CHANCE = 0.1  # the most a "separated" verdict may owe to chance (see the module doc)
# Lehr's constant for a two-sided test at MAX_CHANCE with 80 % power, over the rank test's
# efficiency against a t-test on normal data, 3/π: 2 (z_0.95 + z_0.8)² π / 3 ≈ 12.95
LEHR = (
    2
    * (statistics.NormalDist().inv_cdf(1 - MAX_CHANCE / 2) + statistics.NormalDist().inv_cdf(0.8))
    ** 2
    * math.pi
    / 3
)
LEHR_RULE = f"{LEHR:.0f}c²/d², Lehr's rule for this test"  # how the advice is printed
EXACT_SPLITS = 20_000  # up to this many splits the rank test's chance is counted exactly
R2_FLOOR = 0.9  # below it a fit describes no trend worth extrapolating


@dataclass
class Finding:
    """One statement, the numbers behind it, and its verdict (a word tests can check)."""

    text: str
    verdict: str
    numbers: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return self.text.replace("**", "")  # printed: plain text; displayed: Markdown

    def _repr_markdown_(self) -> str:
        return self.text


def fmt(x: float, digits: int = 3) -> str:
    """``x`` to ``digits`` significant digits, without a trailing exponent for everyday sizes."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    places = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    return f"{x:,.{places}f}"


def _check(name: str, values) -> list[float]:
    values = [float(v) for v in values]
    if not values:
        raise ValueError(f"{name!r} has no measurements: run it at least once")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"{name!r} has a value that is not a finite number: {values}")
    return values


def value(values, unit: str = "", name: str | None = None) -> Finding:
    """'0.115 s (0.101–0.115, 3 repeats)': the median and the range a table should show."""
    values = _check(name or "value", values)
    med = statistics.median(values)
    u = f" {unit}" if unit else ""
    label = f"**{name}**: " if name else ""
    if len(values) == 1:
        text = f"{label}{fmt(med)}{u} (one run: no spread measured)"
    else:
        text = (
            f"{label}{fmt(med)}{u} ({fmt(min(values))}–{fmt(max(values))}, {len(values)} repeats)"
        )
    return Finding(
        text,
        "value",
        {"median": med, "min": min(values), "max": max(values), "n": len(values)},
    )


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


def repeats_needed(c: float, d: float) -> int | None:
    """Lehr's rule for the rank test: repeats per configuration to tell a relative difference
    ``d`` apart at noise ``c`` (an 80 % chance of a separated verdict)."""
    if not (c > 0 and d > 0) or not math.isfinite(c):
        return None
    # at least 3: with fewer, even disjoint ranges owe too much to chance (MAX_CHANCE)
    return max(3, math.ceil(LEHR * c * c / (d * d)))


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


def _words(unit: str, better: str) -> tuple[str, str]:
    if unit in ("s", "ms", "µs", "us", "min", "h") and better == "lower":
        return "faster", "slower"
    return ("lower", "higher") if better == "lower" else ("higher", "lower")


def compare(samples: dict, unit: str = "", better: str = "lower", what: str = "") -> Finding:
    """Two configurations' repeats -> which is better, by how much, or that this run cannot tell.

    ``samples``: {"name": [repeat, ...], "other": [...]}, in the order to read them.
    ``better``: "lower" (times, bytes, loss) or "higher" (throughput, accuracy).
    ``what``: the quantity, for the sentence ("step time", "test accuracy").
    """
    if better not in ("lower", "higher"):
        raise ValueError(f"better must be 'lower' or 'higher', not {better!r}")
    if len(samples) != 2:
        raise ValueError(f"compare() takes exactly two configurations, got {list(samples)}")
    (na, a), (nb, b) = [(k, _check(k, v)) for k, v in samples.items()]
    ma, mb = statistics.median(a), statistics.median(b)
    u = f" {unit}" if unit else ""
    of = f" ({what})" if what else ""
    k = _digits(a, b)
    shown = f"{fmt(ma, k)}{u} ({_range(a, k)}) against {fmt(mb, k)}{u} ({_range(b, k)})"  # a, b
    numbers = {"a": ma, "b": mb, "ratio": ma / mb if mb else math.inf}
    u_stat, chance = rank_test(a, b)
    disjoint = max(a) < min(b) or max(b) < min(a)
    against = min(u_stat, len(a) * len(b) - u_stat)  # pairs in the other order (ties: halves)
    # the rank test's direction must be the medians' (they can disagree: a long tail on one side)
    agree = ma != mb and (ma < mb) == (u_stat < len(a) * len(b) / 2)
    c = statistics.fmean([cv(a), cv(b)])  # nan when either was run once: no spread known
    d = abs(ma - mb) / statistics.fmean([abs(ma), abs(mb)]) if (ma or mb) else 0.0
    need = repeats_needed(c, d)
    numbers.update(chance=chance, cv=c, rel_diff=d, repeats_needed=need)
    if chance <= MAX_CHANCE and agree:
        a_wins = (ma < mb) == (better == "lower")
        win, lose = (na, nb) if a_wins else (nb, na)
        good, _ = _words(unit, better)
        hi, lo = max(ma, mb), min(ma, mb)
        lo_r, hi_r = _ratio_range(a, b) if ma >= mb else _ratio_range(b, a)
        w, l_ = (a, b) if win == na else (b, a)
        shown = (
            f"{win} {fmt(statistics.median(w), k)}{u} ({_range(w, k)}) against "
            f"{lose} {fmt(statistics.median(l_), k)}{u} ({_range(l_, k)})"
        )
        if disjoint:
            how = (
                f"the ranges do not overlap (chance of that with no real difference: {chance:.2g})"
            )
        else:
            how = (
                f"{against:g} of the {len(a) * len(b)} pairs of repeats fall the other way (a tie "
                "counts a half) "
                f"(chance of a split this lopsided with no real difference: {chance:.2g}, a rank "
                "test)"
            )
        text = (
            f"**{win}** is {good} than **{lose}**{of}: {shown}, a ratio of {fmt(hi / lo, k)}× "
            + (f"({fmt(lo_r, k)}–{fmt(hi_r, k)}); " if disjoint else "(of the medians); ")
            + f"{how}."
        )
        return Finding(text, f"{win} better", numbers)
    if chance <= MAX_CHANCE:  # separated by rank, but against the medians' order
        why = (
            f"a rank test separates them (chance {chance:.2g}), but not in the order of their "
            "medians (equal or reversed): the two differ in shape, not simply in level"
        )
    elif disjoint:
        why = (
            f"the ranges do not overlap, but with {len(a)} and {len(b)} repeats that happens "
            f"by chance {chance:.0%} of the time"
        )
    else:
        why = f"the ranges overlap (chance of a split this lopsided with no real difference: {chance:.2g})"
    more = ""
    if math.isfinite(c) and c >= 1:  # Lehr's rule would ask for thousands of repeats
        more = (
            f" The run-to-run noise is as large as the values themselves (c ≈ {_pct(c)}): "
            "longer runs (more steps, a larger batch), not more repeats, would settle it."
        )
    elif need is not None:
        more = (
            f" Telling a {_pct(d)} difference apart at this noise (c ≈ {_pct(c)}) would take about "
            f"{need} repeats each ({LEHR_RULE})."
        )
    elif not math.isfinite(c):
        more = " One run each measures no spread: repeat each configuration at least 3 times."
    text = f"**{na}** and **{nb}** are indistinguishable here{of}: {shown}; {why}.{more}"
    return Finding(text, "indistinguishable", numbers)


def _pct(x: float) -> str:
    return f"{fmt(100 * x, 2)} %"


def _range(values: list[float], digits: int = 3) -> str:
    if len(values) == 1:
        return "one run"
    return f"{fmt(min(values), digits)}–{fmt(max(values), digits)}"


def _digits(a: list[float], b: list[float]) -> int:
    """Significant digits that show two disjoint ranges apart (3, or more when they touch at
    3): "0.501 (0.501–0.501) against 0.501 (0.501–0.501)" would read as a contradiction."""
    if not (max(a) < min(b) or max(b) < min(a)):
        return 3
    lo, hi = (max(a), min(b)) if max(a) < min(b) else (max(b), min(a))
    digits = 3
    while digits < 8 and fmt(lo, digits) == fmt(hi, digits):
        digits += 1
    return digits


def _ratio_range(big: list[float], small: list[float]) -> tuple[float, float]:
    """The ratio big/small over the extremes of both ranges."""
    return min(big) / max(small), max(big) / min(small)


def order(samples: dict, unit: str = "", highest_first: bool = False, what: str = "") -> Finding:
    """Several configurations sorted by median, grouped as far as the rank test separates them.

    Every configuration in a group is separated (see the module doc) from every configuration in
    every other group. A group is joined through overlaps, so two of its members can still be
    separated from each other (a wide range between them overlaps both): those pairs are listed.
    "A < B ≈ C < D" reads as "A below B and C, both below D".
    """
    if len(samples) < 2:
        raise ValueError("order() needs at least two configurations")
    data = {k: _check(k, v) for k, v in samples.items()}
    names = sorted(data, key=lambda k: statistics.median(data[k]), reverse=highest_first)
    groups: list[list[str]] = []
    for name in names:
        tied = [
            i
            for i, group in enumerate(groups)
            if any(not _separated(data[name], data[other]) for other in group)
        ]
        if tied:  # it overlaps a member of group i: everything from i on is one group
            i = tied[0]
            groups[i:] = [[n for g in groups[i:] for n in g] + [name]]
        else:
            groups.append([name])
    sign = " > " if highest_first else " < "
    chain = sign.join(" ≈ ".join(f"**{n}**" for n in g) for g in groups)
    u = f" {unit}" if unit else ""
    listing = "; ".join(
        f"{n}: {fmt(statistics.median(data[n]))}{u} ({_range(data[n])})" for n in names
    )
    of = f" by {what}" if what else ""
    inside = [
        (x, y)
        for g in groups
        for i, x in enumerate(g)
        for y in g[i + 1 :]
        if _separated(data[x], data[y])
    ]
    apart = ""
    if inside:
        apart = (
            " Separated all the same, inside a group: "
            + "; ".join(f"{x} {'above' if highest_first else 'below'} {y}" for x, y in inside)
            + "."
        )
    if len(groups) == 1:
        text = (
            f"No complete ordering{of} is supported here: no two groups are separated, the ranges "
            f"overlap or too few repeats lie apart ({listing}).{apart}"
        )
    else:
        text = (
            f"Ordered{of}: {chain}, where ≈ joins what a rank test does not separate, directly or through a"
            f" neighbour ({listing}).{apart}"
        )
    verdict = "ordered" if len(groups) > 1 else "indistinguishable"
    return Finding(text, verdict, {"groups": groups, "separated_inside": inside})


def _separated(a: list[float], b: list[float]) -> bool:
    """The rank test's verdict, in the direction of the medians (as compare() states it)."""
    u_stat, chance = rank_test(a, b)
    ma, mb = statistics.median(a), statistics.median(b)
    return chance <= MAX_CHANCE and ma != mb and (ma < mb) == (u_stat < len(a) * len(b) / 2)


def fit(name: str, r2: float, floor: float = R2_FLOOR) -> Finding:
    """Whether a fit may be used to predict: its R² against ``floor`` (1 is perfect, 0 is no
    better than the mean, below 0 worse than a constant)."""
    if not math.isfinite(r2):
        raise ValueError(f"the fit {name!r} has R² = {r2}: it was not computed")
    if r2 >= floor:
        return Finding(
            f"The fit **{name}** has R² = {r2:.3f} (≥ {floor:g}): it describes these points; "
            "predictions hold within the measured range, not beyond it.",
            "usable",
            {"r2": r2},
        )
    worse = " — worse than a constant" if r2 < 0 else ""
    return Finding(
        f"The fit **{name}** has R² = {r2:.3f}{worse}, below {fmt(floor)}: these points do not "
        "follow the model, so its parameters are not measured here and nothing is predicted "
        "from it.",
        "unusable",
        {"r2": r2},
    )
