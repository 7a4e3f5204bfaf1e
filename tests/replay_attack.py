"""The replay attack, the generic form of "a reference computed in the student's kernel".

A student can redefine any name in the kernel, a locked cell's helpers included, in a cell of
their own right after that cell. The strongest such redefinition needs no understanding of the
lab: run the solution once (at some hidden seed), note what every function of every locked
cell returned, call by call, and hand in the blank lab with each of those functions replaced by
one that returns the notes in the same order. A test that compares two values a locked helper
returned (the student's answer and a reference it computed beside it), or whose hidden inputs
are the same in every run, passes on such a submission. A test whose reference is computed by
the check, on cases the check draws from this run's seed, does not.

So for every lab, the suite records the solution's locked returns in the verdict kernel's first
pass (``Recorder``: no extra run of the lab) and grades two submissions built from them
(``submissions``):
- ``replay-other``: graded at another seed than the recording's. It must score 0 everywhere.
- ``replay-same``: graded at the recording's own seed, a control that the replay is faithful:
  every test whose probe calls no name a student's answer defines (only locked helpers, which
  call the student's code inside) gets its full points, as the solution did. Without it, a
  replay that broke on the way (a misaligned call, a value that did not survive pickling) would
  score 0 for the wrong reason.

Calls are keyed by the code cell they happen in (its place among the notebook's own code cells)
and counted within it, so a stub that raises half-way through a cell does not shift the calls of
the next. A return value that cannot be pickled, or is over ``MAX_VALUE`` bytes pickled (a model
the lab builds, not a reference), is not replayed: the real function runs there.
"""

from __future__ import annotations

import ast
import base64
import pickle
import zlib
from pathlib import Path

import nbformat

from course.grading import cells
from course.grading.submission import MAX_SOURCE

MAX_VALUE = 2**20  # bytes of one pickled return that the submission carries in its source
SAME, OTHER = "replay-same", "replay-other"

# Run in the recording kernel before the lab. A rank started by helpers.launch gets a pickled
# copy of a wrapped function (cloudpickle): its recorder pickles as one that keeps nothing, so
# the log never travels to the ranks and only the kernel's own calls are recorded.
RECORDER = '''
import cloudpickle as _rp_cloudpickle
import functools as _rp_functools


class _ReplayNoRecord:
    def add(self, name, value):
        pass


class _ReplayRecord:
    """Every locked function's returns, by code cell and in call order."""

    def __init__(self):
        self.key, self.log = None, {}

    def add(self, name, value):
        if self.log is None:
            return
        try:
            data = _rp_cloudpickle.dumps(value)
        except Exception:
            data = None
        self.log.setdefault(f"{name}@{self.key}", []).append(data)

    def __reduce__(self):
        return (_ReplayNoRecord, ())


_replay_record = _ReplayRecord()


def _replay_wrap(name, f):
    record = _replay_record

    @_rp_functools.wraps(f)
    def recorded(*args, **kwargs):
        value = f(*args, **kwargs)
        record.add(name, value)
        return value

    return recorded
'''

# The submission's first cell: what replays the notes (a student's cell: the grader runs it).
REPLAYER = """# Not the work: every function a locked cell defines returns, call by call, what it returned
# when the solution ran at another hidden seed (tests/replay_attack.py).
import base64 as _rp_base64
import pickle as _rp_pickle
import zlib as _rp_zlib


class _Replay:
    key = None

    def __init__(self):
        self.calls = {}

    def __call__(self, name, real, notes):
        def replayed(*args, **kwargs):
            at = f"{name}@{self.key}"
            i = self.calls[at] = self.calls.get(at, -1) + 1
            got = notes.get(at, [])
            if i >= len(got):
                raise RuntimeError(f"replay: no call {i} of {name} noted in code cell {self.key}")
            return real(*args, **kwargs) if got[i] is None else _rp_pickle.loads(got[i])

        return replayed


_replay = _Replay()
"""


def replaced(cell) -> list[str]:
    """The functions a locked (not graded) code cell defines at its top level: those the attack
    replaces right after it. A class is not replayed: its instances are made by its callers."""
    if cell.cell_type != "code" or not cells.is_locked(cell) or cells.is_graded(cell):
        return []
    return [n.name for n in ast.parse(cell.source).body if isinstance(n, ast.FunctionDef)]


