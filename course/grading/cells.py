"""The authoring format: nbgrader cell metadata and markers, read and checked in one place.

A cell's ``metadata.nbgrader`` holds ``grade_id``, ``grade`` (a test cell that earns points),
``solution`` (the student writes here), ``locked`` (the student must not change it), ``points``
and ``schema_version``. In code, ``### BEGIN SOLUTION`` / ``### END SOLUTION`` delimit what the
student version replaces; ``### BEGIN HIDDEN TESTS`` / ``### END HIDDEN TESTS`` what it omits.

A graded test cell is split by one ``# --- check ---`` line. Above it, the *probe*: it calls the
student's code and assigns plain values (it runs in the student's kernel). Below it, the
*check*: it asserts on the names the probe assigned (when grading it runs in a fresh interpreter
of the grader's, on a copy of those values as plain data, so nothing the submission did to its
own kernel can make it pass). Each half may hold hidden tests. In JupyterLab and under nbgrader
the whole cell runs as written, probe then check.

Used by the grader (course.grading), by ``course release`` and by ``course check``. Trusts: the
solution notebook (the instructor's). Does not trust: a submission's cells, which reach it only
as data (their metadata read as a dict, their text compared by checksum; nothing is run here).
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import io
import re
import symtable
import tokenize

MARKERS = {
    "SOLUTION": ("### BEGIN SOLUTION", "### END SOLUTION"),
    "HIDDEN TESTS": ("### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"),
}


CHECK = "# --- check ---"
CONVENTION = (
    f"split it with a line '{CHECK}': above it the probe, which calls the student's code and "
    "assigns plain values (numbers, strings, lists, dicts, tensors); below it the check, which "
    "asserts on those names only (docs/writing-tests.md, 'Writing graded tests')"
)


class FormatError(ValueError):
    """The solution notebook breaks the authoring format; the message says where and how."""


def info(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {}) or {}


def grade_id(cell) -> str | None:
    return info(cell).get("grade_id")


def is_graded(cell) -> bool:
    return bool(info(cell).get("grade"))


def is_locked(cell) -> bool:
    i = info(cell)
    return bool(i.get("locked") or (i.get("grade") and not i.get("solution")))


def where(cell, index: int) -> str:
    gid = grade_id(cell)
    return f"cell {index}" + (f" ({gid})" if gid else "")


def regions(source: str, kind: str, place: str) -> list[tuple[int, int]]:
    """(begin line, end line) of every ``kind`` region; unclosed or nested markers raise."""
    begin, end = MARKERS[kind]
    out, start = [], None
    for i, line in enumerate(source.splitlines()):
        text = line.strip()
        if text == begin:
            if start is not None:
                raise FormatError(
                    f"{place}: '{begin}' on line {i + 1} inside another (line {start + 1})"
                )
            start = i
        elif text == end:
            if start is None:
                raise FormatError(f"{place}: '{end}' on line {i + 1} without a '{begin}' before it")
            out.append((start, i))
            start = None
    if start is not None:
        raise FormatError(f"{place}: '{begin}' on line {start + 1} is never closed by '{end}'")
    return out


def split_test(source: str) -> tuple[str, str]:
    """(probe, check): the lines of a graded test cell above and below its check line."""
    lines = source.splitlines()
    at = [i for i, line in enumerate(lines) if line.rstrip() == CHECK]
    if len(at) != 1:
        raise FormatError(
            f"a graded test cell needs exactly one '{CHECK}' line, found {len(at)}: {CONVENTION}"
        )
    k = at[0]
    return "\n".join(lines[:k]), "\n".join(lines[k + 1 :])


def segments(source: str) -> list[tuple[str, bool]]:
    """``source`` split into (code, hidden) pieces, in order, without the marker lines.

    Each piece runs as its own execution, so a failure is known to be in a visible or a hidden
    test without reading line numbers, and what a hidden piece printed or raised can be kept out
    of the feedback (its assertions often spell out the expected values).
    """
    lines = source.splitlines()
    out, at = [], 0
    for begin, end in regions(source, "HIDDEN TESTS", "test cell"):
        out.append(("\n".join(lines[at:begin]), False))
        out.append(("\n".join(lines[begin + 1 : end]), True))
        at = end + 1
    out.append(("\n".join(lines[at:]), False))
    return [(code, hidden) for code, hidden in out if code.strip()] or [("", False)]


def check_of(source: str) -> str:
    """The check half of a graded test cell, hidden tests included."""
    return split_test(source)[1]


def without_hidden(source: str, place: str = "test cell") -> str:
    """``source`` as released: the hidden test regions left out (line numbers not kept)."""
    lines = source.splitlines()
    for begin, end in reversed(regions(source, "HIDDEN TESTS", place)):
        del lines[begin : end + 1]
    return "\n".join(lines)


def _scopes(table):
    yield table
    for child in table.get_children():
        yield from _scopes(child)


def python(code: str) -> str:
    """``code`` as the kernel runs it: a cell magic (``%%ranks``) or a line magic becomes the
    call IPython makes of it, so a live world's cell binds and reads no kernel name."""
    if not code.lstrip().startswith("%"):
        return code
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(code)


