"""The hidden seed: inputs of hidden tests drawn anew for every grading run, and replayable.

Hidden probe inputs reach the student's code (it must be called on them), so a fixed hidden case
can be printed into one run's feedback, solved offline and submitted as a table of answers the
next time. A graded test that draws its hidden cases from the seed defeats that: the probe (in
the submission's kernel) and the check (in the grader's checker) both read it from the
environment variable ``COURSE_HIDDEN_SEED``, which the grader sets to a new value for every
submission of every run. The check draws the cases itself and looks each one up in the probe's
data, so a kernel that changes the variable only asks itself the wrong questions. Outside
grading (JupyterLab, ``course check``, nbgrader) the variable is unset and the seed is 0: the
cases a student could see in a plain run of the solution are seed 0's.

A run's seeds come from a ``Hidden``: a secret key, each student's seed an HMAC of their name
and their submission's files under it (``for_submission``), or, to reproduce one result, one seed given for every submission.
It is stored in the output folder (``KEY_FILE``, the grader's user's alone: mode 0600 in a 0700
folder; never in a feedback page, the gradebook, lms.csv or the sandbox), so that
  - a re-run into the same folder (a resumed or interrupted run) keeps the same seeds for the
    same files (a resubmission, other files, is asked new cases);
  - ``course grade --replay OUT`` grades with the key stored in OUT, giving every student the
    seed that run gave them, and so the same verdicts;
  - ``course grade-merge`` keeps each slice's key (slices are graded apart, each with its own):
    ``--replay MERGED --shard K/N`` replays slice K with it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

ENV = "COURSE_HIDDEN_SEED"
KEY_FILE = Path(".secret") / "hidden-key.json"  # under an output folder


class SeedError(ValueError):
    """The hidden seed asked for cannot be used; the message says what to do."""


def new_key() -> bytes:
    """A run's secret: 16 random bytes. A submission sees only its own seed, an HMAC of its
    name and files under this key: it cannot work back to the key, nor to another student's seed."""
    return secrets.token_bytes(16)


def for_submission(key: bytes, student: str, content: str = "") -> int:
    """One submission's seed: different for each student of a run, for each run, and for each
    ``content`` (the submission's files, ``shards.content_key``): a student who resubmits into
    the same output folder is asked new cases, not the ones the first feedback showed, while a
    replay of the same files asks the same ones."""
    message = student.encode(errors="surrogateescape") + b"\0" + content.encode()
    digest = hmac.new(key, message, hashlib.sha256).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF or 1  # never 0: 0 is the public seed


@dataclass(frozen=True)
class Hidden:
    """What one run draws its hidden cases from: a key (each student's seed derived from it),
    or one ``seed`` for every submission (to reproduce a result: the seed it records)."""

    key: bytes | None = field(default=None, repr=False)  # the secret: in no message or log
    seed: int | None = None

    def for_student(self, student: str, content: str = "") -> int:
        return self.seed if self.seed is not None else for_submission(self.key, student, content)

    def record(self) -> dict:
        return {"seed": self.seed} if self.seed is not None else {"key": self.key.hex()}

    @classmethod
    def of(cls, record: dict) -> Hidden:
        if "seed" in record:
            return cls(seed=int(record["seed"]))
        return cls(key=bytes.fromhex(record["key"]))


def check_seed(seed: int) -> int:
    """``seed`` as every submission's COURSE_HIDDEN_SEED: a result's hidden_seed, 1 to 2^31 - 1."""
    if not 0 < int(seed) < 2**31:
        raise SeedError(
            f"--hidden-seed {seed}: give the hidden_seed a result records (results/STUDENT.json), "
            "a number from 1 to 2147483647 (0 is the public seed, the cases of a plain run)"
        )
    return int(seed)


def stored(folder: Path | str, shard: tuple[int, int] = (1, 1)) -> Hidden | None:
    """The ``Hidden`` stored in an output folder (for a merged one, slice ``shard``'s), or None
    where it holds none (not an output folder, or graded before keys were stored)."""
    path = Path(folder) / KEY_FILE
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    if "slices" not in record:
        return Hidden.of(record)
    k, n = shard
    slice_ = record["slices"].get(f"{k}/{n}")
    if (k, n) == (1, 1) or slice_ is None:
        graded = ", ".join(sorted(record["slices"])) or "none"
        raise SeedError(
            f"{folder} merges slices graded each with its own key (stored for: {graded}): "
            "replay one slice at a time, with --shard K/N beside --replay"
        )
    return Hidden.of(slice_)


def save(out: Path | str, record: dict) -> None:
    """``record`` as the output folder's key file: written whole, readable by this user only."""
    folder = Path(out) / KEY_FILE.parent
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    tmp = folder / f".{KEY_FILE.name}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record))
    os.replace(tmp, Path(out) / KEY_FILE)


def for_run(
    out: Path | str,
    hidden_seed: int | None = None,
    replay: Path | str | None = None,
    shard: tuple[int, int] = (1, 1),
) -> Hidden:
    """The ``Hidden`` a run grading into ``out`` uses, stored there: ``hidden_seed`` for every
    submission, the key stored in the output folder ``replay``, or (neither given) the key
    ``out`` already holds, else a new one. A folder keeps one: what it already holds is never
    replaced, since its saved results (kept by a re-run) were graded with it."""
    if hidden_seed is not None and replay is not None:
        raise SeedError("give --hidden-seed or --replay, not both")
    here = stored(out, shard)
    if hidden_seed is not None:
        wanted = Hidden(seed=check_seed(hidden_seed))
    elif replay is not None:
        wanted = stored(replay, shard)
        if wanted is None:
            raise SeedError(
                f"{replay} holds no hidden key ({KEY_FILE}): give the output folder of a "
                "`course grade` run (one graded since keys are stored)"
            )
    else:
        wanted = here or Hidden(key=new_key())
    if here is not None and here != wanted:
        raise SeedError(
            f"{out} was graded with other hidden cases than those asked for: its saved results "
            "would mix two runs. Grade into a new --out folder (or delete this one first)"
        )
    if here is None:
        save(out, wanted.record())
    return wanted


def merge(out: Path | str, slices: dict[tuple[int, int], Path]) -> None:
    """Keep in the merged folder ``out`` the key of each slice that stored one."""
    records = {}
    for (k, n), folder in sorted(slices.items()):
        path = Path(folder) / KEY_FILE
        if path.exists():
            records[f"{k}/{n}"] = json.loads(path.read_text())
    save(out, {"slices": records})
