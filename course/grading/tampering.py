"""Cells of a submission a person should read: a student's code that rebinds what the lab gave.

A locked cell is restored from the source, but the names it bound are the kernel's, and a cell
of the student's right after it can bind them again: a run helper redefined to return a
reference instead of running the student's code, a module's function patched, the profiler
hook a test watches with switched off. No test can tell such values from the student's own
(they are right values, made another way), so none of this changes a score; each is flagged,
in the gradebook's ``flags`` column and the feedback's notes, for a person to read.

Static, so not a fence: code can rebind a name in ways no parser sees (``exec`` of a string).
It catches what a student would write, and every attack of tests/grading/test_tampering.py.
Trusts: the source notebook. Does not trust: the submission's cells (parsed, never run here).
"""

from __future__ import annotations

import ast

from course.grading import cells

# Calls that rebind by name, or switch off the hook a test watches (helpers.labs.finished notes
# the course's finished functions through sys.setprofile), or watch the grader's own code run.
SUSPECT_CALLS = {
    "setattr": "setattr(...)",
    "globals": "globals()",
    "vars": "vars(...)",  # a module's dict: its names rebound by subscript, not by attribute
    "setprofile": "sys.setprofile",
    "settrace": "sys.settrace",
    "getprofile": "sys.getprofile",  # hands over the hook itself, and what its closure records
    "gettrace": "sys.gettrace",
    "_getframe": "sys._getframe",
    "addaudithook": "sys.addaudithook",
}
# Attributes that reach inside a function, a module or a running frame: the way to a hook's
# record (a closure's cells), a harness's globals, or the grader's own frames.
SUSPECT_ATTRIBUTES = {
    "__dict__", "__closure__", "__code__", "__defaults__", "__kwdefaults__", "__globals__",
    "f_locals", "f_globals", "f_back", "tb_frame", "gi_frame", "cr_frame",
}  # fmt: skip


def flags(source, assembled: list) -> list[str]:
    """One note per cell of ``assembled`` (the notebook to run, before the grading profile) that
    the student wrote (an answer or a cell of their own) and that rebinds a name a locked cell
    of ``source`` binds, assigns into an imported module, makes a SUSPECT_CALLS call or reaches
    a SUSPECT_ATTRIBUTES attribute."""
    given = locked_names(source)
    # the lab's own ungraded cells, as it ships them: what they do is the lab's, not the student's
    shipped = {c.source for c in source.cells if c.cell_type == "code" and not cells.grade_id(c)}
    modules = set()
    for cell in assembled:
        modules |= _imports(cell)
    notes = []
    for k, cell in enumerate(assembled):
        if cell.cell_type != "code" or cells.is_locked(cell) or cell.source in shipped:
            continue
        try:
            tree, ranks = _kernel_tree(cell.source)
        except SyntaxError:
            continue  # it fails as it runs; nothing in it ran to rebind anything
        what = _rebinds(tree, given) + _patches(tree, modules) + _calls(tree)
        # a %%ranks body runs on the ranks: it patches their modules, it binds no kernel name
        for body in ranks:
            what += _patches(body, modules) + _calls(body)
        if what:
            who = "your answer" if cells.grade_id(cell) else "a cell of yours"
            notes.append(
                f"code cell {_code_index(assembled, k)} ({who}) {'; '.join(what)}: a person will "
                "read it (a test relies on what the lab's locked cells define)"
            )
    return notes


def locked_names(source) -> dict[str, tuple | None]:
    """{name: how} of what the source's locked, ungraded cells bind: their helpers and data
    (how: None) and their imports (how: the import, which a student may repeat as it is),
    less what the lab's own unlocked cells bind again (a loop variable ``r`` reused: no signal
    when a student does)."""
    locked, elsewhere = {}, set()
    for cell in source.cells:
        if cell.cell_type != "code" or cells.is_graded(cell):
            continue
        try:
            bound = _bindings(ast.parse(cell.source))
        except SyntaxError:
            continue
        if cells.is_locked(cell):
            locked.update({n: how for n, how in bound.items() if not n.startswith("_")})
        elif not cells.info(cell).get("solution"):
            elsewhere |= set(bound)
    return {n: how for n, how in locked.items() if n not in elsewhere}


