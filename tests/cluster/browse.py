"""A student's browser on the cluster's network (run on a node by tests/cluster/test_jupyter.py):
open a notebook in the JupyterLab a Slurm job serves, run it up to and including its first
launch, then one cell of ours; print what those cells printed, as JSON, on the last line.

    python browse.py URL TOKEN NOTEBOOK SHOT

Headless Debian chromium driven by Playwright, as tests/notebooks/test_browser.py drives it.
"""

from __future__ import annotations

import json
import shutil
import sys

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"]
# what the kernel sees of the job: its devices (helpers), cores, node and Slurm's variables
PROBE = """import json, os, socket, helpers
print(json.dumps({"devices": helpers.world.cpu_count(), "cores": sorted(os.sched_getaffinity(0)),
    "host": socket.gethostname(), "limit": helpers.world.cpu_limit_text(),
    "slurm": {k: v for k, v in os.environ.items() if k.startswith("SLURM_")}}))"""

CELL_DONE = """(k) => { const w = window.jupyterapp.shell.currentWidget;
    const kernel = w.sessionContext.session.kernel; const cells = [...w.content.model.cells];
    const failed = cells.slice(0, k + 1).some(c => c.type === 'code'
        && c.outputs.toJSON().some(o => o.output_type === 'error'));
    return kernel.status === 'idle' && (failed || cells[k].executionCount !== null); }"""
CELL_TEXT = """(k) => [...window.jupyterapp.shell.currentWidget.content.model.cells].slice(0, k + 1)
    .filter(c => c.type === 'code').map(c => c.outputs.toJSON().map(o => (o.text || '')
    + (o.data && o.data['text/plain'] || '') + (o.ename ? o.ename + ': ' + o.evalue : ''))
    .join('')).join('\\n')"""


def first_launch(notebook_json: str) -> int:
    cells = json.loads(notebook_json)["cells"]
    return next(
        i
        for i, c in enumerate(cells)
        if c["cell_type"] == "code" and "helpers.launch(" in "".join(c["source"])
    )


def main(url: str, token: str, notebook: str, shot: str) -> None:
    from playwright.sync_api import sync_playwright

    k = first_launch(open(notebook).read())
    name = notebook.rsplit("/", 1)[-1]
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=shutil.which("chromium") or "/usr/bin/chromium", args=ARGS
        )
        page = browser.new_page()
        page.goto(f"{url}/lab/workspaces/slurm/tree/{name}?reset&token={token}", timeout=120_000)
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
        page.wait_for_function(
            "() => { const w = window.jupyterapp.shell.currentWidget; const s = w &&"
            " w.sessionContext.session; return s && s.kernel && s.kernel.status === 'idle'; }",
            timeout=180_000,
        )
        page.evaluate(  # run every cell up to the first launch, as a student reaching it would
            """(k) => { const app = window.jupyterapp; const nb = app.shell.currentWidget.content;
                nb.activeCellIndex = k + 1; app.commands.execute('notebook:run-all-above'); }""",
            k,
        )
        page.wait_for_function(CELL_DONE, arg=k, timeout=300_000)
        launched = page.evaluate(CELL_TEXT, k)
        probe = page.evaluate(
            """async (code) => { const app = window.jupyterapp; const nb = app.shell.currentWidget.content;
                nb.activeCellIndex = nb.widgets.length - 1;
                await app.commands.execute('notebook:insert-cell-below');
                nb.activeCell.model.sharedModel.setSource(code);
                app.commands.execute('notebook:run-cell'); return nb.activeCellIndex; }""",
            PROBE,
        )
        page.wait_for_function(CELL_DONE, arg=probe, timeout=120_000)
        probed = page.evaluate(CELL_TEXT, probe).splitlines()[-1]
        page.screenshot(path=shot, full_page=False)
        browser.close()
    print(json.dumps({"launched": launched, "probe": probed}))


if __name__ == "__main__":
    main(*sys.argv[1:5])
