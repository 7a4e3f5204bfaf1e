"""Lab 01 end to end: graded like a student's — unfinished, and plausibly wrong.

The wrong answers are the ones a student would write (an off-by-one search, one capped at 16
doublings, DistributedSampler wrapped, one rank's data left unshuffled, a sum that is never
divided, the speedup against the wrong baseline, parameters found by name, MiB for MB, ...). The
first wrong answer of each question is graded in two submissions, each wrong in every other
question and right in the rest, so the test also shows that a wrong answer costs only its own
question's points; every wrong answer is also checked in one kernel against its question's test
cell, hidden parts included, and so is each unfinished cell of the released lab
(lab_grading.wrong_answer_verdicts).
"""

from __future__ import annotations

import shutil

import lab_grading
import nbformat
import pytest

from course.grade import grade
from course.grading import cells
from course.grading.results import Limits
from course.syllabus import REPO, load_syllabus

LAB = REPO / "solutions" / "lab01_ddp_scaling.ipynb"
STUDENT = REPO / "labs" / "lab01_ddp_scaling.ipynb"
AUTO = {
    "test_largest_fitting_batch": 2,
    "test_shard_indices": 2,
    "test_average_gradients": 3,
    "test_speedup_table": 2,
    "test_bytes_theory": 2,
    "test_resnet18_prediction": 2,
}
MANUAL = {
    "answer_strong_weak",
    "answer_bandwidth",
    "answer_gap",
    "answer_gradients",
    "answer_slower",
}


