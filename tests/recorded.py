"""What a committed notebook printed: its code cells' outputs as one text (plain text, Markdown
and streams), for the tests that check a notebook's recorded figures and sentences."""

from __future__ import annotations

import nbformat


def outputs(nb) -> str:
    """Every code cell's outputs of ``nb`` (a notebook or a path to one), joined."""
    if not isinstance(nb, nbformat.NotebookNode):
        nb = nbformat.read(nb, as_version=4)
    return "\n".join(
        str(o.get("data", {}).get("text/plain", ""))
        + str(o.get("data", {}).get("text/markdown", ""))
        + str(o.get("text", ""))
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
    )
