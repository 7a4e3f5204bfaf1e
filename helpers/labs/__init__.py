"""What the labs' graded checks compute for themselves: the references a student's answer is
compared against (one process's parameters, the expected bytes, the buckets a cap makes), one
module per lab (``helpers.labs.lab02``...).

The grader runs a test's check in a fresh interpreter of its own, apart from the student's
kernel (course/grading/verdict.py); a check imports these functions there. A reference the
student's kernel computed (a locked cell's helper included) is the student's to choose: a
student can redefine any name in the kernel. So every reference a check compares against is
computed here, by the check, from the inputs the check draws itself.
"""

import contextlib

import torch


@contextlib.contextmanager
def one_core():
    """Run a reference's small steps on one intra-op thread, as the lab's rank (one core, one
    device) runs them: on a busy grader more threads only spin, and the check's CPU seconds are
    the submission's. The caller's thread count is restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


SEED_ENV = "COURSE_HIDDEN_SEED"  # course.grading.seeds.ENV (helpers cannot import course)


def hidden_seed() -> int:
    """The run's hidden seed (course/grading/seeds.py): set by the grader anew for every
    submission, read alike by a test's probe in the student's kernel and by its check in the
    grader's own process; unset (JupyterLab, ``course check``) it is 0, the public cases."""
    import os

    raw = os.environ.get(SEED_ENV, "0")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"{SEED_ENV}={raw!r} is not an integer: unset it, or give the seed a grading "
            "result names (course grade --hidden-seed N)"
        ) from None
