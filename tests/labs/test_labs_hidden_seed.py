"""helpers.labs.hidden_seed reads the seed the grader sets, as course.grading.seeds names it."""

import pytest

from course.grading import seeds
from helpers import labs


def test_it_reads_the_graders_variable(monkeypatch):
    assert labs.SEED_ENV == seeds.ENV
    monkeypatch.delenv(seeds.ENV, raising=False)
    assert labs.hidden_seed() == 0  # the public cases
    monkeypatch.setenv(seeds.ENV, "12345")
    assert labs.hidden_seed() == 12345


def test_a_seed_that_is_no_integer_says_what_to_do(monkeypatch):
    monkeypatch.setenv(seeds.ENV, "abc")
    with pytest.raises(ValueError, match="--hidden-seed"):
        labs.hidden_seed()
