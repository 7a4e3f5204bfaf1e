"""helpers.findings states only what the samples allow: checked against theory and simulation."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from helpers.measure import findings


@pytest.fixture(autouse=True)
def judged_alone():
    """Each test starts, and leaves, with no family declared (the module keeps one a process)."""
    findings.family()
    try:
        yield
    finally:
        findings.family()


@pytest.mark.parametrize("n,m", [(2, 2), (3, 3), (3, 4), (4, 4), (5, 3)])
def test_the_chance_of_disjoint_ranges_is_counted_exactly(n, m):
    # with no real difference every assignment of the n + m ranks to the two configurations is
    # equally likely; count the ones whose ranges do not overlap
    ranks = range(n + m)
    splits = list(itertools.combinations(ranks, n))
    disjoint = 0
    for a in splits:
        rest = set(ranks) - set(a)
        disjoint += max(a) < min(rest) or min(a) > max(rest)
    assert findings.chance_separated(n, m) == pytest.approx(min(1.0, disjoint / len(splits)))


def test_lehrs_rule_gives_the_rank_test_about_an_80_percent_chance_to_see_the_difference():
    # the repeats it asks for are the repeats *its own* verdict needs: the rank test at 0.1
    rng = np.random.default_rng(0)
    c, d = 0.10, 0.10
    n = findings.repeats_needed(c, d)
    assert n == 13  # 2 (z_0.95 + z_0.8)^2 pi/3 = 12.95
    hits = 0
    for _ in range(1000):
        a = list(rng.normal(1.0, c, n))
        b = list(rng.normal(1.0 + d, c, n))
        hits += findings.compare({"a": a, "b": b}).verdict != "indistinguishable"
    assert 0.72 < hits / 1000 < 0.88  # theory: about 0.80


@pytest.mark.parametrize("n,m,seed", [(3, 3, 0), (4, 5, 1), (6, 6, 2), (8, 7, 3)])
def test_the_rank_test_is_mann_whitneys_exact_test(n, m, seed):
    rng = np.random.default_rng(seed)
    a, b = list(rng.normal(0, 1, n)), list(rng.normal(0.8, 1, m))
    u, p = findings.rank_test(a, b)
    ref = stats.mannwhitneyu(a, b, alternative="two-sided", method="exact")
    assert u == ref.statistic and p == pytest.approx(ref.pvalue)


def test_the_rank_test_past_exact_counting_is_the_tie_corrected_normal_approximation():
    rng = np.random.default_rng(4)
    a = list(np.round(rng.normal(0, 1, 14), 1))  # rounded: ties
    b = list(np.round(rng.normal(0.5, 1, 15), 1))
    u, p = findings.rank_test(a, b)
    ref = stats.mannwhitneyu(a, b, alternative="two-sided", method="asymptotic")
    assert u == ref.statistic and p == pytest.approx(ref.pvalue, rel=1e-6)


def test_disjoint_ranges_have_the_chance_counted_for_them_and_more_repeats_can_separate_overlap():
    a, b = [1.0, 1.1, 1.2, 1.3], [2.0, 2.1, 2.2, 2.3]
    assert findings.rank_test(a, b)[1] == pytest.approx(findings.chance_separated(4, 4))
    # nine against nine, one repeat of each on the wrong side of the other: no longer a tie
    a = [1.0, 1.01, 1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 1.5]
    b = [1.45, 1.6, 1.61, 1.62, 1.63, 1.64, 1.65, 1.66, 1.67]
    f = findings.compare({"a": a, "b": b}, "s")
    assert f.verdict == "a better" and "fall the other way" in f.text and "rank test" in f.text
    assert f.numbers["chance"] < 0.01


def test_separated_repeats_give_a_verdict_with_the_ratio_and_its_range():
    f = findings.compare(
        {"1 rank": [0.115, 0.101, 0.115], "2 ranks": [0.192, 0.175, 0.225]}, "s", what="step time"
    )
    assert f.verdict == "1 rank better"
    assert f.text.startswith("**1 rank** is faster than **2 ranks** (step time)")
    assert "1 rank 0.115 s (0.101–0.115) against 2 ranks 0.192 s (0.175–0.225)" in f.text
    # the winner's values come first, named, whichever order the samples were given in
    g = findings.compare({"2 ranks": [0.192, 0.175, 0.225], "1 rank": [0.115, 0.101, 0.115]}, "s")
    assert "1 rank 0.115 s (0.101–0.115) against 2 ranks 0.192 s" in g.text
    assert f.numbers["ratio"] == pytest.approx(0.115 / 0.192)
    # the ratio's range runs over the extremes of both ranges
    assert "1.67× (1.52–2.23)" in f.text
    assert "0.1" in f.text  # the chance of disjoint ranges for 3 against 3, said beside it


def test_higher_is_better_turns_the_verdict_round():
    f = findings.compare({"warmup": [0.7, 0.8, 0.83], "none": [0.5, 0.52, 0.54]}, better="higher")
    assert f.verdict == "warmup better" and "**warmup** is higher than **none**" in f.text
    g = findings.compare({"warmup": [0.7, 0.8, 0.83], "none": [0.5, 0.52, 0.54]}, better="lower")
    assert g.verdict == "none better"


def test_overlapping_ranges_are_a_tie_with_the_repeats_that_would_settle_it():
    a, b = [0.203, 0.199, 0.206], [0.204, 0.203, 0.216]
    f = findings.compare({"batch 32": a, "batch 128": b}, "s")
    assert f.verdict == "indistinguishable"
    assert "indistinguishable here" in f.text and "the ranges overlap" in f.text
    c = (np.std(a, ddof=1) / np.mean(a) + np.std(b, ddof=1) / np.mean(b)) / 2
    d = abs(np.median(a) - np.median(b)) / np.mean([np.median(a), np.median(b)])
    assert f.numbers["repeats_needed"] == math.ceil(findings.LEHR * c * c / (d * d))
    assert f"{f.numbers['repeats_needed']} repeats each" in f.text


def test_two_seeds_cannot_order_even_when_their_ranges_are_apart():
    f = findings.compare({"warmup": [0.70, 0.83], "none": [0.50, 0.54]}, better="higher")
    assert f.verdict == "indistinguishable"
    assert "by chance 33%" in f.text


def test_one_run_each_says_that_no_spread_was_measured():
    f = findings.compare({"A": [1.0], "B": [2.0]}, "s")
    assert f.verdict == "indistinguishable" and "at least 3 times" in f.text


def test_an_ordering_claims_nothing_a_pair_of_ranges_does_not_support():
    # DenseNet's wide range overlaps both SqueezeNet's and ResNet18's: no two groups are apart
    f = findings.order(
        {
            "ResNet18": [28, 16, 31],
            "AlexNet": [25, 24, 26],
            "SqueezeNet": [14, 12, 15],
            "DenseNet": [13, 3, 19],
        },
        "%",
        highest_first=True,
    )
    assert f.verdict == "indistinguishable" and f.numbers["groups"] == [
        ["ResNet18", "AlexNet", "SqueezeNet", "DenseNet"]
    ]
    g = findings.order({"c": [3, 3.1, 3.2], "a": [1, 1.1, 1.2], "b": [1.15, 2.1, 2.2]}, "s")
    assert g.numbers["groups"] == [["a", "b"], ["c"]]
    assert "**a** ≈ **b** < **c**" in g.text
    h = findings.order({"x": [1, 1.1, 1.2], "y": [2, 2.1, 2.2], "z": [3, 3.1, 3.2]})
    assert h.numbers["groups"] == [["x"], ["y"], ["z"]]
    # every pair across groups is separated, whatever the input
    rng = np.random.default_rng(1)
    for _ in range(200):
        data = {f"c{i}": list(rng.normal(rng.uniform(0, 3), 0.3, 3)) for i in range(5)}
        groups = findings.order(data).numbers["groups"]
        for i, j in itertools.combinations(range(len(groups)), 2):
            for p in groups[i]:
                for q in groups[j]:
                    assert max(data[p]) < min(data[q])


def test_a_fit_below_the_floor_predicts_nothing():
    bad = findings.fit("α-β, n = 2", -0.12)
    assert bad.verdict == "unusable" and "worse than a constant" in bad.text
    good = findings.fit("α-β, n = 4", 0.97)
    assert good.verdict == "usable" and "not beyond it" in good.text
    assert findings.fit("x", 0.85, floor=0.8).verdict == "usable"


def test_bad_input_says_what_to_do():
    with pytest.raises(ValueError, match="no measurements: run it at least once"):
        findings.compare({"A": [], "B": [1.0]})
    with pytest.raises(ValueError, match="not a finite number"):
        findings.compare({"A": [float("nan")], "B": [1.0]})
    with pytest.raises(ValueError, match="better must be"):
        findings.compare({"A": [1.0], "B": [1.0]}, better="faster")
    with pytest.raises(ValueError, match="exactly two"):
        findings.compare({"A": [1.0]})
    with pytest.raises(ValueError, match="not computed"):
        findings.fit("x", float("nan"))


def test_a_finding_shows_as_markdown_in_a_notebook():
    f = findings.value([1.0, 2.0, 3.0], "ms", "step")
    assert f._repr_markdown_() == "**step**: 2.00 ms (1.00–3.00, 3 repeats)"
    assert str(f) == "step: 2.00 ms (1.00–3.00, 3 repeats)"  # printed: no Markdown marks


def test_noise_as_large_as_the_values_asks_for_longer_runs_not_repeats():
    f = findings.compare(
        {"rise in compute": [-0.01, 0.02, 0.001], "exposed": [0.004, 0.03, -0.002]}
    )
    assert f.verdict == "indistinguishable"
    assert "longer runs" in f.text and "repeats each" not in f.text


def test_a_group_joined_through_a_wide_range_still_names_its_separated_pairs():
    f = findings.order({"DP": [10, 10.5, 11], "TP": [9, 12, 15], "PP": [12, 12.5, 13]}, "ms")
    assert f.verdict == "indistinguishable" and f.numbers["separated_inside"] == [("DP", "PP")]
    assert "No complete ordering" in f.text and "DP below PP" in f.text
    # what compare() says of the pair, order() does not contradict
    assert findings.compare({"DP": [10, 10.5, 11], "PP": [12, 12.5, 13]}).verdict == "DP better"


def test_ranges_separated_beyond_three_digits_are_printed_apart():
    """Lab 04's m = 1 line read "0.501 (0.501–0.501) against 0.501 (0.501–0.501) … the ranges
    do not overlap": as many digits as it takes to show the gap."""
    f = findings.compare({"GPipe": [0.50118, 0.50119, 0.50120], "1F1B": [0.50130, 0.50131, 0.5014]})
    assert f.verdict == "GPipe better"
    assert "GPipe 0.5012 (0.5012–0.5012) against 1F1B 0.5013 (0.5013–0.5014)" in str(f)
    overlapping = findings.compare({"a": [1.0, 1.1, 1.2], "b": [1.1, 1.2, 1.3]})
    assert "1.10 (1.00–1.20) against 1.20 (1.10–1.30)" in str(overlapping)  # 3 digits as before


