"""A submission's name cannot stop the batch or take another's grade: a name too long for a
file name, a name that is not UTF-8, a hidden name and a folder beside a file of the same name
are refused alone, with a reason in the gradebook; every other name reads back exactly from
the gradebook, the written questions' sheets, `course mark`, `course grade-merge` and
`course export`."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import nbformat
import pytest
from grading_fixtures import answer, release

from course.grade import grade
from course.grading import reports


def course(*args):
    return subprocess.run(
        [sys.executable, "-m", "course.cli", *map(str, args)], capture_output=True, text=True
    )


def read_back(path, column: str) -> dict[str, dict]:
    """A CSV the grader wrote, keyed by ``column`` read back as documented (reports.from_cell)."""
    with open(path, newline="", encoding="utf-8") as f:
        return {reports.from_cell(row[column]): row for row in csv.DictReader(f)}


def test_a_long_name_and_a_shared_name_are_refused_alone(tmp_path):
    lab, student = release(tmp_path)
    subs = tmp_path / "subs"
    subs.mkdir()
    right = answer(student)
    long = subs / ("L" * 252)  # 252 bytes: results/<name>.json would be over the file name limit
    long.mkdir()
    nbformat.write(right, long / "work.ipynb")
    (subs / "bob").mkdir()
    nbformat.write(right, subs / "bob" / "work.ipynb")
    (subs / "bob.ipynb").write_text("")  # an empty file named like the folder
    nbformat.write(right, subs / "carol.ipynb")
    results = grade(lab, subs, tmp_path / "out", progress=False)
    assert results["carol"].status == "graded" and results["carol"].total == 6.0
    refused = {k: r for k, r in results.items() if r.status == "invalid"}
    assert set(refused) == {"bob (folder)", "bob (file)", next(k for k in refused if "…" in k)}
    assert all("keep one" in refused[k].reason for k in ("bob (folder)", "bob (file)"))
    assert "over 200 bytes" in next(r.reason for k, r in refused.items() if "…" in k)
    book = (tmp_path / "out" / "gradebook.csv").read_text()
    assert "bob (folder)" in book and "carol" in book
    # the slice's manifest names them too: `course grade-merge` carries refusals, not drops them
    manifest = json.loads((tmp_path / "out" / "shard.json").read_text())
    assert set(refused) <= set(manifest["students"])


def test_a_name_that_is_not_utf8_is_refused_and_stops_nothing(tmp_path):
    """A file named b"\\xff\\xfe-x.ipynb" stopped the whole batch (UnicodeEncodeError while
    hashing it), and so did a file of that name inside a student's folder."""
    lab, student = release(tmp_path)
    subs = tmp_path / "subs"
    subs.mkdir()
    nbformat.write(answer(student), os.fsdecode(bytes(subs) + b"/\xff\xfe-x.ipynb"))
    (subs / "dave").mkdir()
    nbformat.write(answer(student), subs / "dave" / "work.ipynb")
    (subs / "dave" / os.fsdecode(b"\xff.png")).write_bytes(b"a figure")
    nbformat.write(answer(student), subs / "carol.ipynb")
    out = tmp_path / "out"
    results = grade(lab, subs, out, progress=False)
    assert results["carol"].total == results["dave"].total == 6.0
    refused = {k: r for k, r in results.items() if r.status == "invalid"}
    assert list(refused) == ["\\xff\\xfe-x"], refused  # shown, and written, as UTF-8
    assert "not UTF-8" in refused["\\xff\\xfe-x"].reason
    book = read_back(out / "gradebook.csv", "student")
    assert set(book) == {"carol", "dave", "\\xff\\xfe-x"}
    assert "rename" in book["\\xff\\xfe-x"]["reason"]
    assert set(read_back(out / "manual" / "why.csv", "student")) == set(book)


