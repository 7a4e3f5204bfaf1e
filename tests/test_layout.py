"""The house's rules (docs/architecture.md): imports run down the layers, never up,
with no cycle, a module over about 500 lines says why in its docstring, and no function is
over 80 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# lower number = lower layer; a module may import its own layer's package or any lower one
LAYERS = {
    "helpers.launcher": 0,
    "helpers.workloads": 0,
    "helpers.measure": 1,
    "helpers.parallel": 2,
    "helpers.optimisation": 2,  # lecture 05: large batches, beside parallel, not in it
    "helpers.plots": 3,
    "helpers.tools": 3,
    "helpers.labs": 3,  # the labs' checks: references computed apart from the kernel
    "helpers.run": 3,
    "helpers": 4,  # helpers/__init__.py: the names notebooks use
    "course": 5,
}
LONG_OK = "long because"  # what a docstring says to keep a module over the limit
LIMIT = 500
FUNCTION_LIMIT = 80  # lines of one def: past it, split it into named steps


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> tuple[str, int] | None:
    best = None
    for package, layer in LAYERS.items():
        if (module == package or module.startswith(package + ".")) and (
            best is None or len(package) > len(best[0])
        ):
            best = (package, layer)
    return best


def imports(path: Path, top_level_only: bool = False) -> set[str]:
    """Every module ``path`` imports from this repo, at any depth of the code (a lazy import
    inside a function is an import too)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m.split(".")[0] in ("helpers", "course")}


def sources() -> list[Path]:
    return sorted([*REPO.glob("helpers/**/*.py"), *REPO.glob("course/**/*.py")])


def existing(module: str) -> bool:
    base = REPO.joinpath(*module.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def test_every_module_has_a_layer():
    assert [m for p in sources() if layer_of(m := module_name(p)) is None] == []


def test_imports_run_down_the_layers_never_up():
    upward = []
    for path in sources():
        source = module_name(path)
        own_package, own = layer_of(source)
        for target in filter(existing, imports(path)):
            package, layer = layer_of(target)
            if layer > own or (layer == own and package != own_package):
                upward.append(f"{source} (layer {own}) imports {target} (layer {layer})")
    assert upward == [], "\n".join(upward)


def cycle_in(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> modules it imports at load time), or None."""
    done, stack = set(), []

    def visit(node):
        if node in stack:
            return stack[stack.index(node) :] + [node]
        if node in done:
            return None
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            # a package's __init__ importing its own submodules is how packages work
            if not nxt.startswith(node + ".") and (found := visit(nxt)):
                return found
        stack.pop()
        done.add(node)
        return None

    return next(filter(None, map(visit, sorted(graph))), None)


def test_no_import_cycle():
    graph = {
        module_name(p): {
            t for t in imports(p, top_level_only=True) if existing(t) and t != module_name(p)
        }
        for p in sources()
    }
    assert cycle_in(graph) is None
    # the check itself finds one
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(REPO)))
def test_a_long_module_says_why(path):
    lines = len(path.read_text().splitlines())
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert lines <= LIMIT or LONG_OK in doc, (
        f"{path.relative_to(REPO)} has {lines} lines: split it by job, or say in its docstring "
        f"why it is {LONG_OK} ..."
    )


def long_functions(tree: ast.AST, limit: int = FUNCTION_LIMIT) -> list[tuple[str, int]]:
    """Every def (nested ones too) of more than ``limit`` lines, with its length."""
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_function_is_over_the_limit():
    long = {
        str(p.relative_to(REPO)): found
        for p in sources()
        if (found := long_functions(ast.parse(p.read_text())))
    }
    assert not long, f"split these into named steps (at most {FUNCTION_LIMIT} lines): {long}"
    # the check itself finds one
    body = "\n".join(f"    x = {i}" for i in range(FUNCTION_LIMIT))
    assert long_functions(ast.parse(f"def f():\n{body}\n")) == [("f", FUNCTION_LIMIT + 1)]


def test_the_rules_catch_an_upward_import(tmp_path, monkeypatch):
    """The check itself: a measure module importing a parallel one is reported."""
    fake = REPO / "helpers" / "measure" / "_layout_probe.py"
    fake.write_text("from helpers.parallel import pipeline\n")
    try:
        with pytest.raises(
            AssertionError, match="_layout_probe .layer 1. imports helpers.parallel"
        ):
            test_imports_run_down_the_layers_never_up()
    finally:
        fake.unlink()