def _bindings(tree) -> dict[str, tuple | None]:
    """{name: how} the top level of ``tree`` binds: ("import", module, name) for an import,
    None for a definition or an assignment."""
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = None
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.update({n: None for t in targets for n in _target_names(t)})
        elif isinstance(node, ast.Import):
            for a in node.names:  # `import a.b` binds a, the same module `import a` binds
                top = a.name.split(".")[0]
                out[a.asname or top] = ("import", a.name if a.asname else top, None)
        elif isinstance(node, ast.ImportFrom):
            out.update({a.asname or a.name: ("import", node.module, a.name) for a in node.names})
    return out


def _target_names(target) -> list[str]:
    """The names an assignment target binds: ``a``, ``a, (b, *c)``; not ``m.x`` or ``d[k]``
    (those change an object; ``_patches`` looks at modules)."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for t in target.elts for n in _target_names(t)]
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    return []


def _rebinds(tree, given: dict) -> list[str]:
    """Names the cell binds that a locked cell bound, other than by the very same import."""
    again = sorted(
        n for n, how in _bindings(tree).items() if n in given and (how is None or how != given[n])
    )
    return [f"redefines {', '.join(again)}, which a locked cell defines"] if again else []


def _patches(tree, modules: set[str]) -> list[str]:
    """Assignments into a module the notebook imports (``helpers.comm.gradient_bytes = ...``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                root = t
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(t, ast.Attribute) and isinstance(root, ast.Name):
                    if root.id in modules:
                        found.append(f"assigns {ast.unparse(t)}")
    return found


def _calls(tree) -> list[str]:
    """SUSPECT_CALLS made, and SUSPECT_ATTRIBUTES reached (read or written)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if name in SUSPECT_CALLS:
                found.append(f"calls {SUSPECT_CALLS[name]}")
        elif isinstance(node, ast.Attribute) and node.attr in SUSPECT_ATTRIBUTES:
            found.append(f"reaches {node.attr}")
    return sorted(set(found))


def _kernel_tree(source: str):
    """(the tree of the code ``source`` runs in the kernel, the trees of its %%ranks bodies): a
    magic (``%%capture``, ``%time``) becomes IPython's call of it, and the code it is given is
    parsed too where it is Python, so a line starting with ``%`` hides nothing."""
    tree, ranks = ast.parse(cells.python(source)), []
    for node in list(ast.walk(tree)):
        name = getattr(node.func, "attr", None) if isinstance(node, ast.Call) else None
        if name in ("run_cell_magic", "run_line_magic"):
            args = [a.value for a in node.args if isinstance(a, ast.Constant)]
            for text in args[1:]:
                try:
                    inner, deeper = _kernel_tree(text)
                except SyntaxError:
                    continue  # an argument, not code
                if args[0] == "ranks":
                    ranks += [inner, *deeper]
                else:
                    tree.body += inner.body
                    ranks += deeper
    return tree, ranks


def _imports(cell) -> set[str]:
    """The names a code cell binds to modules by ``import`` (``import helpers.measure.comm``
    binds helpers; ``from helpers import comm`` binds comm)."""
    if cell.cell_type != "code":
        return set()
    try:
        tree = _kernel_tree(cell.source)[0]
    except SyntaxError:
        return set()
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out |= {a.asname or a.name for a in node.names}
    return out


def _code_index(nb_cells: list, k: int) -> int:
    """Cell k's place among the code cells, counted from 0 as the feedback and nbval count."""
    return sum(c.cell_type == "code" for c in nb_cells[:k])
