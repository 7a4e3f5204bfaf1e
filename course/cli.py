"""The ``course`` command: parses arguments and calls the plain functions of this package.

Each sub-command has an ``_add_<name>`` that declares its arguments and names its handler, and a
handler ``_<name>(args) -> int`` that calls the plain function and turns its errors into an exit
status; ``main`` only parses and dispatches."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.handler(args)


def parser() -> argparse.ArgumentParser:
    """The ``course`` parser, its sub-commands in the order ``course --help`` lists them."""
    top = argparse.ArgumentParser(prog="course", description=__doc__.split("\n")[0])
    sub = top.add_subparsers(dest="command", required=True)
    for add in (_add_kernel, _add_run, _add_release, _add_grade, _add_mark, _add_export):
        add(sub)
    for add in (_add_grade_merge, _add_check, _add_record, _add_compare, _add_exchange):
        add(sub)
    _add_site(sub)
    return top


def find_lab(name: str, folder: str = "solutions"):
    """A notebook by path, or by the start of its name in ``folder`` (solutions/ or labs/) of
    the repository (e.g. lab01)."""
    from pathlib import Path

    from course.syllabus import REPO

    lab = Path(name)
    if lab.exists():
        return lab
    found = sorted((REPO / folder).rglob(f"{name}*.ipynb"))
    return found[0] if len(found) == 1 else None


def _fail(args, message: str, code: int = 2) -> int:
    """``course <command>: message`` on stderr; ``code`` back as the exit status."""
    print(f"course {args.command}: {message}", file=sys.stderr)
    return code


def _on_lab(args, work, folder: str = "solutions", errors=(ValueError, OSError)) -> int:
    """``work(lab)`` on the notebook ``args.lab`` names (see ``find_lab``), its exit status. A
    name that finds no single notebook, or one of ``errors`` raised by ``work``, fails the
    command: ``course <command>: why`` on stderr, status 2."""
    lab = find_lab(args.lab, folder)
    if lab is None:
        return _fail(args, f"{args.lab} names no single notebook in {folder}/")
    try:
        return work(lab)
    except errors as exc:
        return _fail(args, exc)


def _add_kernel(sub) -> None:
    k = sub.add_parser("kernel", help="register this environment as the Jupyter kernel")
    k.add_argument("--user", action="store_true", help="register for every Jupyter of this user")
    k.add_argument("--quiet", action="store_true")
    k.set_defaults(handler=_kernel)


def _kernel(args) -> int:
    from course.kernel import install_kernel

    install_kernel(user=args.user, quiet=args.quiet)
    return 0


def _add_run(sub) -> None:
    r = sub.add_parser("run", help="execute notebooks headless into build/ with an HTML index")
    r.add_argument("notebooks", nargs="*", help="notebooks to run (default: the whole syllabus)")
    r.add_argument("--profile", default="quick", choices=("quick", "full"))
    r.add_argument("--out", default=None, help="output folder (default: build/)")
    r.set_defaults(handler=_run)


def _run(args) -> int:
    from course.run import REPO, run_notebooks, summary

    results = run_notebooks(args.notebooks, args.profile, args.out or REPO / "build")
    print(summary(results))
    print(f"index: {(args.out or REPO / 'build')}/index.html", file=sys.stderr)
    return 0 if all(r.ok for r in results) else 1


def _add_release(sub) -> None:
    rel = sub.add_parser("release", help="write the student labs/ from solutions/")
    rel.add_argument("--solutions", default=None, help="source folder (default: solutions/)")
    rel.add_argument("--labs", default=None, help="output folder (default: labs/)")
    rel.set_defaults(handler=_release)


def _release(args) -> int:
    from course.grading.cells import FormatError
    from course.release import release_all
    from course.syllabus import REPO

    try:
        written = release_all(args.solutions or REPO / "solutions", args.labs or REPO / "labs")
    except FormatError as exc:
        return _fail(args, exc)
    for path in written:
        print(f"released {path}")
    return 0


def _add_grade(sub) -> None:
    g = sub.add_parser("grade", help="grade a folder of submissions into a gradebook and feedback")
    g.add_argument("lab", help="the solution notebook (or its name in solutions/, e.g. lab01)")
    g.add_argument("submissions", help="folder: one notebook (or one folder) per student")
    g.add_argument("-j", "--jobs", type=int, default=1, help="submissions graded at once")
    g.add_argument("--out", default=None, help="output folder (default: build/grades/<lab>)")
    g.add_argument("--profile", default="quick", choices=("quick", "full"))
    g.add_argument("--cell-timeout", type=float, default=120.0, help="seconds per cell")
    g.add_argument("--budget", type=float, default=600.0, help="seconds per submission")
    g.add_argument("--memory", default="4GiB", help="memory per submission, e.g. 4GiB")
    g.add_argument(
        "--unsafe-no-isolation",
        action="store_true",
        help="run submissions as your own user without isolation (only for code you trust; "
        "every feedback page and the gradebook say so). Without it, grading refuses to run "
        "when it cannot isolate (not root, no namespaces)",
    )
    _add_grade_seeds(g)
    g.set_defaults(handler=_grade)


def _add_grade_seeds(g) -> None:
    """`course grade`'s hidden seeds, slices and kept work."""
    g.add_argument(
        "--hidden-seed",
        type=int,
        default=None,
        metavar="N",
        help="grade every submission with COURSE_HIDDEN_SEED=N, the hidden_seed a result "
        "records (OUT/results/STUDENT.json): that result's verdicts again. Every student then "
        "gets the same hidden cases: for checking one grade, never for a class. By default each "
        "student's seed derives from a secret key, new for each --out folder and kept there "
        "(OUT/.secret/, yours alone), so a table of one run's hidden inputs is worth nothing in "
        "the next, and a re-run into the same folder keeps the same seeds",
    )
    g.add_argument(
        "--replay",
        default=None,
        metavar="OUT",
        help="grade with the key kept in OUT, the output folder of an earlier run: every "
        "student gets the seed that run gave them, and so the same verdicts. A folder of "
        "`course grade-merge` keeps each slice's key: replay a slice with --shard K/N",
    )
    g.add_argument(
        "--shard",
        default=None,
        metavar="K/N",
        help="grade only the K-th of N slices of the submissions (one per machine); join the "
        "slices' --out folders with `course grade-merge`",
    )
    g.add_argument(
        "--keep-work",
        action="store_true",
        help="keep each submission's executed notebook and logs in OUT/.work, to inspect one "
        "(by default they go once its feedback page is written)",
    )


