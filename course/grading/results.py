"""What a grade is made of: the lab's questions, one submission's result, the limits it runs under.

Plain records shared by every step of the grader (course.grading), and the two readings of the
solution notebook they start from: its graded questions, and the blank score sheet (0 for each
automatic question, None for a written answer a person grades).
Trusts: the solution notebook (the instructor's). Nothing of a submission is read here: a
Result holds only what the grader's other steps wrote into it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from course.grading import cells


@dataclass
class Limits:
    cell_timeout: float = 120.0
    budget: float = 600.0  # wall-clock seconds per submission
    memory: int = 4 * 2**30  # bytes, the whole submission (kernel, ranks, children)
    processes: int = 128
    file_size: int = 100 * 2**20
    work_size: int = (
        2**30
    )  # bytes it may write in each of its work folder, /tmp, /var/tmp, /dev/shm
    # (each a tmpfs: the pages count in its memory, which bounds them all together)


@dataclass
class Question:
    grade_id: str
    points: float
    manual: bool  # a markdown answer: graded by a person


@dataclass
class Result:
    student: str
    status: str  # graded | invalid | timeout | memory | processes | error
    reason: str = ""
    scores: dict = field(default_factory=dict)  # grade_id -> points (None: manual)
    errors: dict = field(default_factory=dict)  # grade_id -> error text
    flags: list = field(default_factory=list)
    hidden_seed: int | None = None  # the seed its hidden cases were drawn from (grading.seeds)
    answers: dict = field(default_factory=dict)  # written question -> the student's answer
    comments: dict = field(default_factory=dict)  # question -> the grader's comment (course mark)
    # the executed notebook, in the grader's .work folder until the feedback page shows it
    # (kept there by `course grade --keep-work`, or where the run failed: "error")
    executed: str | None = None
    isolation: list = field(default_factory=list)
    seconds: float = 0.0
    key: str = ""

    @property
    def total(self) -> float:
        return round(sum(v for v in self.scores.values() if v is not None), 4)


def pending(r: Result, qs: list[Question]) -> list[str]:
    """The written questions of ``r`` that no person has marked yet."""
    return [q.grade_id for q in qs if q.manual and r.scores.get(q.grade_id) is None]


def blank_scores(qs: list[Question]) -> dict:
    """0 for every automatic question, None (a person grades it) for written answers."""
    return {q.grade_id: (None if q.manual else 0.0) for q in qs}


def questions(source) -> list[Question]:
    return [
        Question(cells.grade_id(c), float(cells.info(c)["points"]), is_answer(c))
        for c in source.cells
        if cells.is_graded(c)
    ]


def is_answer(cell) -> bool:
    """A graded cell the student writes (markdown or code): a person grades it."""
    return cell.cell_type == "markdown" or bool(cells.info(cell).get("solution"))
