"""An output folder's bookkeeping: the resume key, the saved results, slices and their merge.

A folder that `course grade` writes holds results/STUDENT.json (one Result each), feedback/,
gradebook.csv and MANIFEST (the lab's hash, the slice, its students). ``submission_key`` is what
a saved result must match to be kept on a re-run: the grader's VERSION, the lab, the profile,
the limits, the isolation and every byte of the submission. ``--shard K/N`` grades one of N
slices of the students, for N graders on N machines; ``merge`` joins their folders into one,
and refuses anything that would make the merged gradebook other than one run's.
Trusts: the lab, and the folders the instructor names (results written by this grader). Does
not trust: the submission, which is hashed here, never followed through a link.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

import nbformat

from course.grading.reports import write_gradebook
from course.grading.results import Limits, Result, questions
from course.grading.submission import MAX_SUBMISSION

VERSION = "6"  # part of the resume key: bump when scoring, isolation or what a result holds changes
MANIFEST = "shard.json"


def submission_key(
    path: Path, source_bytes: bytes, parameters: dict, limits: Limits, isolation: str = "auto"
) -> str:
    h = hashlib.sha256(
        VERSION.encode() + source_bytes + json.dumps(parameters, sort_keys=True).encode()
    )
    h.update(json.dumps(limits.__dict__, sort_keys=True).encode() + isolation.encode())
    if path.is_symlink():  # refused when graded; never read through here
        return h.hexdigest()
    for name, f in _files(path, h):
        h.update(name.encode())
        _hash_file(f, h)
    return h.hexdigest()


def _files(path: Path, h) -> list[tuple[str, Path]]:
    """(name, path) of every regular file of a submission, sorted; a folder that cannot be
    listed (nested past the path limit, unreadable) goes into ``h`` as its error, so the key is
    stable and the batch goes on (grading then says what is wrong with it)."""
    if not path.is_dir():
        return [(path.name, path)]
    found = []
    for root, _dirs, files in os.walk(path, onerror=lambda e: h.update(f"{e}".encode())):
        for name in files:
            f = Path(root, name)
            found.append((str(f.relative_to(path)), f))
    return sorted(found)


def _hash_file(f: Path, h) -> None:
    """A file's bytes into ``h``, streamed; one over MAX_SUBMISSION (never graded: a notebook
    that large is refused) by its size and time only, so a 1 TiB sparse file costs nothing."""
    try:
        st = f.lstat()
        if not stat.S_ISREG(st.st_mode):
            h.update(b"not a regular file")
            return
        if st.st_size > MAX_SUBMISSION:
            h.update(f"{st.st_size} {st.st_mtime_ns}".encode())
            return
        with open(f, "rb") as stream:
            while chunk := stream.read(1 << 20):
                h.update(chunk)
    except OSError as exc:
        h.update(f"{exc}".encode())


def save_result(r: Result, path: Path) -> None:
    """``r`` as JSON at ``path`` (results/STUDENT.json); its executed notebook stays where it
    is (the job's folder under .work), named, for `course mark` to write the feedback again."""
    saved = dict(r.__dict__)
    tmp = path.with_name(f".{path.name}.tmp")  # whole or not at all: a resume reads it back
    try:
        tmp.write_text(json.dumps(saved))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def check_shard(shard) -> tuple[int, int]:
    """(k, n) from (k, n) or 'k/n', checked: 1 ≤ k ≤ n."""
    if isinstance(shard, str):
        parts = shard.split("/")
        if len(parts) != 2 or not all(x.strip().isdigit() for x in parts):
            raise ValueError(f"--shard takes K/N, e.g. 2/4 (the 2nd of 4 slices), not {shard!r}")
        shard = tuple(int(x) for x in parts)
    k, n = shard
    if not 1 <= k <= n:
        raise ValueError(f"shard {k}/{n}: K must be between 1 and N")
    return k, n


def write_manifest(
    out: Path, source_bytes: bytes, shard: tuple[int, int], entries, refused=()
) -> None:
    """What this folder grades: the lab (by hash), the slice, the students in it (``refused``:
    the names of submissions refused by their name, which merge must carry too)."""
    manifest = {
        "lab_sha256": hashlib.sha256(source_bytes).hexdigest(),
        "shard": list(shard),
        "students": [p.stem if p.is_file() else p.name for p in entries] + list(refused),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))


def merge(lab, shards, out) -> dict[str, Result]:
    """Join the output folders of ``course grade --shard k/n`` (k = 1..n) into one gradebook and
    one feedback folder in ``out``. Refuses slices of another lab or of another n, missing or
    repeated slices, unfinished ones, and a student in two slices: a merged gradebook is whole."""
    lab, out = Path(lab).resolve(), Path(out).resolve()
    source_bytes = lab.read_bytes()
    qs = questions(nbformat.reads(source_bytes.decode(), as_version=4))
    digest = hashlib.sha256(source_bytes).hexdigest()
    seen: dict[int, Path] = {}
    results: dict[str, Result] = {}
    pages: dict[str, Path] = {}
    n = None
    for folder in map(Path, shards):
        path = folder / MANIFEST
        if not path.exists():
            raise ValueError(f"{folder} is not an output folder of `course grade` (no {MANIFEST})")
        manifest = json.loads(path.read_text())
        k, n_here = manifest["shard"]
        if manifest["lab_sha256"] != digest:
            raise ValueError(f"{folder} was graded with another version of {lab.name}: re-grade it")
        if n is not None and n_here != n:
            raise ValueError(f"{folder} is slice {k}/{n_here}; the others are slices of {n}")
        n = n_here
        if k in seen:
            raise ValueError(f"slice {k}/{n} is given twice: {seen[k]} and {folder}")
        seen[k] = folder
        for student in manifest["students"]:
            saved = folder / "results" / f"{student}.json"
            if not saved.exists():
                raise ValueError(
                    f"{folder}: {student} has no result (its grader was interrupted): run the same "
                    "`course grade --shard` again, it grades only what is missing"
                )
            if student in results:
                raise ValueError(f"{student} was graded in two slices, {folder} and another")
            results[student] = Result(**json.loads(saved.read_text()))
            pages[student] = folder / "feedback" / f"{student}.html"
    missing = sorted(set(range(1, (n or 0) + 1)) - set(seen))
    if missing:
        raise ValueError(f"slices {', '.join(f'{k}/{n}' for k in missing)} are missing")
    (out / "results").mkdir(parents=True, exist_ok=True)
    (out / "feedback").mkdir(exist_ok=True)
    for student, r in results.items():
        save_result(r, out / "results" / f"{student}.json")
        if pages[student].exists():
            shutil.copy(pages[student], out / "feedback" / pages[student].name)
    write_gradebook(results, qs, out)
    return results
