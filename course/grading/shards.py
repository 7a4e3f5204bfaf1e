"""An output folder's bookkeeping: the resume key, the saved results, slices and their merge.

A folder that `course grade` writes holds results/STUDENT.json (one Result each), feedback/,
gradebook.csv and MANIFEST (the lab's hash, the slice, the profile's parameters, the students
of its last run). ``submission_key`` is what a saved result must match to be kept on a re-run:
the grader's VERSION, the lab, the profile, the limits, the isolation and every byte (and file
name) of the submission. The reports of a folder (`course mark`, `course export`) read only the
results of its MANIFEST's students (``graded_results``): a student no longer graded there keeps
a saved result on disk and stays out of them. ``--shard K/N`` grades one of N slices of the
students, for N graders on N machines; ``merge`` joins their folders into one (its MANIFEST
says so: `course mark` marks the slices, not the join), and refuses anything that would make
the merged gradebook other than one run's.
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

from course.grading import seeds
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
        h.update(os.fsencode(name))  # its bytes: a name need not be UTF-8
        _hash_file(f, h)
    return h.hexdigest()


def content_key(path: Path) -> str:
    """A hash of the submission's files alone (their names and bytes): what its hidden seed
    depends on besides the run's key and the student (course.grading.seeds)."""
    h = hashlib.sha256()
    if not path.is_symlink():
        for name, f in _files(path, h):
            h.update(os.fsencode(name))
            _hash_file(f, h)
    return h.hexdigest()


def _files(path: Path, h) -> list[tuple[str, Path]]:
    """(name, path) of every regular file of a submission, sorted; a folder that cannot be
    listed (nested past the path limit, unreadable) goes into ``h`` as its error, so the key is
    stable and the batch goes on (grading then says what is wrong with it)."""
    if not path.is_dir():
        return [(path.name, path)]
    found = []
    for root, _dirs, files in os.walk(path, onerror=lambda e: h.update(_bytes(e))):
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
        h.update(_bytes(exc))


def _bytes(exc: OSError) -> bytes:
    """An error (its message may hold a file name that is not UTF-8) as bytes to hash."""
    return str(exc).encode("utf-8", "surrogatepass")


def save_result(r: Result, path: Path) -> None:
    """``r`` as JSON at ``path`` (results/STUDENT.json). Its executed notebook is not in it: the
    feedback page shows it, and `course mark` writes the page again from the page itself."""
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
    out: Path,
    source_bytes: bytes,
    shard: tuple[int, int],
    students: list[str],
    parameters: dict | None,
    merged: list[str] | None = None,
) -> None:
    """What this folder grades: the lab (by hash), the slice, the profile's ``parameters``, the
    names of its students (refused ones too, which merge must carry); ``merged``: the slices a
    `course grade-merge` joined into it."""
    manifest = {
        "lab_sha256": hashlib.sha256(source_bytes).hexdigest(),
        "shard": list(shard),
        "parameters": parameters,
        "students": list(students),
    }
    if merged:
        manifest["merged"] = merged
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))


def read_manifest(out: Path, source_bytes: bytes, lab_name: str) -> dict:
    """``out``'s MANIFEST, checked to be of this lab; a ValueError says what is wrong."""
    path = out / MANIFEST
    if not path.exists():
        raise ValueError(f"{out} is not an output folder of `course grade` (no {MANIFEST})")
    manifest = json.loads(path.read_text())
    if manifest["lab_sha256"] != hashlib.sha256(source_bytes).hexdigest():
        raise ValueError(f"{out} was graded with another version of {lab_name}")
    return manifest


def graded_results(out: Path, manifest: dict) -> dict[str, Result]:
    """The saved results of the students ``manifest`` lists (the folder's last run); one that
    has none yet (its run was interrupted) is left out, as the gradebook leaves it."""
    saved = {s: out / "results" / f"{s}.json" for s in manifest["students"]}
    return {s: _load(path) for s, path in saved.items() if path.exists()}


def _load(path: Path) -> Result:
    return Result(**json.loads(path.read_text()))


def merge(lab, shards, out) -> dict[str, Result]:
    """Join the output folders of ``course grade --shard k/n`` (k = 1..n) into one gradebook and
    one feedback folder in ``out``. Refuses slices of another lab, of another n or of another
    profile, missing or repeated slices, unfinished ones, and a student in two slices: a merged
    gradebook is whole. The slices are marked (`course mark`) before they are joined: ``out``'s
    MANIFEST names them, and `course mark` refuses it."""
    lab, out = Path(lab).resolve(), Path(out).resolve()
    source_bytes = lab.read_bytes()
    qs = questions(nbformat.reads(source_bytes.decode(), as_version=4))
    seen: dict[int, Path] = {}
    results: dict[str, Result] = {}
    pages: dict[str, Path] = {}
    n, parameters = None, None
    for folder in map(Path, shards):
        try:
            manifest = read_manifest(folder, source_bytes, lab.name)
        except ValueError as exc:
            raise ValueError(f"{exc}: grade it again") from None
        k, n_here = manifest["shard"]
        if n is not None and n_here != n:
            raise ValueError(f"{folder} is slice {k}/{n_here}; the others are slices of {n}")
        if n is not None and manifest.get("parameters") != parameters:
            raise ValueError(
                f"{folder} (slice {k}/{n}) was graded with the parameters "
                f"{manifest.get('parameters')}, the slices before it with {parameters}: grade "
                "every slice with the same --profile"
            )
        n, parameters = n_here, manifest.get("parameters")
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
            results[student] = _load(saved)
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
    slices = [str(seen[k]) for k in sorted(seen)]
    write_manifest(out, source_bytes, (1, 1), sorted(results), parameters, merged=slices)
    seeds.merge(out, {(k, n): seen[k] for k in seen})  # replayed slice by slice: --shard K/N
    return results
