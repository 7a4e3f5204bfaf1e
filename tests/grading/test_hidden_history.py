"""A hidden probe's text stays in the grader: a later cell of the submission that reads
everything the kernel keeps of what it ran (IPython's In, _ih, _i*, Out, the history manager and
its database, linecache, the last traceback, every string the garbage collector can reach)
finds the visible probe lines and never the hidden ones, so it cannot print them into its own
feedback (issue 41: a submission printed lab 02's hidden probe lines from In)."""

from __future__ import annotations

import json

import nbformat
from grading_fixtures import KERNELSPEC, meta
from nbformat.v4 import new_code_cell, new_notebook

from course.grade import grade
from course.grading import cells

# Each marker is a comment: text of the source only, never a value the kernel must hold.
HIDDEN, VISIBLE = "hidden-probe-" + "marker", "visible-probe-" + "marker"

SUM_TEST = f"""\
digits_10 = digit_sum(10)  # {VISIBLE}
### BEGIN HIDDEN TESTS
# {HIDDEN}: the hidden probe's text, which must not reach the kernel's history
import os, random
_rng = random.Random(int(os.environ.get("COURSE_HIDDEN_SEED", "0")))
swept = {{n: digit_sum(n) for n in [_rng.randrange(10**6) for _ in range(4)]}}
swept
### END HIDDEN TESTS
# --- check ---
assert digits_10 == 1, digits_10
### BEGIN HIDDEN TESTS
import os, random
_rng = random.Random(int(os.environ.get("COURSE_HIDDEN_SEED", "0")))
for n in [_rng.randrange(10**6) for _ in range(4)]:
    assert swept.get(n) == sum(map(int, str(n))), n
### END HIDDEN TESTS
"""
# Its hidden probe raises in the submission below: the last traceback is the hidden piece's.
NEGATIVE_TEST = f"""\
digits_7 = digit_sum(7)
### BEGIN HIDDEN TESTS
import os
negative = digit_sum(-1 - int(os.environ.get("COURSE_HIDDEN_SEED", "0")) % 100)  # {HIDDEN}
### END HIDDEN TESTS
# --- check ---
assert digits_7 == 7, digits_7
### BEGIN HIDDEN TESTS
import os
assert negative == sum(map(int, str(1 + int(os.environ.get("COURSE_HIDDEN_SEED", "0")) % 100)))
### END HIDDEN TESTS
"""

# A student's cell after the tests: every place the kernel keeps what it ran, searched for the
# markers (built by concatenation: this cell's own text must not hold them), the texts that
# hold the hidden one printed, so that they reach the feedback.
SPY = """\
import gc, linecache, os, sqlite3, sys, traceback
H, V = "hidden-probe-" + "marker", "visible-probe-" + "marker"
ip = get_ipython()
hm = ip.history_manager
places = {
    "In": In, "_ih": _ih, "Out": Out, "_oh": _oh, "_i": _i, "_ii": _ii, "_iii": _iii,
    "_iN": {k: v for k, v in globals().items() if k.startswith("_i")},
    "unders": [globals().get(k) for k in ("_", "__", "___")],
    "input_hist_raw": hm.input_hist_raw, "input_hist_parsed": hm.input_hist_parsed,
    "output_hist": hm.output_hist, "output_hist_reprs": hm.output_hist_reprs,
    "session": list(hm.get_range(raw=True, output=True)),
    "search": list(hm.search("*")),
    "linecache": linecache.cache,
    "execution_count": ip.execution_count,
    "last_traceback": traceback.format_exception(sys.last_type, sys.last_value, sys.last_traceback),
    "ipython_traceback": ip.InteractiveTB.structured_traceback(
        sys.last_type, sys.last_value, sys.last_traceback),
    "kernel_traceback": getattr(ip, "_last_traceback", None),
}
if hm.enabled and os.path.exists(str(hm.hist_file)):
    places["sqlite"] = sqlite3.connect(str(hm.hist_file)).execute(
        "select source, source_raw from history").fetchall()
found = []
for obj in gc.get_objects():
    if obj is found:
        continue
    for value in (list(obj.values()) if isinstance(obj, dict) else list(obj)
                  if isinstance(obj, (list, tuple, set, frozenset)) else ()):
        if isinstance(value, str) and value not in (H, V) and (H in value or V in value):
            found.append(value)
places["gc"] = found
for name, value in places.items():
    text = repr(value)
    if name == "last_traceback":
        print(text[-1000:])  # the error the hidden piece raised: the spy reads it
    print(f"SPY {name}: visible={V in text} hidden={H in text}")
    if H in text:  # what a table-maker would print: the hidden lines around the marker
        print(text[max(0, text.index(H) - 300) : text.index(H) + 300])
"""


