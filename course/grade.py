"""`course grade LAB SUBMISSIONS [-j N]`: grade every submission, in parallel, in isolation.

The batch: the lab validated, isolation required (course.grading.isolation), this folder's
slice of the submissions, the ones already graded and unchanged skipped, the rest graded one
per slot (each slot its own uid and cores) by course.grading.runner, and the gradebook
rewritten atomically after every submission, so Ctrl-C keeps every finished grade. How one
submission is graded, and what each step trusts, is in course.grading's docstring.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import nbformat

from course.grading import cells, manual, seeds
from course.grading.isolation import (
    UID_BASE,
    Isolation,
    plan_slots,
    require,
    slot_cores,
    uid_block,
)
from course.grading.reports import write_feedback, write_gradebook
from course.grading.results import Limits, Result, blank_scores, questions
from course.grading.runner import Job, grade_one
from course.grading.shards import (
    check_shard,
    content_key,
    graded_results,
    read_manifest,
    save_result,
    submission_key,
    write_manifest,
)
from course.grading.submission import TOOL_LITTER, names, student_name


def grade(
    lab,
    submissions,
    out,
    jobs: int = 1,
    limits: Limits | None = None,
    parameters: dict | None = None,
    isolation: str = "auto",
    progress: bool = True,
    shard: tuple[int, int] | str | None = None,
    hidden_seed: int | None = None,
    keep_work: bool = False,
    replay: Path | str | None = None,
) -> dict[str, Result]:
    """Grade every entry of ``submissions`` against the solution notebook ``lab``.

    ``shard=(k, n)`` or "k/n": only the k-th of n slices (1 ≤ k ≤ n; entry i in name order
    belongs to slice i mod n + 1), for n graders on n machines; ``merge`` joins their folders.
    Hidden cases are drawn from each student's seed (course.grading.seeds): derived from the key
    stored in ``out`` (a new one where it holds none, as every real run should), or from the
    key stored in the output folder ``replay`` (the same seeds and verdicts as that run), or
    ``hidden_seed`` for every submission (the seed a result records: its verdicts again).
    ``keep_work``: keep each submission's folder in ``out``/.work (its executed notebook, as
    ``Result.executed``, and logs), to inspect one; otherwise it goes once the feedback page is
    written (a failed run's, "error", stays).

    As root each submission runs as its own uid, from a block of uids that no other grader on
    this machine holds (``uid_block``): graders started side by side never kill each other's
    kernels."""
    with uid_block(max(1, jobs)) as uid_base:  # a block for every slot asked: enough for fewer
        return _grade(
            lab,
            submissions,
            out,
            jobs,
            limits,
            parameters,
            isolation,
            progress,
            uid_base,
            shard,
            keep_work,
            hidden_seed,
            replay,
        )


def _grade(
    lab,
    submissions,
    out,
    jobs: int = 1,
    limits: Limits | None = None,
    parameters: dict | None = None,
    isolation: str = "auto",
    progress: bool = True,
    uid_base: int = UID_BASE,
    shard: tuple[int, int] | str | None = None,
    keep_work: bool = False,
    hidden_seed: int | None = None,
    replay: Path | str | None = None,
) -> dict[str, Result]:
    limits = limits or Limits()
    parameters = parameters or {}
    lab, submissions, out = Path(lab).resolve(), Path(submissions).resolve(), Path(out).resolve()
    source_bytes = lab.read_bytes()
    source = nbformat.reads(source_bytes.decode(), as_version=4)
    cells.validate(source)
    qs = questions(source)
    # a core per rank of the lab's largest world: fewer slots rather than oversubscribed ones
    jobs, _ = plan_slots(jobs, lab_world(source, parameters))
    work = _folders(out)
    iso = Isolation(isolation, uid_base)
    require(iso)
    k, n = check_shard(shard or (1, 1))
    hidden = seeds.for_run(out, hidden_seed, replay, (k, n))  # stored in out: a re-run keeps it
    entries, refused = _refuse_names(_submissions_in(submissions), qs, (k, n))
    students = [student_name(p) for p in entries] + [r.student for r in refused]
    write_manifest(out, source_bytes, (k, n), students, parameters)
    keys = [(p, submission_key(p, source_bytes, parameters, limits, iso.mode)) for p in entries]
    results, todo = _resume(out, keys)
    unwritten = {}  # what a short disk (or any write error) kept from the output folder
    for r in refused:  # graded as refused, alone: the batch goes on
        results[r.student] = r
        _keep(r, qs, out, results, unwritten)
    stop, slots = threading.Event(), _Slots(jobs)

    def task(path, key):
        with slots.take() as slot:
            job = None  # the submission's own folder in .work, cleaned once its page is written
            try:
                job = Path(tempfile.mkdtemp(prefix="sub-", dir=work))
                uid = uid_base + slot if iso.uid else None
                cpus = slot_cores(slot, jobs)
                seed = hidden.for_student(student_name(path), content_key(path))
                one = Job(path, source, qs, job, limits, iso, parameters, stop)
                one.uid, one.cpus, one.hidden_seed = uid, cpus, seed  # the slot's, the run's
                r = grade_one(one)
            except Exception as exc:  # the grader's own bug must not sink the batch either
                r = Result(
                    student_name(path),
                    "error",
                    f"grader error: {type(exc).__name__}: {exc}",
                    blank_scores(qs),
                )
        r.key = key
        if job is not None and (keep_work or r.status == "error"):
            job = None  # kept: to inspect, or a failed run's logs (runner.log) for the instructor
        if job is not None and r.status == "interrupted":  # kept nowhere: nor is its folder
            shutil.rmtree(job, ignore_errors=True)
        return r, job

    sheets = lambda: manual.write_sheets(out, source, source_bytes, qs, results)  # noqa: E731
    try:
        _run_all(
            task, todo, results, qs, out, jobs, stop, f"grading {lab.stem}", progress, unwritten
        )
    except NotWritten:  # the written answers' sheets all the same, then what was not written
        _written(sheets, "manual/ sheets", unwritten)
        raise
    if not _written(sheets, "manual/ sheets", unwritten):  # the written answers' sheets
        raise NotWritten(out, unwritten)
    return results


def mark(lab, out) -> dict[str, Result]:
    """`course mark`: merge the written answers' sheets of ``out`` (graded from ``lab``) into its
    results, gradebook and feedback pages. Every sheet is checked first; a ValueError says
    what is wrong, and then nothing has changed."""
    lab, out = Path(lab).resolve(), Path(out).resolve()
    source_bytes = lab.read_bytes()
    qs = questions(nbformat.reads(source_bytes.decode(), as_version=4))
    manifest = read_manifest(out, source_bytes, lab.name)
    if manifest.get("merged"):  # the sheets are the slices': marked there, then joined again
        raise ValueError(
            f"{out} was joined by `course grade-merge` from {len(manifest['merged'])} slices, "
            f"which hold the written answers' sheets: mark each slice (`course mark {lab.stem} "
            "SLICE`), then run the same `course grade-merge` again"
        )
    results = graded_results(out, manifest)
    manual.apply(results, manual.read_marks(out, source_bytes, qs, set(results)))
    for r in results.values():
        save_result(r, out / "results" / f"{r.student}.json")
        write_feedback(r, qs, out, again=True)
    write_gradebook(results, qs, out)
    return results


def export(lab, out, title: str | None = None) -> Path:
    """`course export`: lms.csv in ``out``, one row per student (course.grading.manual)."""
    lab, out = Path(lab).resolve(), Path(out).resolve()
    source_bytes = lab.read_bytes()
    qs = questions(nbformat.reads(source_bytes.decode(), as_version=4))
    results = graded_results(out, read_manifest(out, source_bytes, lab.name))
    return manual.export_lms(results, qs, out, title or lab.stem)


def _submissions_in(folder: Path) -> list[Path]:
    """The entries of ``folder`` in name order, without what tools leave beside submissions
    (TOOL_LITTER: Jupyter's checkpoints, macOS's .DS_Store), each skipped with a note to the
    instructor. Any other name starting with '.' is graded as refused, with the reason."""
    entries = sorted(folder.iterdir())
    for p in entries:
        if p.name in TOOL_LITTER:
            print(f"course grade: skipped {p.name} ({TOOL_LITTER[p.name]})", file=sys.stderr)
    return [p for p in entries if p.name not in TOOL_LITTER]


def _refuse_names(entries: list[Path], qs, shard) -> tuple[list[Path], list[Result]]:
    """This slice's entries whose names can be graded, and a refusal for each of the others
    (course.grading.submission.names): entry i of the whole folder, in name order, is in slice
    i mod n + 1, so a name shared across two slices is refused in both."""
    k, n = shard
    kept, refused = [], []
    for i, (path, name, why) in enumerate(names(entries)):
        if i % n != k - 1:
            continue
        if why is None:
            kept.append(path)
        else:
            refused.append(Result(name, "invalid", why, blank_scores(qs)))
    return kept, refused


def lab_world(source, parameters: dict) -> int:
    """The most ranks the lab starts at once, read from its parameters cell (``world_size``,
    ``world_sizes``, and a pipeline's ``stages``, one rank each) as overridden by
    ``parameters``; 1 where it names none."""
    import ast

    values = {}
    for cell in source.cells:
        if cell.cell_type == "code" and "parameters" in cell.get("metadata", {}).get("tags", []):
            for node in ast.parse(cell.source).body:
                if isinstance(node, ast.Assign) and len(node.targets) == 1:
                    name = getattr(node.targets[0], "id", None)
                    with contextlib.suppress(ValueError):
                        values[name] = ast.literal_eval(node.value)
    values.update(parameters)
    sizes = [values.get("world_size"), values.get("stages")] + list(values.get("world_sizes") or [])
    return max([int(n) for n in sizes if isinstance(n, int) and n > 0], default=1)


def _folders(out: Path) -> Path:
    """``out`` with its results/ folder, and its .work/ folder (the jobs'), which only the
    grader may enter; returns .work."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results").mkdir(exist_ok=True)
    work = out / ".work"
    work.mkdir(exist_ok=True)
    os.chmod(work, 0o700)
    return work


def _resume(out: Path, keys) -> tuple[dict[str, Result], list]:
    """(the saved results still valid, the (path, key) of the submissions left to grade): a
    result is kept when its key matches, i.e. nothing it was graded from has changed, and it
    is not an "error": that status is the grader's own failure (a sandbox that did not start,
    a bug), never the submission's, so a re-run grades it again instead of keeping its zeros."""
    results, todo = {}, []
    for path, key in keys:
        name = student_name(path)
        saved = out / "results" / f"{name}.json"
        if saved.exists():
            data = json.loads(saved.read_text())
            if data.get("key") == key and data.get("status") != "error":
                results[name] = Result(**data)
                continue
            # of another submission: `course mark` must not find it before the new one is saved
            saved.unlink(missing_ok=True)
        todo.append((path, key))
    return results, todo


class _Slots:
    """The batch's grading slots, 0..jobs-1: a submission is graded in a free one (the slot
    gives it its uid and cores), which is free again when it is done."""

    def __init__(self, jobs: int):
        self.free, self.lock = list(range(max(1, jobs))), threading.Lock()

    @contextlib.contextmanager
    def take(self):
        with self.lock:
            slot = self.free.pop()
        try:
            yield slot
        finally:
            with self.lock:
                self.free.append(slot)


def _run_all(
    task, todo, results, qs, out: Path, jobs: int, stop, desc: str, progress: bool, unwritten=None
):
    """Run ``task`` on every (path, key) of ``todo``, ``jobs`` at a time; each Result, once
    done, gets its feedback page and saved result, and the gradebook is rewritten. Ctrl-C sets
    ``stop`` (running submissions end as "interrupted", kept nowhere) and keeps what finished."""
    from tqdm.auto import tqdm

    bar = tqdm(total=len(todo), desc=desc, unit="sub", disable=not progress)
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    futures = [pool.submit(task, p, k) for p, k in todo]
    unwritten = {} if unwritten is None else unwritten  # what a short disk kept from `out`
    try:
        for fut in as_completed(futures):
            r, job = fut.result()
            if r.status != "interrupted":
                results[r.student] = r
                _keep(r, qs, out, results, unwritten, job)
            bar.update(1)
    except KeyboardInterrupt:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        _written(lambda: write_gradebook(results, qs, out), "gradebook.csv", unwritten)
        raise
    finally:
        pool.shutdown(wait=True)
        bar.close()
    unwritten.pop("gradebook.csv", None)  # written again now, whole: only its last try counts
    _written(lambda: write_gradebook(results, qs, out), "gradebook.csv", unwritten)
    if unwritten:
        raise NotWritten(out, unwritten)


class NotWritten(OSError):
    """Every submission was graded, but some of what grading writes could not be written."""

    def __init__(self, out: Path, unwritten: dict):
        self.unwritten = unwritten
        names = ", ".join(sorted(unwritten)[:5]) + (" ..." if len(unwritten) > 5 else "")
        why = sorted(set(unwritten.values()))[0]
        super().__init__(
            f"could not write the results of {len(unwritten)} submission(s) or report(s) to "
            f"{out} ({why}): {names}. Free space there (or choose --out elsewhere) and run the "
            "same command again: what was written is kept, the rest is graded again."
        )


def _written(write, name: str, unwritten: dict) -> bool:
    """Run ``write``; on an OSError (a full disk), note it under ``name`` and go on."""
    try:
        write()
        return True
    except OSError as exc:
        unwritten[name] = exc.strerror or type(exc).__name__
        return False


def _keep(r: Result, qs, out: Path, results: dict, unwritten: dict, job: Path | None = None):
    """A finished submission's feedback page and saved result, then the gradebook. A write that
    fails costs that submission's files alone (it is graded again next run: no saved result),
    never the batch: the others are still graded and written. ``job``: the submission's folder
    in .work, removed once the page is written (the page is what a person reads of the run;
    `course mark` writes it again from itself)."""
    ok = _written(lambda: write_feedback(r, qs, out), r.student, unwritten)
    if job is not None:
        shutil.rmtree(job, ignore_errors=True)
        r.executed = None
    if ok and _written(
        lambda: save_result(r, out / "results" / f"{r.student}.json"), r.student, unwritten
    ):
        unwritten.pop(r.student, None)
    _written(lambda: write_gradebook(results, qs, out), "gradebook.csv", unwritten)
