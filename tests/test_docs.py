"""The documentation keeps up with the code: the README stays short, every relative link of the
README and docs/ leads to a file, and docs/architecture.md's module map and layer table name
what exists (every module of helpers/ and course/, the layers of tests/test_layout.py).

The module map's format: a list item that starts with a backticked import name,
``- `helpers.launcher.launch`: what it holds``; a package's ``__init__.py`` is its package's
name, ``__main__.py`` is ``package.__main__``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
ARCHITECTURE = DOCS / "architecture.md"
README_MAX_LINES = 200

MAP_ENTRY = re.compile(r"^- `((?:helpers|course)(?:\.\w+)*)`", re.MULTILINE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
LAYER_ROW = re.compile(r"^\| (\d+) \| (.+?) \|", re.MULTILINE)


def modules_on_disk() -> set[str]:
    """Every .py file of helpers/ and course/ as an import name (``__init__`` as its package)."""
    names = set()
    for path in [*REPO.glob("helpers/**/*.py"), *REPO.glob("course/**/*.py")]:
        parts = path.relative_to(REPO).with_suffix("").parts
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def modules_in_map(text: str) -> list[str]:
    return MAP_ENTRY.findall(text)


def relative_links(page: Path) -> list[tuple[str, Path]]:
    """(link, the file it points to) for every link of ``page`` that is not a URL nor an anchor
    in the page itself; links inside fenced code blocks are code, not links."""
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    found = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:|#", target):
            continue
        found.append((target, (page.parent / target.split("#")[0]).resolve()))
    return found


def layers_in_table(text: str) -> dict[str, int]:
    """{package: layer} from the table of docs/architecture.md: each row's backticked names."""
    table = {}
    for layer, packages in LAYER_ROW.findall(text):
        # the cell's backticked names are its packages; a parenthesis after them only says
        # what they hold
        for name in re.findall(r"`([\w.]+)`", packages.split("(")[0]):
            table[name] = int(layer)
    return table


def layers_in_test_layout() -> dict[str, int]:
    tree = ast.parse((REPO / "tests" / "test_layout.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "LAYERS" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError("tests/test_layout.py defines no LAYERS")


def test_the_readme_is_short():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move a topic to a page of "
        "docs/ and leave a link"
    )


def test_the_module_map_names_every_module_and_no_gone_one():
    listed = modules_in_map(ARCHITECTURE.read_text(encoding="utf-8"))
    on_disk = modules_on_disk()
    missing = sorted(on_disk - set(listed))
    gone = sorted(set(listed) - on_disk)
    twice = sorted({m for m in listed if listed.count(m) > 1})
    assert (missing, gone, twice) == ([], [], []), (
        f"docs/architecture.md's module map: add {missing}, remove {gone} (no such file), "
        f"list once {twice}"
    )


def test_the_map_reader_sees_what_it_should(tmp_path):
    """The check itself: entries are list items opening with a backticked import name; a name
    in running text is not an entry."""
    text = "- `helpers.launcher.launch`: runs ranks\n  - `helpers.x` nested\nsee `course.cli`\n"
    assert modules_in_map(text) == ["helpers.launcher.launch"]


def test_every_relative_link_leads_to_a_file():
    broken = [
        f"{page.relative_to(REPO)}: ({target})"
        for page in [README, *sorted(DOCS.glob("*.md"))]
        for target, path in relative_links(page)
        if not path.exists()
    ]
    assert broken == [], "links to no file:\n" + "\n".join(broken)


def test_the_link_reader_skips_urls_anchors_and_code(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "[a](b.md) [u](https://x.org/y.md) [h](#top) [s](c.md#part)\n```\n[no](d.md)\n```\n"
    )
    assert [t for t, _ in relative_links(page)] == ["b.md", "c.md#part"]


def test_the_layer_table_is_test_layouts():
    assert layers_in_table(ARCHITECTURE.read_text(encoding="utf-8")) == layers_in_test_layout()


HELPERS_IMPORT = re.compile(r"^\s*(?:from|import) (helpers(?:\.\w+)+)", re.MULTILINE)


def helpers_imports() -> dict[str, set[str]]:
    """Every ``from helpers.x.y import`` / ``import helpers.x.y`` module path in the course's
    notebooks, code and docs, with the files that write it."""
    import json

    found: dict[str, set[str]] = {}
    files = [*REPO.glob("*/*.ipynb"), *REPO.glob("[hct]*/**/*.py"), *REPO.glob("benchmarks/*.py")]
    files += [*DOCS.glob("*.md"), README]
    for path in files:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".ipynb":
            cells = json.loads(text)["cells"]
            text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        for name in HELPERS_IMPORT.findall(text):
            found.setdefault(name, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_helpers_import_names_a_real_module():
    """No notebook, test or page imports a module path that does not exist: the flat aliases
    (``from helpers.memory import``) are gone, and ``helpers.memory`` is only an attribute."""
    import importlib.util

    imports = helpers_imports()
    assert "helpers.launcher.world" in imports  # the scan reads what it should
    missing = {}
    for name, where in imports.items():
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            missing[name] = sorted(where)
    assert not missing, f"import the module's real path (helpers.<subsystem>.<module>): {missing}"


def test_the_helpers_page_names_files_that_exist():
    """docs/helpers.md's measuring table names each call's file under helpers/."""
    text = (DOCS / "helpers.md").read_text(encoding="utf-8")
    named = re.findall(
        r"`((?:launcher|workloads|measure|parallel|optimisation|tools|plots|labs)/\w*\.py)`", text
    )
    assert named, "docs/helpers.md names no module file"
    assert [n for n in named if not (REPO / "helpers" / n).exists()] == []