def bound_names(code: str) -> dict[str, str]:
    """Names the top level of ``code`` binds: name -> 'assigned' | 'imported' | 'defined'."""
    out = {}
    for sym in symtable.symtable(python(code), "<cell>", "exec").get_symbols():
        if sym.is_imported():
            out[sym.get_name()] = "imported"
        elif sym.is_namespace():
            out[sym.get_name()] = "defined"
        elif sym.is_assigned():
            out[sym.get_name()] = "assigned"
    return out


def read_names(code: str) -> set[str]:
    """Global names ``code`` reads and does not bind itself (builtins left out)."""
    top = symtable.symtable(python(code), "<cell>", "exec")
    bound = set(bound_names(code))
    read = {s.get_name() for s in top.get_symbols() if s.is_referenced()}
    for scope in list(_scopes(top))[1:]:
        read |= {s.get_name() for s in scope.get_symbols() if s.is_referenced() and s.is_global()}
    return read - bound - set(dir(builtins))


def exports(source: str) -> list[str]:
    """The names a test cell's probe sends to its check: those the check reads."""
    probe, check = split_test(source)
    assigned = {n for n, how in bound_names(probe).items() if how == "assigned"}
    return sorted(read_names(check) & assigned)


def _asserts(code: str) -> list[int]:
    """Lines of ``assert`` statements and ``assert...(...)`` calls in ``code``."""
    found = []
    for node in ast.walk(ast.parse(code)):
        call = node.func if isinstance(node, ast.Call) else None
        name = getattr(call, "attr", None) or getattr(call, "id", None) or ""
        if isinstance(node, ast.Assert) or name.lower().startswith("assert"):
            found.append(node.lineno)
    return sorted(set(found))


