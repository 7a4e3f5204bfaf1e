"""`course compare BUILD_A BUILD_B`: every findings verdict that differs between two builds.

A build is a folder of executed notebooks: `course run`'s output (build/), or the repository
itself, whose notebooks hold their recorded outputs. Notebooks are matched by their path inside
the two folders. A verdict is read from a notebook's outputs: from the JSON a displayed finding
carries beside its Markdown (``helpers.findings.MIME``), or, for a printed one, from its
sentence (the templates of helpers.findings, read back by ``parse``). Each verdict is keyed by
its kind (compare, order, fit), what it measured and the names it compares, numbered in order
where one notebook repeats a key; a comparison is then a set of relations between pairs of names,
"x ahead of y" (better, for compare(); before, in an ordering) or "not separated".

- a REVERSAL: x ahead of y in one build, y ahead of x in the other. The second run says the
  opposite of the first: an error (exit status 1).
- a WEAKENING: separated in one build, not in the other; or a fit usable in one and not in the
  other. Listed: a verdict the repeats do not carry every time.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from helpers.measure.findings import MIME

KINDS = ("compare", "order", "fit")
INSIDE = " Separated all the same, inside a group: "


@dataclass(frozen=True)
class Verdict:
    """One verdict of one notebook: its key, its relations (or a fit's word), where it was."""

    key: tuple  # (kind, what, names, occurrence)
    relations: dict  # {(x, y) sorted: (ahead, behind) or None}; a fit: {"fit": word}
    cell: int
    sentence: str


@dataclass
class Difference:
    notebook: str
    kind: str  # "REVERSAL" or "WEAKENING"
    key: tuple
    detail: str
    cells: tuple[int, int]
    sentences: tuple[str, str]


@dataclass
class Report:
    notebooks: list[str] = field(default_factory=list)
    matched: int = 0
    differences: list[Difference] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)  # "notebook: key, only in A"

    @property
    def reversals(self) -> list[Difference]:
        return [d for d in self.differences if d.kind == "REVERSAL"]


# --- reading verdicts back from sentences --------------------------------------------------


def _name(bold: bool, group: str) -> str:
    return rf"\*\*(?P<{group}>.+?)\*\*" if bold else rf"(?P<{group}>.+?)"


