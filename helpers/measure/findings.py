"""Findings: say only what the measurements allow, printed from the run, never typed.

A number measured on a shared 2-core machine moves every time the notebook is run again, and a
sentence typed beside it does not. So a comparison, an ordering or a fit is stated by these
functions from the samples themselves (repeats, seeds, steps): the value with its range, a
difference only where the repeats separate them, "indistinguishable here" where they do not
(a tie is a tie), and how many repeats would settle it. In a notebook the result shows as a
Markdown sentence; ``str()`` gives the same sentence as plain text, for a print.

The rule for "separated" is a rank test at the comparison's level, and Lehr's rule says how many
repeats would settle a tie: helpers.measure.chance, which holds the statistics.

A notebook's comparisons are judged as one family, not one at a time. A notebook makes dozens of
comparisons (every pair of an ``order()`` counts), and at 0.1 each, about one in ten comparisons
of configurations that do not differ at all comes out "separated": a few per run, different ones
on every run. So a notebook declares at its top how many comparisons it will make,
``findings.family(K)``, and every comparison is judged at 0.1 / K (Bonferroni): the chance that a
run prints even one separation that noise alone made is then at most 0.1 (a family-wise rule).
Why not Benjamini–Hochberg (a false-discovery rate, more power): BH judges each chance against the
family's sorted chances, so a verdict printed as the notebook runs could only be provisional, and
the prose a later cell builds on it would be re-judged under it; BH's guarantee also needs the
comparisons to be independent or positively dependent, and a notebook's comparisons share
samples (one baseline against two and four ranks, every pair of an ordering). Its online
variants (LOND) judge each comparison by how many separations came before it, so one verdict that
flips between runs moves the ones after it. A Bonferroni verdict depends on its own repeats alone, holds under any
dependence, is final when printed, and is the same in any cell order: what the next run has to
reproduce. Its price is power, paid in repeats: the smallest chance the rank test can give is that
of fully disjoint ranges, 2 / C(n + m, n): 0.1 for 3 against 3, 0.029 for 4, 0.0079 for 5, 0.0022
for 6, 0.00058 for 7. So 3 repeats against 3 can separate only in a family of one; a family of
2–3 comparisons needs 4 repeats each, 4–12 five, 13–46 six, 47–171 seven
(``repeats_to_separate()``; ``repeats_needed(c, d)`` applies Lehr's rule at the family's level,
never below that floor). ``findings.summary()``, at the notebook's end, prints the comparisons
made, the separations, and the separations chance alone would give (the sum over comparisons of
each one's exact chance of separating when nothing differs). A notebook that made more
comparisons than it declared was judged too loosely: the summary judges them again at 0.1 over
the count made and names every verdict that does not stand, and every comparison whose repeats
could not separate at that level at all. Without a declaration each comparison is judged alone at
0.1, as it was before the family, and the summary says the same.

A fit is judged by what it predicts, not by R² alone: ``fit(..., predicted=, measured=)`` reports
a prediction outside the measured range as a miss, however high the R².

Every displayed finding carries its verdict as JSON (``MIME``) beside the Markdown, for
``course compare`` to match verdicts between two builds; a printed one is read from its sentence.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from helpers.measure.chance import (  # noqa: F401  (re-exported: findings.rank_test, ...)
    EXACT_SPLITS,
    LEHR,
    MAX_CHANCE,
    Comparison,
    Family,
    _pair,
    _within,
    chance_separated,
    current,
    cv,
    family,
    lehr,
    null_separation_chance,
    rank_test,
    repeats_needed,
    repeats_to_separate,
)

R2_FLOOR = 0.9  # below it a fit describes no trend worth extrapolating
MIME = "application/vnd.course.finding+json"  # a displayed finding's verdict, for course compare


def lehr_rule(level: float | None = None) -> str:
    """How the advice is printed: '13c²/d², Lehr's rule for this test' at the family's level."""
    level = current().level if level is None else level
    return f"{lehr(level):.0f}c²/d², Lehr's rule for this test"


def __getattr__(name: str):
    # LEHR_RULE follows the family a notebook declared (module attribute kept for lab 06)
    if name == "LEHR_RULE":
        return lehr_rule()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class Finding:
    """One statement, the numbers behind it, and its verdict (a word tests can check).

    ``record``: the verdict as JSON for ``course compare``; shown beside the Markdown when the
    finding is displayed, never printed."""

    text: str
    verdict: str
    numbers: dict = field(default_factory=dict)
    record: dict | None = field(default=None, repr=False)

    def __str__(self) -> str:
        return self.text.replace("**", "")  # printed: plain text; displayed: Markdown

    def _repr_markdown_(self) -> str:
        return self.text

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        # only the record: IPython adds the Markdown and the plain text from the other reprs
        return {MIME: self.record} if self.record is not None else {}


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


def _words(unit: str, better: str) -> tuple[str, str]:
    if unit in ("s", "ms", "µs", "us", "min", "h") and better == "lower":
        return "faster", "slower"
    return ("lower", "higher") if better == "lower" else ("higher", "lower")


def compare(samples: dict, unit: str = "", better: str = "lower", what: str = "") -> Finding:
    """Two configurations' repeats -> which is better, by how much, or that this run cannot tell.

    ``samples``: {"name": [repeat, ...], "other": [...]}, in the order to read them.
    ``better``: "lower" (times, bytes, loss) or "higher" (throughput, accuracy).
    ``what``: the quantity, for the sentence ("step time", "test accuracy").
    One comparison of the family: judged at its level, and counted (see the module doc).
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
    fam = current()
    level = fam.level
    disjoint = max(a) < min(b) or max(b) < min(a)
    against = min(u_stat, len(a) * len(b) - u_stat)  # pairs in the other order (ties: halves)
    # the rank test's direction must be the medians' (they can disagree: a long tail on one side)
    agree = ma != mb and (ma < mb) == (u_stat < len(a) * len(b) / 2)
    c = statistics.fmean([cv(a), cv(b)])  # nan when either was run once: no spread known
    d = abs(ma - mb) / statistics.fmean([abs(ma), abs(mb)]) if (ma or mb) else 0.0
    need = repeats_needed(c, d, level)
    numbers.update(chance=chance, cv=c, rel_diff=d, repeats_needed=need, level=level)
    separated = _within(chance, level) and agree
    fam.add(f"{na} against {nb}{of}", chance, (len(a), len(b)), separated)
    record = {"kind": "compare", "what": what, "names": [str(na), str(nb)], "first": None}
    allowed = _allowed(fam)
    if separated:
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
                f"the ranges do not overlap (chance of that with no real difference: {chance:.2g}"
                f"{allowed})"
            )
        else:
            how = (
                f"{against:g} of the {len(a) * len(b)} pairs of repeats fall the other way (a tie "
                "counts a half) "
                f"(chance of a split this lopsided with no real difference: {chance:.2g}, a rank "
                f"test{allowed})"
            )
        text = (
            f"**{win}** is {good} than **{lose}**{of}: {shown}, a ratio of {fmt(hi / lo, k)}× "
            + (f"({fmt(lo_r, k)}–{fmt(hi_r, k)}); " if disjoint else "(of the medians); ")
            + f"{how}."
        )
        record["first"] = str(win)
        return Finding(text, f"{win} better", numbers, record)
    why = _why_not(a, b, chance, agree, fam)
    text = f"**{na}** and **{nb}** are indistinguishable here{of}: {shown}; {why}."
    text += _advice(c, d, need, len(a), len(b), level)
    return Finding(text, "indistinguishable", numbers, record)


