"""Fixtures the exchange tests share (test_exchange.py, test_exchange_redteam.py)."""

from __future__ import annotations

import nbformat
import pytest
from grading_fixtures import release


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """(the tiny lab's solution, its released version labs/ps1.ipynb, the student notebook)."""
    root = tmp_path_factory.mktemp("exchange-lab")
    src, student = release(root)
    released = root / "labs" / "ps1.ipynb"
    released.parent.mkdir()
    nbformat.write(student, released)
    return src, released, student