def _what(text: str) -> tuple[str, str]:
    """'lose (what)' -> ('lose', 'what'): the last balanced parenthesis, if any."""
    if not text.endswith(")"):
        return text, ""
    depth = 0
    for i in range(len(text) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(text[i], 0)
        if depth == 0:
            return (text[: i - 1], text[i + 1 : -1]) if text[i - 1 : i] == " " else (text, "")
    return text, ""


def _compare_sentence(line: str, bold: bool) -> dict | None:
    what_re = r"(?: \((?P<what>.*?)\))?: "
    won = re.match(
        rf"^{_name(bold, 'win')} is (?:faster|lower|higher) than "
        + (rf"\*\*(?P<lose>.+?)\*\*{what_re}" if bold else r"(?P<rest>.+?): (?P=win) "),
        line,
    )
    if won and bold:
        return _compare_record(won["what"] or "", won["win"], won["lose"], won["win"])
    if won:  # plain: "lose (what)" is split where the shown numbers name the loser
        lose, what = _what(won["rest"])
        if not re.search(rf" against {re.escape(lose)} (?:[-\d]|inf|nan)", line):
            lose, what = won["rest"], ""
        return _compare_record(what, won["win"], lose, won["win"])
    tie = re.match(
        rf"^{_name(bold, 'a')} and {_name(bold, 'b')} are indistinguishable here{what_re}", line
    )
    if tie:
        return _compare_record(tie["what"] or "", tie["a"], tie["b"], None)
    return None


def _compare_record(what: str, a: str, b: str, first: str | None) -> dict:
    return {"kind": "compare", "what": what, "names": [a, b], "first": first}


def _order_sentence(line: str, bold: bool) -> dict | None:
    body, _, inside = line.partition(INSIDE)
    strip = (lambda s: s.strip().removeprefix("**").removesuffix("**")) if bold else str.strip
    pairs = [re.split(r" (?:below|above) ", p, maxsplit=1) for p in inside.rstrip(".").split("; ")]
    inside_pairs = [[strip(x), strip(y)] for x, y in (p for p in pairs if len(p) == 2)]
    chained = re.match(r"^Ordered(?: by (?P<what>.*?))?: (?P<chain>.+?), where ≈ joins", body)
    if chained:
        chain = re.split(r" [<>] ", chained["chain"])
        groups = [[strip(n) for n in g.split(" ≈ ")] for g in chain]
        return _order_record(chained["what"] or "", groups, inside_pairs)
    flat = re.match(
        r"^No complete ordering(?: by (?P<what>.*?))? is supported here: .*? too few repeats "
        r"lie apart \((?P<listing>.*)\)\.$",
        body,
    )
    if flat:
        names = [entry.rpartition(": ")[0] for entry in flat["listing"].split("; ")]
        return _order_record(flat["what"] or "", [names], inside_pairs)
    return None


def _order_record(what: str, groups: list[list[str]], inside: list[list[str]]) -> dict:
    return {"kind": "order", "what": what, "groups": groups, "inside": inside}


def _fit_sentence(line: str, bold: bool) -> dict | None:
    found = re.match(rf"^The fit {_name(bold, 'what')} has R² = ", line)
    if not found:
        return None
    if "these points do not follow the model" in line:
        verdict = "unusable"
    elif "the model misses what it was fitted to predict" in line:
        verdict = "misses"
    else:
        verdict = "usable"
    return {"kind": "fit", "what": found["what"], "verdict": verdict}


def parse(sentence: str) -> dict | None:
    """The record of a findings sentence (printed, or its Markdown), or None for any other
    line: the inverse of helpers.findings' templates (compare, order, fit)."""
    line = re.sub(r"^\s*(?:[-*+]|\d+[.)])\s+", "", sentence).strip()  # a list's item too
    bold = "**" in line
    for read in (_compare_sentence, _order_sentence, _fit_sentence):
        record = read(line, bold)
        if record:
            return record
    return None


# --- a notebook's verdicts -------------------------------------------------------------------


def relations(record: dict) -> tuple[tuple, dict]:
    """(names, relations) of a record: the pairs it separates, each as (ahead, behind)."""
    if record["kind"] == "fit":
        return (), {"fit": record["verdict"]}
    if record["kind"] == "compare":
        a, b = record["names"]
        first = record.get("first")
        ahead = None if first is None else (first, b if first == a else a)
        return tuple(sorted((a, b))), {tuple(sorted((a, b))): ahead}
    groups, relations = record["groups"], {}
    flat = [n for g in groups for n in g]
    inside = {tuple(p) for p in record.get("inside", [])}
    for i, g in enumerate(groups):
        for j, x in enumerate(g):
            for y in g[j + 1 :]:  # same group: apart only where listed
                relations[tuple(sorted((x, y)))] = (x, y) if (x, y) in inside else None
            for later in groups[i + 1 :]:
                for y in later:
                    relations[tuple(sorted((x, y)))] = (x, y)
    return tuple(sorted(flat)), relations


def _records(cell) -> list[tuple[dict, str]]:
    """(record, sentence) of every finding in a code cell's outputs, in order."""
    found = []
    for out in cell.get("outputs", []):
        data = out.get("data", {})
        if MIME in data and data[MIME].get("kind") in KINDS:
            found.append((data[MIME], str(data.get("text/markdown", ""))))
            continue
        text = data.get("text/markdown") or data.get("text/plain") or out.get("text") or ""
        text = "".join(text) if isinstance(text, list) else str(text)
        for line in text.splitlines():
            record = parse(line)
            if record:
                found.append((record, line))
    return found


def read_verdicts(path: Path | str) -> list[Verdict]:
    """Every findings verdict in an executed notebook's outputs, keyed (see the module doc)."""
    import nbformat

    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as exc:  # not JSON, not a notebook: say which file, not a traceback
        raise ValueError(f"{path} is not a readable notebook ({exc}): run it again") from exc
    seen: Counter = Counter()
    verdicts = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for record, sentence in _records(cell):
            names, pairs = relations(record)
            base = (record["kind"], record.get("what", ""), names)
            seen[base] += 1
            verdicts.append(Verdict((*base, seen[base]), pairs, index, sentence))
    return verdicts


# --- two builds ----------------------------------------------------------------------------


def _notebooks(folder: Path) -> set[str]:
    """The notebooks under ``folder`` by relative path, hidden folders (.venv, .git) left out."""
    return {
        str(p.relative_to(folder))
        for p in folder.rglob("*.ipynb")
        if not any(part.startswith(".") for part in p.relative_to(folder).parts)
    }


def _words(key: tuple, pair: tuple) -> str:
    x, y = pair
    return f"{x} better than {y}" if key[0] == "compare" else f"{x} before {y}"


def _label(key: tuple) -> str:
    kind, what, names, occurrence = key
    shown = f"{kind} {what!r}" if what else kind
    shown += f" of {', '.join(names)}" if names else ""
    return shown + (f" (#{occurrence})" if occurrence > 1 else "")


def differences(notebook: str, a: list[Verdict], b: list[Verdict]) -> tuple[list, list, int]:
    """(differences, keys in one build only, verdicts matched) between one notebook's two
    builds."""
    by_a, by_b = {v.key: v for v in a}, {v.key: v for v in b}
    found = []
    for key in [k for k in by_a if k in by_b]:
        va, vb = by_a[key], by_b[key]
        where = ((va.cell, vb.cell), (va.sentence, vb.sentence))
        if key[0] == "fit":
            fa, fb = va.relations["fit"], vb.relations["fit"]
            if fa != fb:
                found.append(
                    Difference(notebook, "WEAKENING", key, f"{fa} in A, {fb} in B", *where)
                )
            continue
        for pair in sorted(set(va.relations) | set(vb.relations)):
            ra, rb = va.relations.get(pair), vb.relations.get(pair)
            if ra and rb and ra != rb:
                detail = f"{_words(key, ra)} in A, {_words(key, rb)} in B"
                found.append(Difference(notebook, "REVERSAL", key, detail, *where))
            elif bool(ra) != bool(rb):
                detail = (
                    f"{_words(key, ra)} in A, not separated in B"
                    if ra
                    else f"not separated in A, {_words(key, rb)} in B"
                )
                found.append(Difference(notebook, "WEAKENING", key, detail, *where))
    only = [f"{notebook}: {_label(k)}, only in A" for k in by_a if k not in by_b]
    only += [f"{notebook}: {_label(k)}, only in B" for k in by_b if k not in by_a]
    return found, only, len(set(by_a) & set(by_b))


def compare_builds(build_a: Path | str, build_b: Path | str) -> Report:
    """Every verdict that differs between the notebooks the two folders (or two notebook files)
    have in common. ValueError when there is nothing to compare, saying why."""
    a, b = Path(build_a), Path(build_b)
    for p in (a, b):
        if not p.exists():
            raise ValueError(f"{p} does not exist: give two build folders (e.g. build/ and .)")
    if a.is_file() and b.is_file():
        pairs = [(a.name, a, b)]
    elif a.is_dir() and b.is_dir():
        common = sorted(_notebooks(a) & _notebooks(b))
        if not common:
            raise ValueError(
                f"{a} and {b} have no notebook in common (matched by path inside each): "
                "give `course run`'s output folder and the repository, or two output folders"
            )
        pairs = [(rel, a / rel, b / rel) for rel in common]
    else:
        raise ValueError(f"give two folders or two notebooks, not {a} and {b}")
    report = Report()
    for rel, pa, pb in pairs:
        found, only, matched = differences(rel, read_verdicts(pa), read_verdicts(pb))
        report.notebooks.append(rel)
        report.differences += found
        report.unmatched += only
        report.matched += matched
    return report


def _short(sentence: str, width: int = 200) -> str:
    plain = sentence.replace("**", "")
    return plain if len(plain) <= width else plain[: width - 1] + "…"


def format_report(report: Report, build_a: str = "A", build_b: str = "B") -> str:
    """The report as plain text: one block per difference, reversals first, then a count."""
    lines = [f"A = {build_a}, B = {build_b}"]
    for d in sorted(report.differences, key=lambda d: (d.kind != "REVERSAL", d.notebook)):
        lines += [
            f"{d.kind}  {d.notebook}, cells {d.cells[0]} / {d.cells[1]}: {_label(d.key)}: "
            f"{d.detail}",
            f"    A: {_short(d.sentences[0])}",
            f"    B: {_short(d.sentences[1])}",
        ]
    if report.unmatched:
        lines.append(f"{len(report.unmatched)} verdicts in one build only:")
        lines += [f"    {u}" for u in report.unmatched]
    weak = len(report.differences) - len(report.reversals)
    lines.append(
        f"{len(report.notebooks)} notebooks, {report.matched} verdicts in both: "
        f"{len(report.reversals)} reversals, {weak} weakenings"
    )
    return "\n".join(lines)


def main(build_a: str, build_b: str) -> int:
    """Print the report; 1 on a reversal, 2 when there is nothing to compare, else 0."""
    import sys

    try:
        report = compare_builds(build_a, build_b)
    except ValueError as exc:
        print(f"course compare: {exc}", file=sys.stderr)
        return 2
    print(format_report(report, build_a, build_b))
    return 1 if report.reversals else 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(*sys.argv[1:3]))
