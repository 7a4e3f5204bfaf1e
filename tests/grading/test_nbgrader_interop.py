"""Our released labs are nbgrader notebooks: `nbgrader validate` reads them without complaint.

Before, our checksums were sha256 where nbgrader stores its own md5-based one, so the Validate
button students see in JupyterLab failed with "the nbgrader metadata may be corrupted".
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import lab_grading
import nbformat
import pytest

from course.release import student_version
from course.syllabus import REPO, load_syllabus

LABS = [e.path for e in load_syllabus() if e.kind == "lab"]


def validate(path, cwd):
    return subprocess.run(
        # nbgrader's default of 30 s a cell is short for a loaded CI machine (a lab's scaling
        # sweep takes about 15 s on 2 quiet cores).
        [
            sys.executable,
            "-m",
            "nbgrader",
            "validate",
            "--ExecutePreprocessor.timeout=300",
            str(path),
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


# nbgrader runs one lab end to end (issue 27: every lab is already executed by the syllabus run,
# its verdict kernel and its class grading; a fourth execution per lab cost about 6 of the
# suite's CPU minutes). Lab 05 launches ranks from graded cells, as labs 01-04 do. Every lab's
# metadata, grade ids and checksums are read by nbgrader's own validator below, without running.
EXECUTED = [p for p in LABS if p.stem == "lab05_large_batch"]


def test_every_lab_has_its_nbgrader_metadata_read_by_nbgraders_own_validator():
    from nbgrader.nbgraderformat import MetadataValidator, ValidationError
    from nbgrader.utils import compute_checksum

    validator = MetadataValidator()
    assert len(LABS) >= 6 and len(EXECUTED) == 1
    for lab in LABS:
        solution = nbformat.read(REPO / lab, as_version=4)
        student = student_version(solution)
        for nb in (solution, student):
            validator.validate_nb(nb)  # nbgrader's schema: raises on anything it cannot read
            ids = [c.metadata["nbgrader"]["grade_id"] for c in nb.cells if "nbgrader" in c.metadata]
            assert len(ids) == len(set(ids)), (lab.name, ids)
        graded = [c for c in student.cells if c.metadata.get("nbgrader", {}).get("grade")]
        assert graded, lab.name
        for cell in student.cells:
            meta = cell.metadata.get("nbgrader", {})
            if meta.get("locked") or meta.get("grade"):  # what `nbgrader validate` checks first
                assert meta["checksum"] == compute_checksum(cell), (lab.name, meta["grade_id"])
    # and the validator is not a formality: a cell nbgrader cannot read is refused
    broken = student_version(nbformat.read(REPO / LABS[0], as_version=4))
    cell = next(c for c in broken.cells if c.metadata.get("nbgrader", {}).get("grade"))
    cell.metadata["nbgrader"]["points"] = "two"
    with pytest.raises(ValidationError):
        validator.validate_nb(broken)


@pytest.mark.slow
@pytest.mark.parametrize("lab", EXECUTED, ids=[p.stem for p in EXECUTED])
def test_nbgrader_validates_the_solution_and_reads_the_student_version(lab, tmp_path):
    # nbgrader executes the whole notebook, twice here: without the ungraded timing sweeps and
    # plots (the cells each lab's class-grading test also leaves out) this took 9 of CI's minutes
    # where it took about 4, and with the class grading's smaller runs about 2. What is checked is nbgrader's reading of our metadata and of the
    # graded cells, and none of the cells left out carries any.
    module = importlib.import_module(f"test_{lab.stem.split('_')[0]}")
    (tmp_path / "solution").mkdir()
    solution = lab_grading.trimmed(REPO / lab, tmp_path / "solution", module.UNGRADED)
    # and with the class-grading test's smaller runs (fewer repeats, steps, seeds), set in a
    # cell after the parameters cell as papermill would: nbgrader has no parameters of its own
    lab_grading.override(solution, getattr(module, "FASTER", {}))
    ok = validate(solution, (REPO / lab).parent)
    assert "Success! Your notebook passes all the tests." in ok.stdout, ok.stdout + ok.stderr
    student = tmp_path / solution.name  # released here, in the lab's own folder's stead
    nbformat.write(student_version(nbformat.read(solution, as_version=4)), student)
    out = validate(student, (REPO / lab).parent)
    text = out.stdout + out.stderr
    assert "corrupted" not in text and "Traceback" not in text.split("VALIDATION FAILED")[0], text
    assert "NotImplementedError" in text  # it ran: the unanswered exercises fail their tests


def test_an_edited_locked_cell_is_caught_by_nbgrader(tmp_path):
    from nbgrader.utils import compute_checksum

    lab = LABS[0]
    student = student_version(nbformat.read(REPO / lab, as_version=4))
    locked = next(c for c in student.cells if c.metadata.get("nbgrader", {}).get("locked"))
    assert locked.metadata["nbgrader"]["checksum"] == compute_checksum(locked)
    locked.source += "\n# edited"
    assert locked.metadata["nbgrader"]["checksum"] != compute_checksum(locked)
