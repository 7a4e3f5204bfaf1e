"""A submission's name cannot stop the batch or take another's grade: a name too long for a
file name, and a folder beside a file of the same name, are refused alone; every name reads
back exactly from a written question's sheet."""

from __future__ import annotations

import json

import nbformat
import pytest
from grading_fixtures import answer, release

from course.grade import grade
from course.grading import manual


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


@pytest.mark.parametrize("name", ["=alice", "'=alice", " carol", "carol ", "-1", "'", "plain"])
def test_every_name_reads_back_exactly_from_a_sheet(name):
    assert manual._name(manual._cell(name)) == name
    assert manual._cell(name)[:1] not in ("=", "+", "-", "@")  # never a formula
