"""The hidden seed: inputs of hidden tests drawn anew for every grading run.

Hidden probe inputs reach the student's code (it must be called on them), so a fixed hidden case
can be printed into one run's feedback, solved offline and submitted as a table of answers the
next time. A graded test that draws its hidden cases from ``hidden_seed()`` defeats that: the
probe (in the submission's kernel) and the check (in the grader's checker) both read the seed
from the environment variable ``COURSE_HIDDEN_SEED``, which the grader sets to a new value for
every submission of every run. The check draws the cases itself and looks each one up in the
probe's data, so a kernel that changes the variable only asks itself the wrong questions.
Outside grading (JupyterLab, ``course check``, nbgrader) the variable is unset and the seed is 0:
the cases a student could see in a plain run of the solution are seed 0's.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

ENV = "COURSE_HIDDEN_SEED"


def run_seed(given: int | None = None) -> bytes:
    """The run's secret: ``given`` (to reproduce a run's verdicts), else 16 random bytes. A
    submission sees only its own seed, an HMAC of its name under this secret: it cannot work
    back to the secret, nor to another student's seed (a small ``given`` can be searched)."""
    return secrets.token_bytes(16) if given is None else str(int(given)).encode()


def for_submission(run: bytes, student: str) -> int:
    """One submission's seed: different for each student of a run, and for each run."""
    digest = hmac.new(run, student.encode(errors="surrogateescape"), hashlib.sha256).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF or 1  # never 0: 0 is the public seed
