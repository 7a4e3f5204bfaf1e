"""The link between two nodes as an experiment (helpers/tools/interconnect.py, lecture 07 §5).

The tests that make network namespaces and shape a link run only where COURSE_CLUSTER_TESTS=1
and as root, like the cluster's (`COURSE_CLUSTER_TESTS=1 scripts/test.sh tests/cluster`); the
recorded run the lecture falls back to is checked everywhere.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from helpers.tools import interconnect, link_rank

makes_namespaces = [
    pytest.mark.skipif(
        os.environ.get("COURSE_CLUSTER_TESTS") != "1",
        reason="makes network namespaces: runs with COURSE_CLUSTER_TESTS=1 (README: tests/cluster)",
    ),
    pytest.mark.skipif(
        interconnect.cannot_run() is not None, reason=str(interconnect.cannot_run())
    ),
]


def ours() -> list[str]:
    """The namespaces this process's runs made (their names carry its id) that still exist."""
    found = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    return [n for n in found if n.startswith(f"cl{os.getpid()}-")]


class TestShapedLink:
    pytestmark = makes_namespaces

    def test_the_fitted_bandwidth_recovers_each_configured_rate(self):
        """The physical anchor: for two rates, the wire's payload rate (the configured rate
        less the headers) lies inside the range of the bandwidths fitted to each sweep."""
        p = interconnect.plan(rates=[100, 25], repeats=5, setups=[])
        run = interconnect.across_nodes(p, timeout=240)
        assert ours() == []  # torn down: namespaces, their ends of the pair and the shaping
        for rate in (100, 25):
            finding = interconnect.anchor(run, rate)
            print(finding)  # the configured rate against the fitted ones: -rP shows it
            assert finding.verdict == "at the limit", str(finding)
        fits = interconnect.fits(run["rates"])
        slow, fast = (sorted(a.beta for a in fits[r]["repeats"])[2] for r in (25, 100))
        assert 3.5 < fast / slow < 4.5  # four times the rate, four times the bandwidth

    def test_a_rank_that_dies_fails_the_run_and_leaves_nothing(self):
        with pytest.raises(RuntimeError, match="the ranks on the two nodes failed"):
            interconnect.run_ranks("helpers.tools.multinode:whoami", ["0"], timeout=120)
        assert ours() == []

    def test_a_run_that_hangs_is_stopped_and_leaves_nothing(self):
        with pytest.raises(RuntimeError, match="did not finish in 3 s"):
            interconnect.run_ranks("time:sleep", ["600"], timeout=3)
        assert ours() == []
        # the ranks are gone too: no process is left in a namespace of ours, nor any sleeper
        left = subprocess.run(["pgrep", "-f", "helpers.run time:sleep"], capture_output=True)
        assert left.stdout.strip() == b""

    def test_shaping_a_device_that_does_not_exist_says_what_tc_said(self):
        with pytest.raises(RuntimeError, match="tc qdisc replace dev no-such-dev.*tbf"):
            link_rank.shape("no-such-dev", 100)


def test_the_recorded_run_reads_as_the_lecture_shows_it():
    """Where the notebook cannot make the nodes it shows this run: every link it measured has
    its fit and its DDP rows, and the slow link's anchor is judged."""
    rec = interconnect.recorded()
    assert sorted(rec["across"]["rates"]) == sorted(rec["plan"]["rates"])
    assert list(rec["within"]["rates"]) == [None]
    rows = interconnect.allreduce_rows(rec["across"], rec["within"])
    assert len(rows) == len(rec["plan"]["rates"]) + 1
    ddp = interconnect.ddp_rows(rec["across"], rec["within"])
    assert len(ddp) == len(rows) * len(link_rank.SETUPS)
    slowest = min(rec["plan"]["rates"])
    limits = ("at the limit", "below the limit", "above the limit")
    assert interconnect.anchor(rec["across"], slowest).verdict in limits


@pytest.mark.skipif(
    os.environ.get("COURSE_CLUSTER_TESTS") != "1" or interconnect.cannot_run() is not None,
    reason="makes namespaces: COURSE_CLUSTER_TESTS=1, as root or where users may",
)
def test_the_same_run_in_a_user_namespace_finds_the_same_anchor():
    """The way a kernel that is not root takes (as on a hub): the whole run in a user namespace
    of its own, where it is root, with /run/netns a tmpfs of its own; forced here as root."""
    run = interconnect.across_nodes(
        interconnect.plan(rates=[100], repeats=5, setups=[]), user_namespace=True
    )
    finding = interconnect.anchor(run, 100)
    print(finding)
    assert finding.verdict == "at the limit", str(finding)
    assert ours() == []  # the user namespace's namespaces were never in the host's /run/netns


def test_the_token_bucket_holds_a_few_ms_of_a_fast_link_and_two_frames_of_a_slow_one():
    """At a fast rate a bucket of two frames empties faster than a late timer refills it
    (tc-tbf(8)); from 100 Mbit/s on (the lecture's rates), the smallest message (4 ms on the
    wire) is at least twice the burst, which then lowers α and leaves β alone. (Below that the
    two frames tbf needs are more than 2 ms of traffic.)"""
    assert link_rank.burst(1000) == 1000e6 / 8 * link_rank.BURST_MS / 1e3
    assert link_rank.burst(25) == link_rank.MIN_BURST
    for rate in (*interconnect.QUICK_RATES, 10_000):
        assert min(link_rank.sizes(rate, interconnect.QUICK_WIRE_MS)) >= 2 * link_rank.burst(rate)
    assert str(link_rank.burst(1000)) in link_rank.shape_command("eth0", 1000)
