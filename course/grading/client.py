"""The sandbox's notebook client: what a submission's kernel may send back, capped and filtered.

course.grading.sandbox runs a submission's notebook with nbclient's NotebookClient and this
module's ``Guarded`` mixed in: every message from the kernel is the submission's to forge, so
outputs are counted against per-cell and per-notebook caps as they arrive, a probe's published
values are taken aside, and malformed messages are dropped. ``bounded`` is the backstop on the
executed notebook before it leaves the sandbox. Imports no nbclient at module level (the
sandbox's ``--probe`` path never pays for it)."""

from __future__ import annotations

import json
import os

from course.grading.plain import MAX_BYTES, MIME

OUTPUT_LIMIT = 100_000  # bytes of output kept per cell; the rest is dropped with a note
FIGURE_LIMIT = 1_000_000  # bytes of figures (base64 PNG) kept per cell
SUBMISSION_OUTPUT_LIMIT = 8_000_000  # bytes of output kept for the whole notebook, figures too


class Guarded:
    """What the sandbox's notebook client adds to nbclient's NotebookClient: the output caps,
    the message filter, the connection file's place. A mixin, so that nbclient is imported only
    when a notebook runs (course.grading.sandbox makes the class); ``super()`` here is
    NotebookClient's."""

    published = None  # a list while a probe's values are being read back
    timed_out = False  # set when a cell reached its time limit and was interrupted
    total_bytes = 0  # output kept, all cells
    whole_noted = False  # the notebook's cap was reached and said
    cell_bytes: dict  # output received, per cell index
    noted: set  # the cells (and the notebook) whose cut has been said
    work_folder: str  # the job's work folder, the kernel's cwd

    async def _async_handle_timeout(self, timeout, cell=None):
        self.timed_out = True
        return await super()._async_handle_timeout(timeout, cell)

    def output(self, outs, msg, display_id, cell_index):
        import nbformat

        data = msg.get("content", {}).get("data") or {}
        if msg.get("msg_type") in ("display_data", "execute_result") and MIME in data:
            text = data[MIME]  # capped here: the kernel's own cap could be patched away
            if self.published is not None and isinstance(text, str) and len(text) <= MAX_BYTES:
                self.published.append(text)
            return None  # never an output of the notebook
        # Bounded here, in the runner (the kernel's own limits could be patched away): each
        # message is counted as it arrives, against the cell's and the submission's caps,
        # and what would go over is cut (a stream keeps its start) with one note per cell.
        content = msg.get("content", {})
        incoming = len(json.dumps(content))
        # A figure (a PNG, as the inline backend shows plt.show()) has a budget of its own:
        # the questions ask about the student's plots, and one is ~50-150 kB of base64.
        figure = msg.get("msg_type") in ("display_data", "execute_result") and isinstance(
            data.get("image/png"), str
        )
        key, limit = (
            ((cell_index, "figures"), FIGURE_LIMIT) if figure else (cell_index, OUTPUT_LIMIT)
        )
        used = self.cell_bytes.get(key, 0)
        room = min(limit - used, SUBMISSION_OUTPUT_LIMIT - self.total_bytes)
        if incoming <= room:
            self.cell_bytes[key] = used + incoming
            self.total_bytes += incoming
            return super().output(outs, msg, display_id, cell_index)
        self.cell_bytes[key] = limit  # nothing more of this kind from this cell
        if msg.get("msg_type") == "stream" and room > 1000:
            content["text"] = str(content.get("text", ""))[: room - 1000]
            self.total_bytes += room
            super().output(outs, msg, display_id, cell_index)
        note = self._cut_note(key, limit, figure)
        if note is not None:
            outs.append(nbformat.v4.new_output("stream", name="stdout", text=note + "\n"))
            outs[-1]["name"] = "grader"
        return None

    def _cut_note(self, key, limit: int, figure: bool) -> str | None:
        """The note for output cut at a cap: once per cell, and once for the notebook."""
        whole = self.total_bytes >= SUBMISSION_OUTPUT_LIMIT - 1000
        if whole and self.whole_noted or key in self.noted:
            return None
        self.noted.add(key)
        if whole:
            self.whole_noted = True
            return (
                f"[grader] output dropped, here and in every later cell: over "
                f"{SUBMISSION_OUTPUT_LIMIT:,} bytes in all"
            )
        if figure:
            return f"[grader] figure dropped: over {limit:,} bytes of figures in this cell"
        return f"[grader] output truncated: over {limit:,} bytes in this cell"

    def process_message(self, msg, cell, cell_index):
        """Every message from the kernel is the submission's to forge: keep only what the
        caps can count, and drop what nbclient or nbformat would choke on."""
        from nbclient.exceptions import CellExecutionComplete

        content = msg.get("content") if isinstance(msg, dict) else None
        kind = msg.get("msg_type") if isinstance(msg, dict) else None
        if not isinstance(content, dict) or not isinstance(kind, str):
            return None
        if kind == "update_display_data":
            return None  # an update replaces an output in place, past the caps: never
        if content.get("transient"):
            content["transient"] = {}  # no display ids: nothing can be updated later
        count = content.get("execution_count")
        if count is not None and not (type(count) is int and 0 <= count < 10**9):
            content["execution_count"] = None
        if kind == "stream" and content.get("name") not in ("stdout", "stderr"):
            content["name"] = "stdout"  # "grader" is the grader's own voice, not theirs
        try:
            return super().process_message(msg, cell, cell_index)
        except CellExecutionComplete:
            raise
        except Exception:  # malformed (a wrong type, a missing key): dropped
            return None

    def create_kernel_manager(self):
        # The connection file must be inside the kernel's file view and readable by its
        # uid: the work folder (jupyter_client's default is a mkstemp in the host's /tmp).
        km = super().create_kernel_manager()
        km.connection_file = os.path.join(self.work_folder, "connection.json")
        return km


def bounded(nb):
    """The executed notebook as it may leave: every cell's outputs valid nbformat, and all of
    them within the caps, whatever got past the message filter (a backstop, not the rule)."""
    import nbformat

    total = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if not isinstance(cell.get("execution_count"), (int, type(None))):
            cell.execution_count = None
        try:
            nbformat.validate(nbformat.v4.new_notebook(cells=[cell]))
            size = len(json.dumps(cell.get("outputs", [])))
        except Exception:
            size = None
        total += size or 0
        cap = 2 * OUTPUT_LIMIT + FIGURE_LIMIT  # a cell's text and its figures, with room
        if size is None or size > cap or total > SUBMISSION_OUTPUT_LIMIT + 100_000:
            note = "[grader] outputs removed: malformed, or over the caps"
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=note + "\n")]
            cell.outputs[0]["name"] = "grader"
    return nb