def source() -> nbformat.NotebookNode:
    return new_notebook(
        metadata={"kernelspec": KERNELSPEC, "language_info": {"name": "python"}},
        cells=[
            new_code_cell(
                "def digit_sum(n):\n    ### BEGIN SOLUTION\n    return sum(map(int, str(abs(n))))"
                "\n    ### END SOLUTION",
                metadata=meta("digit_sum", solution=True),
            ),
            new_code_cell(SUM_TEST, metadata=meta("test_digit_sum", grade=True, points=2)),
            new_code_cell(NEGATIVE_TEST, metadata=meta("test_negative", grade=True, points=1)),
            new_code_cell(
                "### BEGIN SOLUTION\nnotes = None\n### END SOLUTION",
                metadata=meta("notes", solution=True),
            ),
        ],
    )


def test_the_source_obeys_the_release_rules():
    cells.validate(source())


def test_a_later_cell_finds_no_trace_of_the_hidden_probe_in_the_kernel(tmp_path):
    lab = tmp_path / "lab.ipynb"
    nbformat.write(source(), lab)
    spy = source()
    # right on every input but a negative one, where it raises inside the hidden probe
    spy.cells[0].source = (
        "def digit_sum(n):\n    if n < 0:\n        raise ValueError('no negatives')\n"
        "    return sum(map(int, str(n)))"
    )
    spy.cells[3].source = SPY
    (tmp_path / "subs").mkdir()
    nbformat.write(spy, tmp_path / "subs" / "spy.ipynb")
    out = tmp_path / "out"
    result = grade(lab, tmp_path / "subs", out, progress=False, keep_work=True)["spy"]
    assert result.status == "graded", result.reason
    # the hidden piece that raised still fails its test, and the one that passed passes
    assert result.scores == {"test_digit_sum": 2.0, "test_negative": 0.0}, result.errors
    assert result.errors["test_negative"] == "ValueError: a hidden test failed"
    executed = nbformat.read(result.executed, as_version=4)
    said = "".join(o.get("text", "") for o in executed.cells[3].get("outputs", []))
    # The spy works: it finds the visible probe's text where the kernel keeps what it ran, and
    # reads the last traceback (the hidden piece's error)...
    for place in ("In", "_ih", "input_hist_raw", "linecache", "gc"):
        assert f"SPY {place}: visible=True" in said, said[:3000]
    assert "no negatives" in said, said[:3000]
    # ...and nowhere the hidden probe's.
    assert "hidden=True" not in said and HIDDEN not in said, said[:3000]
    written = [out / "feedback" / "spy.html", out / "results" / "spy.json", out / "gradebook.csv"]
    for path in written:
        assert HIDDEN not in path.read_text(), path
    assert HIDDEN not in json.dumps(nbformat.read(result.executed, as_version=4))


def test_a_work_folder_filled_before_a_hidden_probe_fails_that_test_not_the_grader(tmp_path):
    """The hidden probe reaches the kernel as a file of its work folder: a submission that
    fills the folder first makes that test fail, as its own doing, never the grader's run
    ("error", graded again by every run)."""
    from course.grading.results import Limits

    lab = tmp_path / "lab.ipynb"
    nbformat.write(source(), lab)
    filler = source()
    filler.cells[0].source = (
        "def digit_sum(n):\n    return sum(map(int, str(abs(n))))\n"
        "import os\nblock, i = b'x' * 2**20, 0\n"
        "try:\n    while True:\n        open(f'fill-{i}', 'wb').write(block)\n        i += 1\n"
        "except OSError as exc:\n    print('FULL', exc.errno)"
    )
    (tmp_path / "subs").mkdir()
    nbformat.write(filler, tmp_path / "subs" / "filler.ipynb")
    limits = Limits(cell_timeout=60, budget=120, work_size=16 * 2**20)
    result = grade(lab, tmp_path / "subs", tmp_path / "out", progress=False, limits=limits)
    r = result["filler"]
    assert r.status == "graded", r.reason
    assert r.scores == {"test_digit_sum": 0.0, "test_negative": 0.0}, r.errors
    assert r.errors["test_digit_sum"] == "OSError: a hidden test failed", r.errors