def _allowed(fam: Family, how: str = ", at most") -> str:
    """', at most 0.005 allowed for each of this notebook's 20 comparisons' (judged alone: '')."""
    if fam.expected is None:
        return ""
    each = "each of " if fam.expected > 1 else ""  # "this notebook's 1 comparison": no "each"
    count = _count(fam.expected, "comparison")
    return f"{how} {fam.level:.2g} allowed for {each}this notebook's {count}"


def _why_not(a: list[float], b: list[float], chance: float, agree: bool, fam: Family) -> str:
    """Why two configurations' repeats are no verdict: the clause after the numbers."""
    level = fam.level
    if _within(chance, level) and not agree:  # separated by rank, against the medians' order
        return (
            f"a rank test separates them (chance {chance:.2g}), but not in the order of their "
            "medians (equal or reversed): the two differ in shape, not simply in level"
        )
    more = _allowed(fam, ", more than the")
    if max(a) < min(b) or max(b) < min(a):
        return (
            f"the ranges do not overlap, but with {len(a)} and {len(b)} repeats that happens "
            f"by chance {chance:.0%} of the time{more}"
        )
    return (
        "the ranges overlap (chance of a split this lopsided with no real difference: "
        f"{chance:.2g}{more})"
    )


def _advice(c: float, d: float, need: int | None, n: int, m: int, level: float) -> str:
    """What would settle an indistinguishable pair: longer runs, more repeats, or a spread."""
    if math.isfinite(c) and c >= 1:  # Lehr's rule would ask for thousands of repeats
        return (
            f" The run-to-run noise is as large as the values themselves (c ≈ {_pct(c)}): "
            "longer runs (more steps, a larger batch), not more repeats, would settle it."
        )
    if need is not None:
        return (
            f" Telling a {_pct(d)} difference apart at this noise (c ≈ {_pct(c)}) would take about "
            f"{need} repeats each ({lehr_rule(level)})."
        )
    if not math.isfinite(c):
        return " One run each measures no spread: repeat each configuration at least 3 times."
    if not _within(chance_separated(n, m), level):  # no difference at all, and too few to tell
        return f" At this level only {repeats_to_separate(level)} repeats each could separate them."
    return ""


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
    "A < B ≈ C < D" reads as "A below B and C, both below D". Each pair is one comparison of the
    family: k configurations make k(k-1)/2.
    """
    if len(samples) < 2:
        raise ValueError("order() needs at least two configurations")
    data = {k: _check(k, v) for k, v in samples.items()}
    names = sorted(data, key=lambda k: statistics.median(data[k]), reverse=highest_first)
    of = f" by {what}" if what else ""
    fam = current()
    apart = {}  # (x, y), x before y in ``names``: separated?
    for i, x in enumerate(names):
        for y in names[i + 1 :]:
            chance, apart[x, y] = _pair(data[x], data[y], fam.level)
            fam.add(
                f"{x} against {y} (order{of})", chance, (len(data[x]), len(data[y])), apart[x, y]
            )
    groups: list[list[str]] = []
    for name in names:
        tied = [
            i for i, group in enumerate(groups) if any(not apart[other, name] for other in group)
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
    inside = [(x, y) for g in groups for i, x in enumerate(g) for y in g[i + 1 :] if apart[x, y]]
    within = ""
    if inside:
        within = (
            " Separated all the same, inside a group: "
            + "; ".join(f"{x} {'above' if highest_first else 'below'} {y}" for x, y in inside)
            + "."
        )
    if len(groups) == 1:
        text = (
            f"No complete ordering{of} is supported here: no two groups are separated, the ranges "
            f"overlap or too few repeats lie apart ({listing}).{within}"
        )
    else:
        text = (
            f"Ordered{of}: {chain}, where ≈ joins what a rank test does not separate, directly or through a"
            f" neighbour ({listing}).{within}"
        )
    verdict = "ordered" if len(groups) > 1 else "indistinguishable"
    record = {
        "kind": "order",
        "what": what,
        "groups": [[str(n) for n in g] for g in groups],
        "inside": [[str(x), str(y)] for x, y in inside],
    }
    return Finding(text, verdict, {"groups": groups, "separated_inside": inside}, record)


def fit(
    name: str,
    r2: float,
    floor: float = R2_FLOOR,
    predicted: float | None = None,
    measured=None,
    unit: str = "",
) -> Finding:
    """Whether a fit may be used to predict: its R² against ``floor`` (1 is perfect, 0 is no
    better than the mean, below 0 worse than a constant), and, given a ``predicted`` value and
    the ``measured`` repeats of the same quantity, whether the prediction lies inside their
    range. A fit that passes the floor but predicts outside the range "misses": R² says the fit
    follows the points it was fitted to, not that it predicts what it was built for."""
    if not math.isfinite(r2):
        raise ValueError(f"the fit {name!r} has R² = {r2}: it was not computed")
    if (predicted is None) != (measured is None):
        raise ValueError(
            f"the fit {name!r}: give both predicted= and measured= (its repeats), or neither"
        )
    record = {"kind": "fit", "what": name}
    if r2 < floor:
        worse = " — worse than a constant" if r2 < 0 else ""
        record["verdict"] = "unusable"
        return Finding(
            f"The fit **{name}** has R² = {r2:.3f}{worse}, below {fmt(floor)}: these points do not "
            "follow the model, so its parameters are not measured here and nothing is predicted "
            "from it.",
            "unusable",
            {"r2": r2},
            record,
        )
    numbers = {"r2": r2}
    if predicted is None:
        record["verdict"] = "usable"
        return Finding(
            f"The fit **{name}** has R² = {r2:.3f} (≥ {floor:g}): it describes these points; "
            "predictions hold within the measured range, not beyond it.",
            "usable",
            numbers,
            record,
        )
    values = _check(f"measured, for the fit {name}", measured)
    if not math.isfinite(float(predicted)):
        raise ValueError(f"the fit {name!r} predicted {predicted}: nothing to judge")
    lo, hi = min(values), max(values)
    u = f" {unit}" if unit else ""
    against = f"predicts {fmt(predicted)}{u} against a measured {_range(values)}{u}"
    against += f" ({len(values)} repeats)" if len(values) > 1 else ""
    numbers.update(predicted=float(predicted), measured_min=lo, measured_max=hi)
    if lo <= predicted <= hi:
        record["verdict"] = "usable"
        text = (
            f"The fit **{name}** has R² = {r2:.3f} (≥ {floor:g}) and {against}, inside the "
            "measured range: it describes these points and predicts what was measured."
        )
        return Finding(text, "usable", numbers, record)
    off = (predicted - hi) / hi if predicted > hi else (predicted - lo) / lo if lo else math.inf
    record["verdict"] = "misses"
    text = (
        f"The fit **{name}** has R² = {r2:.3f} (≥ {floor:g}), yet {against}: "
        f"{'above' if predicted > hi else 'below'} every repeat (by {_pct(abs(off))} of the "
        "nearest), so the model misses what it was fitted to predict; R² says only that it "
        "follows its own points."
    )
    numbers["off"] = off
    return Finding(text, "misses", numbers, record)


def summary() -> Finding:
    """The notebook's family in one line: comparisons made, separations, and the separations
    chance alone would give; then any verdict that does not stand when the family is judged over
    the comparisons actually made, and any comparison whose repeats could not separate at all."""
    fam = current()
    made = fam.comparisons
    k = len(made)
    if not k:
        none = {"comparisons": 0}  # recorded too: a test reads every lecture's summary alike
        text = "**Findings of this run**: no comparisons made."
        return Finding(text, "summary", none, {"kind": "summary", **none})
    separated = [c for c in made if c.separated]
    alone = sum(null_separation_chance(*c.n, c.level) for c in made)
    if fam.expected is None:
        rule = (
            f"each judged alone at a chance of at most {fam.error:g} (no family declared: "
            "findings.family(K) at the top)"
        )
    else:
        rule = (
            f"each judged at a chance of at most {fam.level:.2g}, {fam.error:g} over the "
            f"{fam.expected} declared (Bonferroni: at most {fam.error:g} that even one separation "
            "is noise alone)"
        )
    text = (
        f"**Findings of this run**: {_count(k, 'comparison')}, {len(separated)} separated, {rule}; "
        f"chance alone would give {alone:.2g} separations."
    )
    strict = fam.error / max(k, fam.expected or 1)  # the level the count made asks for
    withdrawn = [c for c in separated if not _within(c.chance, strict)]
    if k > (fam.expected or 1):  # judged more loosely than the count made allows
        # a declaration short of the count is the notebook's error: said first, in bold
        text += f" **More than the {fam.expected} declared**." if fam.expected else ""
        text += f" Judged as one family of {k} ({fam.error:g} over {k}: {strict:.2g} each), " + (
            f"{len(withdrawn)} would not stand: "
            + "; ".join(f"{c.label} (chance {c.chance:.2g})" for c in withdrawn)
            + "."
            if withdrawn
            else "every separation stands."
        )
    unable = [c for c in made if not _within(chance_separated(*c.n), strict)]
    if unable:
        text += (
            f" Too few repeats to separate at {strict:.2g} ({repeats_to_separate(strict)} "
            "each needed): "
            + "; ".join(f"{c.label} ({c.n[0]} against {c.n[1]})" for c in unable)
            + "."
        )
    numbers = {
        "comparisons": k,
        "separated": len(separated),
        "chance_alone": alone,
        "declared": fam.expected,
        "level": fam.level,
        "withdrawn": [c.label for c in withdrawn],
        "too_few_repeats": [c.label for c in unable],
    }
    return Finding(text, "summary", numbers, {"kind": "summary", **numbers})


def _count(k: int, thing: str) -> str:
    return f"{k} {thing}" + ("" if k == 1 else "s")