def code_keys(nb) -> list[int | None]:
    """Per cell of ``nb``: its place among the notebook's own code cells (None for Markdown and
    for a cell papermill or the tests injected), the key both the record and the replay use."""
    keys, k = [], 0
    for c in nb.cells:
        injected = "injected-parameters" in c.get("metadata", {}).get("tags", [])
        if c.cell_type == "code" and not injected:
            keys.append(k)
            k += 1
        else:
            keys.append(None)
    return keys


class Recorder:
    """Drives the recording in a kernel an nbclient ``client`` runs: ``before(i)`` ahead of cell
    i, ``after(i, error)`` once it ran, ``save(path)`` after the last cell."""

    def __init__(self, client, nb):
        # read now: nbclient puts each cell it runs at its index in ``nb``, metadata-less
        self.client, self.keys, self.names = client, code_keys(nb), [replaced(c) for c in nb.cells]
        self._run(RECORDER)

    def _run(self, source: str) -> None:
        cell = nbformat.v4.new_code_cell(source)
        self.client.execute_cell(cell, 0)
        errors = [o for o in cell.outputs if o.output_type == "error"]
        assert not errors, f"the replay recorder failed: {errors[0].ename}: {errors[0].evalue}"

    def before(self, index: int) -> None:
        if self.keys[index] is not None:
            self._run(f"_replay_record.key = {self.keys[index]}")

    def after(self, index: int, error: str | None) -> None:
        names = self.names[index]
        if names and error is None:
            self._run(f"for _n in {names!r}:\n    globals()[_n] = _replay_wrap(_n, globals()[_n])")

    def save(self, path: Path) -> None:
        self._run(
            f"import pickle as _rp_p\nwith open({str(path)!r}, 'wb') as _f:\n"
            "    _rp_p.dump(_replay_record.log, _f)\n_replay_record.log = None"
        )


def _notes_cell(names: list[str], notes: dict) -> str:
    mine = {
        at: [v if v is not None and len(v) <= MAX_VALUE else None for v in values]
        for at, values in notes.items()
        if at.split("@")[0] in names
    }
    blob = base64.b64encode(zlib.compress(pickle.dumps(mine), 9)).decode()
    return (
        f"_notes = _rp_pickle.loads(_rp_zlib.decompress(_rp_base64.b64decode({blob!r})))\n"
        f"for _n in {names!r}:\n    globals()[_n] = _replay(_n, globals()[_n], _notes)"
    )


def submission(student: Path, notes: dict) -> nbformat.NotebookNode:
    """The blank ``student`` lab with the replay: the replayer first, the cell key before every
    code cell, and each locked cell's functions replaced right after it."""
    nb = nbformat.read(student, as_version=4)
    keys = code_keys(nb)
    out = [nbformat.v4.new_code_cell(REPLAYER)]
    for cell, key in zip(nb.cells, keys, strict=True):
        if key is not None:
            out.append(nbformat.v4.new_code_cell(f"_replay.key = {key}"))
        out.append(cell)
        names = replaced(cell)
        if names:
            out.append(nbformat.v4.new_code_cell(_notes_cell(names, notes)))
    nb.cells = out
    size = sum(len(c.source) for c in out)
    assert size <= MAX_SOURCE, f"the replay's notes, {size:,} characters, are over the grader's cap"
    return nb


def _keyed_ids(nb) -> list[str | None]:
    return [
        cells.grade_id(c) for c, k in zip(nb.cells, code_keys(nb), strict=True) if k is not None
    ]


def same_cell_order(recorded_nb, student: Path) -> None:
    """The record's cell keys mean the same cells in the student version."""
    theirs = _keyed_ids(nbformat.read(student, as_version=4))
    assert _keyed_ids(recorded_nb) == theirs, "the solution's and the student's code cells differ"


def replayable_tests(lab: Path) -> set[str]:
    """Graded tests whose probe reads no name a student's answer cell binds: it reaches the
    student's code only through locked helpers, so a faithful replay at the recording's seed
    passes it. A probe that pulls from the live world (``interactive.pull``) reads what the
    student's ``%%ranks`` cell left on the ranks, no kernel name: not replayable either."""
    nb = nbformat.read(lab, as_version=4)
    answers = set()
    for c in nb.cells:
        if c.cell_type == "code" and cells.info(c).get("solution") and not cells.is_graded(c):
            answers |= set(cells.bound_names(c.source))
    return {
        cells.grade_id(c)
        for c in nb.cells
        if c.cell_type == "code"
        and cells.is_graded(c)
        and not cells.read_names(probe := cells.split_test(c.source)[0]) & answers
        and "interactive.pull(" not in probe
    }


def load_notes(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f)