def _grade_parameters(lab, profile: str) -> dict:
    """The syllabus's papermill parameters for ``lab`` under ``profile`` ({} if not listed)."""
    from course.syllabus import load_syllabus

    parameters = {}
    for entry in load_syllabus():
        if entry.path == lab.resolve():
            parameters = entry.parameters(profile)
    return parameters


def _grade(args) -> int:
    return _on_lab(args, lambda lab: _grade_lab(args, lab), errors=())


def _grade_lab(args, lab) -> int:
    from pathlib import Path

    from course.grade import NotWritten, grade
    from course.grading.cells import FormatError
    from course.grading.isolation import UNSAFE, IsolationUnavailable, UidsBusy
    from course.grading.results import Limits
    from course.grading.seeds import SeedError
    from course.grading.shards import check_shard
    from course.syllabus import REPO
    from helpers.measure.memory import parse_bytes  # here: other commands start without torch

    if not Path(args.submissions).is_dir():
        return _fail(args, f"{args.submissions} is not a folder of submissions")
    limits = Limits(
        cell_timeout=args.cell_timeout, budget=args.budget, memory=parse_bytes(args.memory)
    )
    out = Path(args.out) if args.out else REPO / "build" / "grades" / lab.stem
    try:
        shard = check_shard(args.shard) if args.shard else None
    except ValueError as exc:
        return _fail(args, exc)
    try:
        results = grade(
            lab,
            args.submissions,
            out,
            jobs=args.jobs,
            limits=limits,
            parameters=_grade_parameters(lab, args.profile),
            isolation=UNSAFE if args.unsafe_no_isolation else "auto",
            shard=shard,
            hidden_seed=args.hidden_seed,
            replay=args.replay,
            keep_work=args.keep_work,
        )
    # FormatError: the lab's own authoring
    except (IsolationUnavailable, FormatError, UidsBusy, SeedError) as exc:
        return _fail(args, exc)
    except KeyboardInterrupt:
        print(f"interrupted: finished grades kept in {out}/gradebook.csv", file=sys.stderr)
        return 130
    except NotWritten as exc:
        return _fail(args, exc, 1)
    return _graded(results, out)


def _add_mark(sub) -> None:
    mk = sub.add_parser(
        "mark",
        help="merge the written answers' sheets (OUT/manual/*.csv) into the grades",
        description="Merge the written answers' sheets (OUT/manual/*.csv) into the results, "
        "gradebook and feedback pages of OUT. A class graded in slices (--shard K/N): mark each "
        "slice, then join them with `course grade-merge` (a merged folder has no sheets).",
    )
    mk.add_argument("lab", help="the solution notebook the folder was graded with (e.g. lab02)")
    mk.add_argument(
        "out",
        help="the output folder of `course grade` (of each slice, for --shard: mark each slice)",
    )
    mk.set_defaults(handler=_mark)