def test_hidden_names_are_listed_as_refused_not_skipped(tmp_path, capfd):
    """A name starting with '.' is refused with its reason in the gradebook; what tools leave
    beside the submissions (Jupyter's checkpoints) is skipped, with a note to the instructor."""
    lab, student = release(tmp_path)
    subs = tmp_path / "subs"
    subs.mkdir()
    nbformat.write(answer(student), subs / ".alice.ipynb")
    (subs / ".ipynb_checkpoints").mkdir()
    nbformat.write(answer(student), subs / ".ipynb_checkpoints" / "x-checkpoint.ipynb")
    results = grade(lab, subs, tmp_path / "out", progress=False)
    assert {k: r.status for k, r in results.items()} == {".alice": "invalid"}
    book = read_back(tmp_path / "out" / "gradebook.csv", "student")
    assert set(book) == {".alice"}
    assert "starts with '.'" in book[".alice"]["reason"]
    assert "skipped .ipynb_checkpoints (Jupyter's checkpoints" in capfd.readouterr().err


def fill(sheet, marks: dict):
    """``marks`` {student: points} written into a sheet as a spreadsheet would save it."""
    with open(sheet, newline="", encoding="utf-8") as f:
        table = list(csv.DictReader(f))
    for row in table:
        row["points"] = marks[reports.from_cell(row["student"])]
    with open(sheet, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, list(table[0]))
        w.writeheader()
        w.writerows(table)


def test_every_name_round_trips_through_slices_sheets_mark_merge_and_export(tmp_path):
    """'mallory beside mallory: the sheet reader stripped the apostrophe, so the sheets were
    refused or a marker's points went to the wrong student; a student's `bob (file).ipynb`
    took the name of the refusal of another's two `bob` submissions, and the merge failed."""
    lab, student = release(tmp_path)
    subs = tmp_path / "subs"
    subs.mkdir()
    graded = {  # name: a distinct score on the written question, given by a marker
        "'mallory": "1",
        "mallory": "0.5",
        "''=x": "0.25",
        "=x": "0.75",
        "-1": "0",
        "bob (file)": "0.125",
        " carol ": "0.375",
    }
    for name in graded:
        nbformat.write(answer(student), subs / f"{name}.ipynb")
    (subs / "bob").mkdir()
    nbformat.write(answer(student), subs / "bob" / "work.ipynb")
    nbformat.write(answer(student), subs / "bob.ipynb")
    refusals = {"bob (folder)", "bob (file) #2"}
    slices = [tmp_path / "slice1", tmp_path / "slice2"]
    for k, out in enumerate(slices, 1):
        grade(lab, subs, out, progress=False, shard=(k, 2))
        names = set(read_back(out / "gradebook.csv", "student"))
        assert names == set(read_back(out / "manual" / "why.csv", "student"))
        fill(out / "manual" / "why.csv", {n: graded.get(n, "") for n in names})
        done = course("mark", lab, out)
        assert done.returncode == 0, done.stderr
    merged = tmp_path / "merged"
    done = course("grade-merge", lab, merged, *slices)
    assert done.returncode == 0, done.stderr
    book = read_back(merged / "gradebook.csv", "student")
    assert set(book) == set(graded) | refusals
    for name, points in graded.items():
        assert float(book[name]["why (1)"]) == float(points), name
        assert float(book[name]["total"]) == 6 + float(points), name
        assert (merged / "feedback" / f"{name}.html").exists()
    assert all("keep one" in book[n]["reason"] for n in refusals)
    assert course("export", lab, merged).returncode == 0
    lms = read_back(merged / "lms.csv", "Student")
    assert {n: float(r["ps1 (7)"]) for n, r in lms.items() if n in graded} == {
        n: 6 + float(p) for n, p in graded.items()
    }


@pytest.mark.parametrize(
    "name", ["=alice", "'=alice", " carol", "carol ", "-1", "'", "''", "plain", "a\nb", "\t1"]
)
def test_every_name_reads_back_exactly_from_a_cell(name):
    assert reports.from_cell(reports.to_cell(name)) == name
    assert reports.to_cell(name)[:1] not in ("=", "+", "-", "@", "\t", "\r")  # never a formula