def test_a_rank_verdict_against_the_medians_order_is_no_verdict():
    # a tail on one side: the rank test separates them, but the medians are equal
    a, b = [5, 5, 5, 5, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 5, 5, 5, 5]
    assert findings.rank_test(a, b)[1] <= findings.MAX_CHANCE
    f = findings.compare({"a": a, "b": b}, "s")
    assert f.verdict == "indistinguishable" and "not in the order of their medians" in f.text
    assert findings.order({"a": a, "b": b}).verdict == "indistinguishable"


def test_lehrs_constant_follows_the_chance_the_verdicts_allow():
    from statistics import NormalDist

    z = NormalDist().inv_cdf
    assert findings.LEHR == pytest.approx(2 * (z(0.95) + z(0.8)) ** 2 * math.pi / 3)
    assert findings.LEHR_RULE.startswith("13c²/d²")


DISJOINT_3 = {"1 rank": [0.115, 0.101, 0.115], "2 ranks": [0.192, 0.175, 0.225]}


def test_a_declared_family_judges_each_comparison_at_its_share_of_the_error():
    assert findings.compare(DISJOINT_3, "s").verdict == "1 rank better"  # alone: 0.1
    findings.family(2)
    f = findings.compare(DISJOINT_3, "s")
    assert f.verdict == "indistinguishable" and f.numbers["level"] == pytest.approx(0.05)
    assert "by chance 10% of the time, more than the 0.05 allowed" in f.text
    findings.family(3)  # 4 against 4 disjoint: 2/70 = 0.029 <= 0.1/3
    four = {"a": [1.0, 1.1, 1.2, 1.3], "b": [2.0, 2.1, 2.2, 2.3]}
    assert findings.compare(four).verdict == "a better"
    findings.family(4)  # 0.025: not any more
    assert findings.compare(four).verdict == "indistinguishable"