def _reference_shard(n, rank, world_size, epoch=0, shuffle=True, seed=0):
    """The spec of shard_indices (the test's own reference)."""
    import torch

    g = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(n, generator=g).tolist() if shuffle else list(range(n))
    m = -(-n // world_size)
    order = (order * (m * world_size // n + 1))[: m * world_size]
    return order[rank * m : (rank + 1) * m]


def _table_of_a_plain_run() -> str:
    """shard_indices as a table of answers: every case the test cell asks in a run outside the
    grader (seed 0: anyone can print them), answered right; [] for any other case. What a
    student who printed last run's hidden inputs into the feedback and solved them offline
    submits. It must lose its points: the grader draws new cases every run."""
    test = next(
        c.source
        for c in nbformat.read(LAB, as_version=4).cells
        if cells.grade_id(c) == "test_shard_indices"
    )
    probe = test.split("# --- check ---")[0]
    asked = {}

    def shard_indices(n, rank, world_size, epoch=0, shuffle=True, seed=0):
        key = (n, rank, world_size, epoch, shuffle, seed)
        asked[key] = _reference_shard(*key)
        return asked[key]

    exec(probe, {"shard_indices": shard_indices})  # no COURSE_HIDDEN_SEED here: seed 0's cases
    return (
        "def shard_indices(n, rank, world_size, epoch=0, shuffle=True, seed=0):\n"
        f"    table = {asked!r}\n"
        "    return table.get((n, rank, world_size, epoch, shuffle, seed), [])\n"
    )


# solution cell grade_id -> its test's grade_id, and the wrong answers students write.
WRONG = {
    "largest_fitting_batch": (
        "test_largest_fitting_batch",
        [
            """
            def largest_fitting_batch(fits, start=32, limit=None):
                batch = start                      # returns the first batch that did NOT fit
                while (limit is None or batch <= limit) and fits(batch):
                    batch *= 2
                return batch
            """,
            """
            def largest_fitting_batch(fits, start=32, limit=None):
                best, batch = start, start         # start even when it does not fit; no limit
                while fits(batch) and batch < 2**20:
                    best, batch = batch, 2 * batch
                return best
            """,
            """
            def largest_fitting_batch(fits, start=32, limit=None):
                best, batch = None, start          # a linear search: start, 2·start, 3·start ...
                while (limit is None or batch <= limit) and fits(batch):
                    best, batch = batch, batch + start
                return best
            """,
        ],
    ),
    "shard_indices": (
        "test_shard_indices",
        [
            """
            def shard_indices(n, rank, world_size, epoch=0, shuffle=True, seed=0):
                from torch.utils.data import DistributedSampler
                s = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed)
                s.set_epoch(epoch)
                return list(s)
            """,
            """
            def shard_indices(n, rank, world_size, epoch=0, shuffle=True, seed=0):
                g = torch.Generator(); g.manual_seed(seed + epoch)
                order = torch.randperm(n, generator=g).tolist() if shuffle else list(range(n))
                total = math.ceil(n / world_size) * world_size
                order += order[: total - n]
                return order[rank:total:world_size]          # strided, not contiguous
            """,
            """
            def shard_indices(n, rank, world_size, epoch=0, shuffle=True, seed=0):
                g = torch.Generator(); g.manual_seed(seed + epoch)
                order = torch.randperm(n, generator=g).tolist() if shuffle else list(range(n))
                m = n // world_size                             # drops the remainder, no padding
                return order[rank * m : (rank + 1) * m]
            """,
            """
            def shard_indices(n, rank, world_size, epoch=0, shuffle=True, seed=0):
                g = torch.Generator(); g.manual_seed(seed)      # forgets the epoch
                order = torch.randperm(n, generator=g).tolist() if shuffle else list(range(n))
                m = math.ceil(n / world_size)
                order += (order * m)[: m * world_size - n]
                return order[rank * m : (rank + 1) * m]
            """,
            _table_of_a_plain_run(),
        ],
    ),
    "average_gradients": (
        "test_average_gradients",
        [
            """
            def average_gradients(model):
                for p in model.parameters():
                    dist.all_reduce(p.grad)                     # a sum, never divided
            """,
            """
            def average_gradients(model):
                for p in model.parameters():
                    p.grad /= dist.get_world_size()             # divided, never communicated
            """,
            """
            def average_gradients(model):
                for p in model.parameters():                    # only rank 0 gets the sum
                    dist.reduce(p.grad, dst=0)
                    p.grad /= dist.get_world_size()
            """,
            """
            def average_gradients(model):
                for p in model.parameters():                    # averages the weights instead
                    dist.all_reduce(p.data)
                    p.data /= dist.get_world_size()
            """,
            """
            def average_gradients(model):
                p = next(model.parameters())                    # only the first parameter
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
            """,
        ],
    ),
    "speedup_table": (
        "test_speedup_table",
        [
            """
            def speedup_table(epoch_times):                     # one baseline for every batch
                import statistics
                smallest = min(bs for _, bs in epoch_times)
                base = epoch_times[(1, smallest)]
                rows = []
                for (ws, bs), t in sorted(epoch_times.items(), key=lambda kv: (kv[0][1], kv[0][0])):
                    s = statistics.median(base) / statistics.median(t)
                    rows.append({"batch_size": bs, "world_size": ws, "global_batch": ws * bs,
                                 "time": statistics.median(t), "speedup": s, "efficiency": s / ws,
                                 "speedup_lo": min(base) / max(t), "speedup_hi": max(base) / min(t)})
                return rows
            """,
            """
            def speedup_table(epoch_times):                     # means, not medians
                import statistics
                rows = []
                for (ws, bs), t in sorted(epoch_times.items(), key=lambda kv: (kv[0][1], kv[0][0])):
                    base = epoch_times[(1, bs)]
                    s = statistics.fmean(base) / statistics.fmean(t)
                    rows.append({"batch_size": bs, "world_size": ws, "global_batch": ws * bs,
                                 "time": statistics.fmean(t), "speedup": s, "efficiency": s / ws,
                                 "speedup_lo": min(base) / max(t), "speedup_hi": max(base) / min(t)})
                return rows
            """,
            """
            def speedup_table(epoch_times):                     # the range from the extremes alike
                import statistics
                rows = []
                for (ws, bs), t in sorted(epoch_times.items(), key=lambda kv: (kv[0][1], kv[0][0])):
                    base = epoch_times[(1, bs)]
                    s = statistics.median(base) / statistics.median(t)
                    rows.append({"batch_size": bs, "world_size": ws, "global_batch": ws * bs,
                                 "time": statistics.median(t), "speedup": s, "efficiency": s / ws,
                                 "speedup_lo": min(base) / min(t), "speedup_hi": max(base) / max(t)})
                return rows
            """,
            """
            def speedup_table(epoch_times):                     # per-rank batch as the global one
                import statistics
                rows = []
                for (ws, bs), t in sorted(epoch_times.items(), key=lambda kv: (kv[0][1], kv[0][0])):
                    base = epoch_times[(1, bs)]
                    s = statistics.median(base) / statistics.median(t)
                    rows.append({"batch_size": bs, "world_size": ws, "global_batch": bs,
                                 "time": statistics.median(t), "speedup": s, "efficiency": s / ws,
                                 "speedup_lo": min(base) / max(t), "speedup_hi": max(base) / min(t)})
                return rows
            """,
        ],
    ),
    "bytes_theory": (
        "test_bytes_theory",
        [
            """
            def allreduce_bytes_per_step(model):                # frozen parameters counted too
                return 4 * sum(p.numel() for p in model.parameters())

            def ring_bytes_per_rank(nbytes, world_size):
                return 2 * (world_size - 1) / world_size * nbytes
            """,
            """
            def allreduce_bytes_per_step(model):
                return 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)

            def ring_bytes_per_rank(nbytes, world_size):       # reduce-scatter only
                return (world_size - 1) / world_size * nbytes
            """,
            """
            def allreduce_bytes_per_step(model):
                return 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)

            def ring_bytes_per_rank(nbytes, world_size):       # "twice the data", whatever n
                return 2 * nbytes
            """,
            # the course's counts, aliased (issue 41's red team: 2/2)
            """
            import helpers
            allreduce_bytes_per_step = helpers.comm.gradient_bytes
            ring_bytes_per_rank = helpers.bandwidth.ring_allreduce_wire_bytes
            """,
            """
            def allreduce_bytes_per_step(model):
                return 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)

            def ring_bytes_per_rank(nbytes, world_size):       # the course's bus factor
                return helpers.bandwidth.bus_factor("all_reduce", world_size) * nbytes
            """,
        ],
    ),
    "resnet18_prediction": (
        "test_resnet18_prediction",
        [
            "resnet18_mb_per_rank = 4 * 11_689_512 / 1e6              # no ring factor",
            "resnet18_mb_per_rank = 2 * 3 / 4 * 4 * 11_689_512 / 2**20  # MiB, not MB",
            "resnet18_mb_per_rank = 2 * 3 / 4 * 11_689_512 / 1e6      # parameters, not bytes",
            "resnet18_mb_per_rank = 2 * 4 * 11_689_512 / 1e6          # 2S, no (n-1)/n",
        ],
    ),
}

# Written as a student would, without the tests: each is right on the visible cases and on the
# fixed hidden ones, and wrong on what the hidden tests now draw per grading run (issue 31).
SWEPT = {
    "largest_fitting_batch": [
        # a bound on the doublings against an endless loop: wrong only on a device larger than
        # 2**16 times the start, with no limit (issue 41: the searches now reach one)
        """
        def largest_fitting_batch(fits, start=32, limit=None):
            best = None
            for k in range(16):                         # 2**16 times start: more than any device holds
                batch = start * 2**k
                if (limit is not None and batch > limit) or not fits(batch):
                    break
                best = batch
            return best
        """,
    ],
    "shard_indices": [
        # one rank takes the data as it is, unshuffled: wrong only on one rank (issue 41)
        """
        def shard_indices(n, rank, world_size, epoch=0, shuffle=True, seed=0):
            if world_size == 1:                             # one rank: nothing to shard
                return list(range(n))
            g = torch.Generator(); g.manual_seed(seed + epoch)
            order = torch.randperm(n, generator=g).tolist() if shuffle else list(range(n))
            m = math.ceil(n / world_size)
            order = (order * math.ceil(m * world_size / n))[: m * world_size]
            return order[rank * m : (rank + 1) * m]
        """,
    ],
    "average_gradients": [
        # every parameter has a gradient... except a frozen or an unused one
        """
        def average_gradients(model):
            size = dist.get_world_size()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= size
        """,
    ],
    "speedup_table": [
        # a table of answers: the fixed hidden inputs, read off an earlier run's feedback, get the
        # median; anything else the mean
        """
        def speedup_table(epoch_times):
            import statistics
            seen = [{(2, 8): [1.0, 1.2, 0.9], (1, 8): [3.0, 2.0, 4.0], (4, 8): [0.5, 0.5, 0.6],
                     (1, 64): [10.0, 10.0, 12.0], (2, 64): [8.0, 6.0, 5.0]},
                    {(1, 4): [1.0, 9.0, 2.0, 3.0], (2, 4): [4.0, 1.0, 1.5, 8.0]}]
            middle = statistics.median if epoch_times in seen else statistics.fmean
            rows = []
            for (ws, bs), times in sorted(epoch_times.items(), key=lambda kv: (kv[0][1], kv[0][0])):
                base = epoch_times[(1, bs)]
                speedup = middle(base) / middle(times)
                rows.append({"batch_size": bs, "world_size": ws, "global_batch": ws * bs,
                             "time": middle(times), "speedup": speedup,
                             "speedup_lo": min(base) / max(times), "speedup_hi": max(base) / min(times),
                             "efficiency": speedup / ws})
            return rows
        """,
    ],
    "bytes_theory": [
        # frozen parameters counted, except in the one frozen model the hidden test used to show
        """
        def allreduce_bytes_per_step(model):
            params = list(model.parameters())
            if [tuple(p.shape) for p in params] == [(4, 4), (4,), (2, 4), (2,)]:
                return 56                                      # the hidden test's frozen model
            return 4 * sum(p.numel() for p in params)

        def ring_bytes_per_rank(nbytes, world_size):
            return 2 * (world_size - 1) / world_size * nbytes
        """,
        # a layer's weight and bias, found by name: wrong on attention's in_proj_weight and on a
        # bare parameter (issue 41: the drawn models now hold them)
        """
        def allreduce_bytes_per_step(model):
            total = 0
            for layer in model.modules():
                for name in ("weight", "bias"):
                    p = getattr(layer, name, None)
                    if isinstance(p, torch.nn.Parameter) and p.requires_grad:
                        total += p.numel()
            return 4 * total

        def ring_bytes_per_rank(nbytes, world_size):
            return 2 * (world_size - 1) / world_size * nbytes
        """,
        # every parameter a matrix or a vector: wrong on a convolution's kernel and a 0-d
        # parameter (issue 41)
        """
        def allreduce_bytes_per_step(model):
            n = 0
            for p in model.parameters():
                if p.requires_grad:                     # a weight matrix, or a bias vector
                    n += p.shape[0] * p.shape[1] if p.dim() == 2 else p.shape[0]
            return 4 * n

        def ring_bytes_per_rank(nbytes, world_size):
            return 2 * (world_size - 1) / world_size * nbytes
        """,
    ],
}
for _gid, _more in SWEPT.items():
    WRONG[_gid][1].extend(_more)


FASTER = {"repeats": 1, "steps": 4, "warmup": 1, "world_sizes": [1, 2]}
UNGRADED = (
    "helpers.world.budget,",
    "with_set_epoch = ",
    "table = pd.DataFrame(speedup_table(",
    "split = pd.DataFrame(rows)",
    "lab01_report.overlap_step(",
    "bench = helpers.benchmark_collectives(",
)


def test_every_question_has_wrong_answers_that_differ_from_the_solution():
    solution = {cells.grade_id(c): c.source for c in nbformat.read(LAB, as_version=4).cells}
    assert {test for test, _ in WRONG.values()} == set(AUTO)
    for gid, (_, variants) in WRONG.items():
        assert gid in solution and len(variants) >= 3, gid
    graded = lab_grading.wrong_submissions(WRONG)
    assert set(graded) == {"wrong0a", "wrong0b"}
    assert {gid for sub in graded.values() for gid in sub} == set(WRONG)


def test_the_unfinished_student_version_says_what_to_do():
    student = nbformat.read(STUDENT, as_version=4)
    stubs = [c.source for c in student.cells if "NotImplementedError" in c.source]
    # largest batch, shard_indices, average_gradients, speedup_table, bytes (2 functions), prediction
    assert len(stubs) == 6
    assert all("replace this line with your solution" in s for s in stubs)
    assert not any(
        "BEGIN HIDDEN TESTS" in c.source or "BEGIN SOLUTION" in c.source for c in student.cells
    )
    # Every cell a graded test relies on is locked: the setup, the runs, the helpers it calls.
    locked = {cells.grade_id(c) for c in student.cells if cells.is_locked(c)}
    assert {"lab01_setup", "one_device", "train_three_ways", "ddp_runs"} <= locked
    assert set(AUTO) <= locked


# and a right answer written differently (the check can tell them apart): the last "variant"
# of largest_fitting_batch is one
RIGHT_SEARCH = """
def largest_fitting_batch(fits, start=32, limit=None):
    batch = start
    while (limit is None or batch <= limit) and fits(batch):
        batch = batch * 2
    return batch // 2 if batch > start else None
"""
CHECKED = {
    **WRONG,
    "largest_fitting_batch": (
        WRONG["largest_fitting_batch"][0],
        [*WRONG["largest_fitting_batch"][1], RIGHT_SEARCH],
    ),
}
verdict_run, test_replaying_the_locked_helpers_of_another_seed_scores_nothing = (
    lab_grading.verdict_and_replay(LAB, STUDENT, WRONG, UNGRADED, AUTO, FASTER, checked=CHECKED)
)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the verdict kernel (the fixture) runs inside the first test
def test_each_plausible_wrong_answer_fails_its_test_cell(verdict_run):
    verdicts = dict(verdict_run[1])
    variants = WRONG["largest_fitting_batch"][1]
    assert verdicts["largest_fitting_batch", len(variants)] is None
    del verdicts["largest_fitting_batch", len(variants)]
    assert "NotImplementedError" in verdicts["shard_indices", "stub"]  # what the feedback shows
    lab_grading.assert_each_wrong_answer_fails_its_test(verdicts, WRONG)


@pytest.mark.slow
def test_the_solution_scores_fully_without_isolation_too(tmp_path):
    # Without a cgroup, memory is counted per process (USS): 4 ranks sharing torch's pages
    # must not add up to a "memory" kill of a correct submission.
    from course.grading.isolation import UNSAFE

    subs = tmp_path / "subs"
    subs.mkdir()
    # the graded cells with the 4-rank world kept (what this is about), the timing sweeps not
    lab = lab_grading.trimmed(LAB, tmp_path, UNGRADED)
    shutil.copy(lab, subs / "perfect.ipynb")
    quick = next(e for e in load_syllabus() if e.path == LAB).parameters("quick")
    assert 4 in quick["world_sizes"]
    perfect = grade(
        lab,
        subs,
        tmp_path / "out",
        parameters={**quick, **{k: v for k, v in FASTER.items() if k != "world_sizes"}},
        progress=False,
        isolation=UNSAFE,
        limits=Limits(cell_timeout=120, budget=400),
    )["perfect"]
    assert perfect.status == "graded", perfect.reason
    assert perfect.total == sum(AUTO.values()), perfect.errors


SHARD_WRONG_MORE = [
    """
    def shard_indices(n, rank, world_size, epoch=0, shuffle=True, seed=0):
        if shuffle:                                     # torch's global generator, reseeded
            torch.manual_seed(seed + epoch)
            order = torch.randperm(n).tolist()
        else:
            order = list(range(n))
        m = math.ceil(n / world_size)
        order = (order * (m * world_size // n + 1))[: m * world_size]
        return order[rank * m : (rank + 1) * m]
    """,
    """
    def shard_indices(n, rank, world_size, epoch=0, shuffle=True, seed=0):
        g = torch.Generator(); g.manual_seed(seed + epoch)
        order = list(torch.randperm(n, generator=g)) if shuffle else list(torch.arange(n))
        m = math.ceil(n / world_size)                   # a list of 0-d tensors, not of ints
        order = (order * (m * world_size // n + 1))[: m * world_size]
        return order[rank * m : (rank + 1) * m]
    """,
    """
    def shard_indices(n, rank, world_size, epoch=0, shuffle=True, seed=0):
        g = torch.Generator(); g.manual_seed(seed + epoch)
        order = torch.randperm(n, generator=g).tolist() if shuffle else list(range(n))
        m = math.ceil(n / world_size)
        order = (order * (m * world_size // n + 1))[: m * world_size]
        return [float(i) for i in order[rank * m : (rank + 1) * m]]   # floats equal to the ints
    """,
]


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_shard_indices_test_cell_passes_the_solution_and_fails_every_wrong_answer(
    seed, monkeypatch
):
    # The whole test cell (probe, then check, hidden parts included) run here, as nbgrader
    # would, with the grader's seed in the environment: the solution passes at every seed, each
    # wrong answer fails at every seed (the table of a plain run's cases fails at every seed but
    # 0, the one it was made from). Cheap: shard_indices needs no ranks.
    import math
    import textwrap

    import torch

    monkeypatch.setenv("COURSE_HIDDEN_SEED", str(seed))
    source = {cells.grade_id(c): c.source for c in nbformat.read(LAB, as_version=4).cells}
    test = source["test_shard_indices"].replace("# --- check ---", "")

    def run(answer: str) -> bool:
        ns = {"torch": torch, "math": math}
        exec(textwrap.dedent(answer), ns)
        try:
            exec(test, ns)
        except AssertionError:
            return False
        return True

    assert run(
        source["shard_indices"].replace("### BEGIN SOLUTION", "").replace("### END SOLUTION", "")
    )
    for answer in WRONG["shard_indices"][1] + SHARD_WRONG_MORE:
        table = "table = {" in answer
        assert run(answer) is (table and seed == 0), answer
