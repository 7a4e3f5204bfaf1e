"""Typed numbers against the run: a number measured on this machine is printed, never typed.

A timing typed into a Markdown cell was true of one run; the next run moves the outputs and the
sentence stays, so the notebook ends up contradicting itself. The rule (docs/writing-notebooks.md, "Writing a
notebook"): a number with a unit of measurement in Markdown (a time, a rate, a size, a
percentage, a ratio ×) must be one of

  - printed by the run: it appears among the outputs of the executed copy (counts, bytes,
    parameters: deterministic, they come back on every run);
  - a parameter: it appears in the source of a code cell of the notebook;
  - theory or a citation: in math (``$...$``), in code (backticks), in a quotation (``>``), in
    a sentence that cites (a year, "et al.", a link, the seed), or in a paragraph that starts
    with ``<!-- theory -->`` or ``<!-- cited -->``.

Anything else fails, with the cell and the number named. Say a measured result with
``helpers.findings`` in a code cell instead: its output is the sentence, rewritten by every run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

UNITS = (
    r"ms|µs|us|ns|s|min|%|×|GB/s|MB/s|GiB/s|MiB/s|Gbit/s|Gb/s|KiB|MiB|GiB|kB|KB|MB|GB|TB"
    r"|images/s|samples/s|steps/s|tokens/s|TFLOPS|GFLOPS"
)
NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?"
MEASURE = re.compile(rf"(?<![\w.$^/\\])({NUMBER})(?:\s?[–-]\s?({NUMBER}))?\s?({UNITS})(?![\w/])")
ANY_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]?\d+)?", re.I)
CITES = re.compile(
    r"et al\.|\b(?:19|20)\d\d\b|\]\(https?:|\bseeds?\b|\bpaper\b|\bposter\b|\bslides\b",
    re.I,
)
MARKED = re.compile(r"^\s*<!--\s*(theory|cited)\s*-->", re.I)
# the same quantity as the run may print it: a share as a fraction, a time in another unit, a
# size in bytes (typed = printed × scale)
SCALES = {"%": (1, 100), "s": (1, 1e-3), "ms": (1, 1e3), "µs": (1, 1e6), "us": (1, 1e6)}
SIZES = (1, 1e-3, 1e-6, 1e-9, 2**-10, 2**-20, 2**-30)
# a sentence ends at . ; ! ? before a space, but not after an abbreviation
SENTENCE_END = re.compile(r"(?<!\bal\.)(?<!e\.g\.)(?<!i\.e\.)(?<!\bvs\.)(?<!\bcf\.)(?<=[.;!?])\s+")


@dataclass
class Typed:
    cell: int
    number: str
    unit: str
    sentence: str

    def __str__(self) -> str:
        return (
            f"markdown cell {self.cell} (all cells from 0): '{self.number} {self.unit}' is "
            "typed, and neither this run's "
            f"outputs nor the code contain it (in its own unit, exactly): {self.sentence!r}. "
            "Print it from the run "
            "(helpers.findings), or mark the paragraph <!-- theory --> / <!-- cited --> "
            "if it is not a measurement of this machine."
        )


def _prose(markdown: str) -> list[str]:
    """The sentences of a Markdown cell that may carry a typed measurement."""
    kept = []
    for para in re.split(r"\n\s*\n", markdown):
        if MARKED.match(para):
            continue
        para = "\n".join(line for line in para.splitlines() if not line.lstrip().startswith(">"))
        para = re.sub(r"\$\$.*?\$\$", " ", para, flags=re.S)
        para = re.sub(r"\$[^$\n]+\$", " ", para)
        para = re.sub(r"`[^`\n]+`", " ", para)
        para = re.sub(r"<!--.*?-->", " ", para, flags=re.S)
        kept.extend(s for s in SENTENCE_END.split(para) if not CITES.search(s))
    return kept


def _text_of_outputs(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if "text" in out:
                parts.append(_join(out["text"]))
            for mime in ("text/plain", "text/markdown", "text/html"):
                if mime in out.get("data", {}):
                    parts.append(_join(out["data"][mime]))
            if out.get("output_type") == "error":
                parts.append(out.get("evalue", ""))
    return "\n".join(parts)


def _join(text) -> str:
    return text if isinstance(text, str) else "".join(text)


def _values(text: str) -> set[float]:
    values = set()
    for m in ANY_NUMBER.findall(text):
        try:
            values.add(float(m.replace(",", "")))
        except ValueError:
            pass
    return values


def _printed(number: str, unit: str, seen: set[float]) -> bool:
    """Whether ``number`` (at its typed precision) is one of ``seen``, in the unit's scales."""
    typed = float(number.replace(",", ""))
    places = len(number.split(".")[1]) if "." in number else 0
    tol = 0.5 * 10**-places + 1e-12
    scales = SIZES if unit.endswith("B") else SCALES.get(unit, (1,))
    # In its own unit the printed value must be the typed one: "1.5×" is not "printed" by a
    # 1.52 elsewhere in the outputs (a chance match passes on one run and fails on the next).
    # Converted from another unit (bytes to MiB, a fraction to %), rounding is what typing does.
    return any(
        abs(v * scale - typed) <= (1e-9 * max(1.0, abs(typed)) if scale == 1 else tol)
        for v in seen
        for scale in scales
    )


def typed_measurements(nb) -> list[Typed]:
    """Numbers with a unit in Markdown that neither the run printed nor the code sets."""
    seen = _values(_text_of_outputs(nb))
    seen |= _values("\n".join(_join(c.source) for c in nb.cells if c.cell_type == "code"))
    found = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        for sentence in _prose(_join(cell.source)):
            for low, high, unit in MEASURE.findall(sentence):
                for number in filter(None, (low, high)):
                    if not _printed(number, unit, seen):
                        found.append(Typed(index, number, unit, " ".join(sentence.split())))
    return found