def _mark(args) -> int:
    from course.grade import mark

    return _on_lab(args, lambda lab: _graded(mark(lab, args.out), args.out))


def _graded(results, out) -> int:
    """A graded folder's summary and where its gradebook and feedback are."""
    from course.grading.reports import summary

    print(summary(results))
    print(f"gradebook: {out}/gradebook.csv, feedback: {out}/feedback/")
    return 0


def _add_export(sub) -> None:
    ex = sub.add_parser("export", help="lms.csv: the grades, one row per student, for an LMS")
    ex.add_argument("lab", help="the solution notebook the folder was graded with")
    ex.add_argument("out", help="the output folder of `course grade` (and `course mark`)")
    ex.add_argument("--title", default=None, help="the assignment's column (default: the lab)")
    ex.set_defaults(handler=_export)


def _export(args) -> int:
    from course.grade import export

    def written(lab) -> int:
        print(f"written: {export(lab, args.out, args.title)}")
        return 0

    return _on_lab(args, written)


def _add_grade_merge(sub) -> None:
    m = sub.add_parser("grade-merge", help="join the folders of `course grade --shard K/N`")
    m.add_argument("lab", help="the solution notebook the slices were graded with")
    m.add_argument("out", help="output folder of the joined gradebook and feedback")
    m.add_argument("shards", nargs="+", help="the slices' --out folders")
    m.set_defaults(handler=_grade_merge)


def _grade_merge(args) -> int:
    from course.grading.shards import merge

    def merged(lab) -> int:
        return _graded(merge(lab, args.shards, args.out), args.out)

    return _on_lab(args, merged, errors=(ValueError,))


def _add_check(sub) -> None:
    c = sub.add_parser(
        "check", help="nbval: committed outputs of lectures and solutions still hold"
    )
    c.add_argument("notebooks", nargs="*", help="notebooks (default: the whole syllabus)")
    c.add_argument(
        "--executed",
        default=None,
        metavar="BUILD",
        help="check the copies `course run` executed into BUILD (e.g. build/) by nbval's rules "
        "instead of executing the notebooks again",
    )
    c.set_defaults(handler=_check)


def _check(args) -> int:
    from course.check import check, check_executed

    if args.executed:
        return check_executed(args.executed, args.notebooks)
    return check(args.notebooks)


def _add_record(sub) -> None:
    rec = sub.add_parser(
        "record", help="run notebooks and store their outputs in them (then commit)"
    )
    rec.add_argument("notebooks", nargs="*", help="(default with --from: the whole syllabus)")
    rec.add_argument("--profile", default="quick", choices=("quick", "full"))
    rec.add_argument(
        "--from",
        dest="build",
        metavar="BUILD",
        help="store the outputs of `course run --out BUILD` instead of running again (the "
        "same code, run to the end with --profile)",
    )
    rec.set_defaults(handler=_record)


def _record(args) -> int:
    from course.record import adopt, record
    from course.run import output_path, select
    from course.syllabus import load_syllabus

    if not args.notebooks and not args.build:
        raise SystemExit("name the notebooks to record, or --from BUILD for the whole syllabus")
    for entry in select(load_syllabus(), args.notebooks):
        if args.build:
            executed = output_path(entry.path, args.build)
            print(f"recorded {adopt(executed, entry.path, args.profile)} from {executed}")
        else:
            print(f"recorded {record(entry.path, entry.parameters(args.profile))}")
    return 0


def _add_compare(sub) -> None:
    cmp_ = sub.add_parser(
        "compare",
        help="list every findings verdict that differs between two executed builds",
        description="List every findings verdict that differs between two executed builds "
        "(folders of notebooks matched by path, e.g. build/ and . for the recorded ones): a "
        "REVERSAL (x ahead of y in one, y ahead of x in the other) exits 1; a WEAKENING "
        "(separated in one, not in the other) is listed.",
    )
    cmp_.add_argument("build_a", help="a folder of executed notebooks (or one notebook)")
    cmp_.add_argument("build_b", help="another (or the repository: its recorded notebooks)")
    cmp_.set_defaults(handler=_compare)


def _compare(args) -> int:
    from course.compare import main as compare_main

    return compare_main(args.build_a, args.build_b)