@pytest.mark.parametrize(
    "k,n", [(1, 3), (2, 4), (3, 4), (4, 5), (12, 5), (13, 6), (46, 6), (47, 7), (171, 7)]
)
def test_the_repeats_that_can_separate_at_all_are_those_the_module_doc_states(k, n):
    level = findings.MAX_CHANCE / k
    assert findings.repeats_to_separate(level) == n
    # n is the fewest: n - 1 disjoint repeats each owe more than the level to chance
    assert findings.chance_separated(n, n) <= level < findings.chance_separated(n - 1, n - 1)
    findings.family(k)
    assert findings.repeats_to_separate() == n
    assert findings.repeats_needed(0.01, 0.5) == n  # a large difference: the floor decides


@pytest.mark.parametrize("n,m,level", [(3, 3, 0.1), (4, 5, 0.05), (5, 5, 0.01), (6, 4, 0.02)])
def test_the_chance_of_a_separation_from_noise_alone_is_the_tests_exact_size(n, m, level):
    # every split of n + m distinct values is equally likely with no real difference
    values = list(range(n + m))
    hits = total = 0
    for a in itertools.combinations(values, n):
        b = [v for v in values if v not in a]
        total += 1
        hits += findings.rank_test(a, b)[1] <= level
    assert findings.null_separation_chance(n, m, level) == pytest.approx(hits / total)