def _reads(node, names: set[str]) -> set[str]:
    """The names of ``names`` that the expression ``node`` reads."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in names}


def _strict_zip(node) -> bool:
    return (
        isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "zip"
        and any(
            k.arg == "strict" and isinstance(k.value, ast.Constant) and k.value.value is True
            for k in node.keywords
        )
    )


def _len_asserted(tree) -> dict[str, int]:
    """name -> first line of an ``assert`` whose test takes ``len(name)``."""
    out: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            for call in ast.walk(node.test):
                if (
                    isinstance(call, ast.Call)
                    and getattr(call.func, "id", None) == "len"
                    and call.args
                    and isinstance(call.args[0], ast.Name)
                ):
                    out.setdefault(call.args[0].id, node.lineno)
    return out


def probe_loops(check: str, probed: set[str]) -> list[tuple[int, str]]:
    """(line, why) of every place where ``check`` lets the probe's data decide how many cases it
    checks: a ``for`` loop, ``all(...)`` or ``any(...)`` over a probed value (sent empty, it
    checks nothing and passes) whose length the check has not asserted before, or a ``zip``
    without ``strict=True`` (a short list ends it early). The ways that hold: loop over the
    check's own cases (zipped with the answers by ``zip(cases, answers, strict=True)``), assert
    ``len(answers)`` first, or compare whole values."""
    tree = ast.parse(check)
    sized = _len_asserted(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "zip":
            if not _strict_zip(node):
                found.append((node.lineno, "zip(...) without strict=True"))
        iters = []
        if isinstance(node, (ast.For, ast.AsyncFor)):
            iters = [node.iter]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("all", "any"):
            arg = node.args[0] if node.args else None
            gens = arg.generators if isinstance(arg, (ast.GeneratorExp, ast.ListComp)) else []
            iters = [g.iter for g in gens] or ([arg] if arg is not None else [])
        for it in iters:
            names = {n for n in _reads(it, probed) if sized.get(n, it.lineno + 1) > it.lineno}
            own = _strict_zip(it) and any(not _reads(a, probed) for a in it.args)
            if names and not own:
                found.append((it.lineno, f"a loop over {', '.join(sorted(names))}"))
    return sorted(set(found))


def _changed_names(code: str) -> set[str]:
    """Names ``code`` binds or changes in place (``d.update(...)``, ``d[k] = v``, ``x += 1``)."""
    out = set(bound_names(code))
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if isinstance(node.func.value, ast.Name):
                out.add(node.func.value.id)
        targets = node.targets if isinstance(node, ast.Assign) else []
        targets = targets + ([node.target] if isinstance(node, ast.AugAssign) else [])
        for t in targets:
            if isinstance(t, (ast.Subscript, ast.Attribute)) and isinstance(t.value, ast.Name):
                out.add(t.value.id)
    return out


def _names(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} if node else set()


def _tainted(tree, changed: set[str]) -> set[str]:
    """``changed`` and every name that takes a value from one of them (assigned from it, or a
    loop variable over it), to a fixed point."""
    tainted = set(changed)
    while True:
        before = len(tainted)
        for node in ast.walk(tree):
            if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                source, targets = node.iter, [node.target]
            elif isinstance(node, ast.Assign):
                source, targets = node.value, node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.NamedExpr)):
                source, targets = node.value, [node.target]
            else:
                continue
            if _names(source) & tainted:
                for t in targets:
                    tainted |= _names(t)
        if len(tainted) == before:
            return tainted


def _shown(tree) -> set[str]:
    """Names whose values a piece of a check can put in the feedback: in an assertion's
    message, a print, an f-string, or a raised exception."""
    shown = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            shown |= _names(node.msg)
        elif isinstance(node, ast.Raise):
            shown |= _names(node.exc)
        elif isinstance(node, ast.JoinedStr):
            shown |= _names(node)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
            shown |= set().union(*map(_names, node.args)) if node.args else set()
    return shown


def hidden_leaks(check: str) -> list[str]:
    """Names whose values a visible part of ``check`` can show after a hidden part set or
    changed them (directly, or through a loop variable or an assignment): a visible part's
    messages reach the feedback, and would show the hidden expectations."""
    changed, leaks = set(), set()
    for code, hidden in segments(check):
        tree = ast.parse(code)
        if hidden:
            changed |= _changed_names(code)
        elif changed:
            leaks |= _shown(tree) & _tainted(tree, changed)
    return sorted(leaks)


SEED = "COURSE_HIDDEN_SEED"  # course.grading.seeds.ENV: the run's seed, in kernel and checker
FIXED = "# hidden inputs fixed:"  # a hidden probe's reason for inputs that are not drawn


def _mentions_seed(code: str) -> bool:
    """Whether ``code`` names the seed in code (a string or a name), not only in a comment, or
    reads it through ``helpers.labs.hidden_seed()``."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(code).readline))
    except (tokenize.TokenError, SyntaxError):
        return False  # not Python: the checks after this one say where
    code_tokens = [t for t in tokens if t.type != tokenize.COMMENT]
    named = any(SEED in t.string for t in code_tokens)
    called = any(
        a.string == "hidden_seed" and b.string == "("
        for a, b in zip(code_tokens, code_tokens[1:], strict=False)
    )
    return named or called


def check_hidden_draws(probe: str, place: str) -> None:
    """The hidden part of a probe draws its inputs from the run's seed (it names SEED in code),
    or says in a comment line ``# hidden inputs fixed: <why>`` why its inputs cannot be drawn.
    Hidden inputs reach the student's code, so fixed ones can be printed into one run's
    feedback and answered as a table in the next (docs/writing-tests.md, 'Hidden cases drawn anew every run')."""
    hidden = "\n".join(code for code, is_hidden in segments(probe) if is_hidden)
    if not hidden.strip() or _mentions_seed(hidden):
        return
    reasons = [
        line.strip()[len(FIXED) :].strip()
        for line in hidden.splitlines()
        if line.strip().startswith(FIXED)
    ]
    if reasons and all(reasons):
        return
    todo = (
        f"draw them from the run's seed ({SEED}), random.Random(helpers.labs.hidden_seed()), "
        "in the probe and again in the check (docs/writing-tests.md, 'Hidden cases drawn anew every run'), "
        "so that a table of one run's inputs fails the next; where they cannot be drawn (a run "
        f"on ranks), say why in the hidden part, in a comment line '{FIXED} <why>'"
    )
    if reasons:
        raise FormatError(f"{place}: '{FIXED}' in the hidden probe gives no reason: {todo}")
    raise FormatError(
        f"{place}: the hidden probe's inputs are fixed (its text does not name {SEED} in "
        f"code): they reach the student's code, and can be printed into the feedback: {todo}"
    )