def _add_exchange(sub) -> None:
    """`course handout`, `collect` and `return` (course.exchange), each for a list of users."""
    lab_help = "the released lab (or its name in labs/, e.g. lab01)"
    h = sub.add_parser("handout", help="put a lab into each user's ~/course, as theirs")
    h.add_argument("lab", help=lab_help)
    c = sub.add_parser(
        "collect", help="take each user's ~/course/LAB.ipynb into OUT/USER/ for `course grade`"
    )
    c.add_argument("lab", help=lab_help)
    c.add_argument("out", help="the folder of submissions (then `course grade LAB OUT`)")
    r = sub.add_parser(
        "return", help="put each user's feedback page into ~/course/feedback/LAB.html"
    )
    r.add_argument("out", help="the output folder of `course grade` (its feedback/USER.html)")
    r.add_argument("--lab", default=None, help="LAB (default: the lab OUT was graded with)")
    for p, handler in ((h, _handout), (c, _collect), (r, _return)):
        p.set_defaults(handler=handler)
        who = p.add_mutually_exclusive_group(required=True)
        who.add_argument("--users", help="user names, comma-separated")
        who.add_argument("--roster", metavar="FILE", help="user names, one a line (# comments)")
        who.add_argument(
            "--hub",
            metavar="URL",
            help="the users of the JupyterHub at URL but its admins (token: $JUPYTERHUB_API_TOKEN)",
        )


def _add_site(sub) -> None:
    """`course site`: build/ as a static book (course.site)."""
    s = sub.add_parser(
        "site",
        help="build/site/: the executed course as a book (search, side bar, launch links)",
        description="Render the notebooks `course run` executed into BUILD as a static book in "
        "BUILD/site/ (Sphinx, myst-nb, sphinx-book-theme), executing nothing. Launch links "
        "default to $COURSE_REPOSITORY (or git's https origin), $COURSE_HUB_URL, $COURSE_BRANCH.",
    )
    s.add_argument("--build", default=None, help="the run's folder (default: build/)")
    s.add_argument("--repository", default=None, help="the course's public git repository URL")
    s.add_argument("--hub", default=None, help="a JupyterHub with nbgitpuller, for launch links")
    s.add_argument("--branch", default=None, help="the repository's branch (default: main)")
    s.add_argument("--binder", default=None, help="a BinderHub (default: https://mybinder.org)")
    s.set_defaults(handler=_site)


def _site(args) -> int:
    from dataclasses import replace

    from course.site import build_site, default_launch
    from course.syllabus import REPO

    given = {"repository": args.repository, "hub": args.hub, "branch": args.branch}
    given["binder"] = args.binder
    launch = replace(default_launch(), **{k: v for k, v in given.items() if v is not None})
    try:
        site = build_site(args.build or REPO / "build", launch)
    except (FileNotFoundError, RuntimeError) as exc:
        return _fail(args, exc)
    for warning in site.warnings:
        print(warning, file=sys.stderr)
    print(f"site: {site.index} in {site.seconds:.1f} s ({len(site.warnings)} Sphinx warnings)")
    if not launch.repository:
        print("no launch links: give --repository URL (and --hub URL)", file=sys.stderr)
    return 0


def _users(args) -> list[str]:
    """The users named by --users, --roster or --hub; an ExchangeError or OSError says why not."""
    import os

    from course.exchange import TOKEN_ENV, hub_accounts, read_roster

    if args.users is not None:
        return [u.strip() for u in args.users.split(",") if u.strip()]
    if args.roster is not None:
        return read_roster(args.roster)
    accounts = hub_accounts(args.hub, os.environ.get(TOKEN_ENV))
    admins = sorted(u["name"] for u in accounts if u.get("admin"))
    if admins:
        print(f"left out, as the hub's admins: {', '.join(admins)}", file=sys.stderr)
    return [u["name"] for u in accounts if not u.get("admin")]


def _exchange(args, move) -> int:
    """Run ``move(users)`` for the users ``args`` name; print a line a user. 1 if any failed."""
    from course.exchange import ExchangeError

    try:
        moved = move(_users(args))
    except (ExchangeError, OSError) as exc:
        return _fail(args, exc)
    for m in moved:
        print(m, file=sys.stdout if m.ok else sys.stderr)
    return 0 if all(m.ok for m in moved) else 1


def _handout(args) -> int:
    from course.exchange import handout

    return _on_lab(args, lambda lab: _exchange(args, lambda users: handout(lab, users)), "labs", ())


def _collect(args) -> int:
    from course.exchange import collect

    def collected(lab) -> int:
        code = _exchange(args, lambda users: collect(lab, args.out, users))
        if code != 2:
            print(f"manifest: {args.out}/collected.json; next: course grade {args.lab} {args.out}")
        return code

    return _on_lab(args, collected, "labs", ())


def _return(args) -> int:
    from course.exchange import return_feedback

    return _exchange(args, lambda users: return_feedback(args.out, users, args.lab))


if __name__ == "__main__":
    raise SystemExit(main())