def test_a_declared_family_keeps_the_chance_of_any_false_separation_under_its_error():
    # ten comparisons of identical configurations, 5 repeats each, in families of ten
    rng = np.random.default_rng(5)
    runs, any_separated = 300, 0
    for _ in range(runs):
        findings.family(10)
        for _ in range(10):
            findings.compare({"a": list(rng.normal(1, 0.1, 5)), "b": list(rng.normal(1, 0.1, 5))})
        s = findings.summary()
        any_separated += s.numbers["separated"] > 0
    alone = 10 * findings.null_separation_chance(5, 5, 0.01)  # 10 x 2/252
    assert s.numbers["chance_alone"] == pytest.approx(alone)
    assert any_separated / runs < 0.1 + 0.05  # theory: 1 - (1 - 2/252)^10 = 0.077


def test_the_summary_counts_the_comparisons_and_the_separations_noise_would_give():
    findings.family(3)
    findings.compare({"a": [1.0, 1.1, 1.2, 1.3], "b": [2.0, 2.1, 2.2, 2.3]}, "s", what="t")
    findings.order({"x": [1, 1.1, 1.2], "y": [2, 2.1, 2.2]})  # one pair: 3 against 3
    s = findings.summary()
    assert s.verdict == "summary" and s.numbers["comparisons"] == 2
    assert s.numbers["separated"] == 1 and s.numbers["withdrawn"] == []
    assert s.numbers["chance_alone"] == pytest.approx(2 / 70)  # 3 vs 3 cannot at 0.033
    assert str(s).startswith("Findings of this run: 2 comparisons, 1 separated, each judged at")
    assert "Too few repeats to separate at 0.033 (4 each needed): x against y (order)" in str(s)