def validate_test(source: str, place: str) -> None:
    """A graded test cell follows the probe/check convention, as written and as released."""
    for begin, end in regions(source, "HIDDEN TESTS", place):
        if any(line.rstrip() == CHECK for line in source.splitlines()[begin : end + 1]):
            raise FormatError(f"{place}: '{CHECK}' inside hidden tests: put it between them")
    try:
        probe, check = split_test(source)
    except FormatError as exc:
        raise FormatError(f"{place}: {exc}") from None
    for version, text in (("", source), (" (as released, hidden tests left out)", None)):
        if text is None:
            probe, check = split_test(without_hidden(source, place))
        try:
            lines = _asserts(probe)
            bound, read = bound_names(probe), read_names(check)
        except SyntaxError as exc:
            raise FormatError(
                f"{place}: a graded test cell must be plain Python (line {exc.lineno}: {exc.msg})"
            ) from None
        if lines:
            raise FormatError(
                f"{place}: the probe asserts on line {lines[0]}: move every assertion below "
                f"'{CHECK}' (in the probe it would run in the student's kernel, where it can be "
                "forged, and show its expected values to the submission)"
            )
        if read - set(bound):
            raise FormatError(
                f"{place}: the check reads {', '.join(sorted(read - set(bound)))}{version}, "
                "which its probe does not assign: the check runs apart from the student's kernel "
                "and sees only the plain values the probe assigns (call the student's code in "
                "the probe and assign the results; import modules and define helpers in the check)"
            )
        code = sorted(n for n in read if bound[n] != "assigned")
        if code:
            raise FormatError(
                f"{place}: the check reads {', '.join(code)}, which the probe imports or defines: "
                "only plain values cross to the check; import or define it in the check"
            )
        loops = probe_loops(check, read & set(bound))
        if loops:
            line, why = loops[0]
            raise FormatError(
                f"{place}: check line {line}: {why}{version}. The probe's values are the "
                "submission's to choose: sent empty or short, such a check tests nothing and "
                "passes. Loop over the cases the check itself lists, zipped with the answers "
                "by zip(cases, answers, strict=True), or compare whole values"
            )
    leaks = hidden_leaks(check_of(source))
    if leaks:
        raise FormatError(
            f"{place}: a visible part of the check can show {', '.join(leaks)}, which a hidden "
            "part set or changed: a visible part's messages reach the feedback, and would show "
            "the hidden expectations. Check the hidden cases inside the hidden part"
        )
    check_hidden_draws(split_test(source)[0], place)


def validate(nb) -> None:
    """Check the whole notebook: unique grade_ids, points on graded cells, closed markers."""
    seen: dict[str, int] = {}
    tagged = 0
    for index, cell in enumerate(nb.cells):
        place = where(cell, index)
        i = info(cell)
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            tagged += 1
        if i:
            gid = i.get("grade_id")
            if not gid:
                raise FormatError(f"{place}: nbgrader metadata without a grade_id")
            if not re.fullmatch(r"[A-Za-z0-9_\-]+", gid):
                raise FormatError(
                    f"{place}: grade_id {gid!r} may use letters, digits, _ and - only"
                )
            if gid in seen:
                raise FormatError(f"{place}: grade_id {gid!r} is already used by cell {seen[gid]}")
            seen[gid] = index
            if i.get("grade") and not isinstance(i.get("points"), (int, float)):
                raise FormatError(f"{place}: a graded cell needs points (metadata.nbgrader.points)")
        if cell.cell_type == "code":
            for kind in MARKERS:
                regions(cell.source, kind, place)
            if i.get("grade") and not i.get("solution"):
                validate_test(cell.source, place)
    if tagged > 1:
        raise FormatError(f"{tagged} cells are tagged 'parameters'; papermill needs exactly one")


def nbgrader_checksum(cell) -> str:
    """The checksum nbgrader itself stores and checks (nbgrader.utils.compute_checksum, 0.9):
    md5 of the source, the type, nbgrader's grade/solution/locked flags, the grade_id and the
    points. Written exactly so ``nbgrader validate`` and the Validate button accept our labs;
    recomputed here so releasing a lab does not need nbgrader installed."""
    i = info(cell)
    grade, solution = bool(i.get("grade", False)), bool(i.get("solution", False))
    locked = False if solution else (True if grade else bool(i.get("locked", False)))
    m = hashlib.md5()
    for part in (
        cell.source,
        cell.cell_type,
        str(i.get("grade", False)),
        str(i.get("solution", False)),
    ):
        m.update(part.encode("utf-8"))
    m.update(str(locked).encode("utf-8"))
    m.update(i["grade_id"].encode("utf-8"))
    if grade:
        m.update(str(float(i["points"])).encode("utf-8"))
    return m.hexdigest()


def checksum(cell) -> str:
    """What a locked cell must keep: its type and source (whitespace at line ends ignored)."""
    source = "\n".join(line.rstrip() for line in cell.source.strip().splitlines())
    return hashlib.sha256(f"{cell.cell_type}\n{source}".encode()).hexdigest()