def test_a_family_larger_than_declared_is_judged_again_and_its_weak_verdicts_withdrawn():
    # undeclared: each alone at 0.1, as before the family; five comparisons ask for 0.02 each
    findings.compare(DISJOINT_3, "s", what="step time")
    five = {"a": [1.0, 1.1, 1.2, 1.3, 1.4], "b": [2.0, 2.1, 2.2, 2.3, 2.4]}
    for _ in range(4):
        assert findings.compare(five).verdict == "a better"  # 2/252 = 0.0079 <= 0.02
    s = findings.summary()
    assert s.numbers["comparisons"] == 5 and s.numbers["separated"] == 5
    assert s.numbers["withdrawn"] == ["1 rank against 2 ranks (step time)"]
    assert "no family declared" in str(s) and "1 would not stand" in str(s)
    # each judged at 0.1: 3 against 3 separates by chance 2/20, 5 against 5 a little less
    assert s.numbers["chance_alone"] == pytest.approx(
        0.1 + 4 * findings.null_separation_chance(5, 5, 0.1)
    )
    assert "More than" not in str(s)  # nothing was declared, so nothing was declared too few
    findings.family(1)  # declared too few: the summary says the same, and says it first, in bold
    findings.compare(five)
    findings.compare(DISJOINT_3, "s", what="step time")
    s = findings.summary()
    assert s.numbers["withdrawn"] == ["1 rank against 2 ranks (step time)"]
    assert "separations. **More than the 1 declared**. Judged as one family of 2" in s.text


def test_lehrs_advice_follows_the_family_level():
    findings.family(20)
    assert findings.LEHR_RULE.startswith("28c²/d²")  # 2 (z_0.99875 + z_0.8)^2 pi/3
    assert findings.repeats_needed(0.1, 0.1) == math.ceil(findings.lehr(0.005))
    f = findings.compare({"a": [0.203, 0.199, 0.206], "b": [0.204, 0.203, 0.216]}, "s")
    assert "(28c²/d², Lehr's rule for this test)" in f.text


def test_a_family_must_be_declared_with_a_count_and_a_chance():
    with pytest.raises(ValueError, match="at least 1 comparison"):
        findings.family(0)
    with pytest.raises(ValueError, match="whole number"):
        findings.family(2.5)
    with pytest.raises(ValueError, match="between 0 and 1"):
        findings.family(5, error=5)


def test_a_fit_whose_prediction_falls_outside_the_measured_range_misses():
    # lab 01, one build: R² 0.914 passed the floor, and predicted 47.4 ms against 48.7–66.0 ms
    f = findings.fit("α-β, n = 2", 0.914, predicted=47.4, measured=[48.7, 55.0, 66.0], unit="ms")
    assert f.verdict == "misses" and f.numbers["off"] == pytest.approx(47.4 / 48.7 - 1)
    assert "predicts 47.4 ms against a measured 48.7–66.0 ms (3 repeats)" in str(f)
    assert "below every repeat" in str(f)
    inside = findings.fit("α-β, n = 2", 0.914, predicted=50.0, measured=[48.7, 55.0, 66.0])
    assert inside.verdict == "usable" and "inside the measured range" in str(inside)
    low = findings.fit("α-β, n = 2", 0.5, predicted=50.0, measured=[48.7, 55.0, 66.0])
    assert low.verdict == "unusable"  # below the floor: nothing predicted, in range or not
    with pytest.raises(ValueError, match="both predicted= and measured="):
        findings.fit("x", 0.95, predicted=1.0)


def test_a_displayed_finding_carries_its_verdict_for_course_compare():
    from IPython.core.interactiveshell import InteractiveShell

    shown, _ = InteractiveShell.instance().display_formatter.format(
        findings.compare(DISJOINT_3, "s")
    )
    assert shown["text/markdown"].startswith("**1 rank** is faster than **2 ranks**")
    assert shown[findings.MIME] == {
        "kind": "compare",
        "what": "",
        "names": ["1 rank", "2 ranks"],
        "first": "1 rank",
    }
    ordered, _ = InteractiveShell.instance().display_formatter.format(
        findings.order({"x": [1, 1.1, 1.2], "y": [2, 2.1, 2.2]})
    )
    assert ordered[findings.MIME]["groups"] == [["x"], ["y"]]
