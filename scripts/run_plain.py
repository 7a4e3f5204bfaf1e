"""Run notebooks without Jupyter: each code cell exec'd in order in one `__main__` namespace.

For a GPU node whose Python has torch but no Jupyter stack (scripts/gpu_check.sh): the cells run
as a kernel would run them (functions defined in a cell are pickled by value by the launcher,
as from a notebook), printing what they print; rich displays print as text. Not a substitute for
`course run` (no outputs are saved, no parameters injected: each notebook runs its defaults).

    python scripts/run_plain.py lectures/01_collectives.ipynb solutions/lab01_ddp_scaling.ipynb

Exit status: the number of notebooks that failed.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import json
import os
import re
import sys
import time
import traceback
import types


def _stub_ipython() -> None:
    """IPython.display for a Python without IPython: display() prints the object's text."""
    import builtins

    if importlib.util.find_spec("IPython") is not None:
        from IPython.display import display

        builtins.display = display  # a kernel's builtin
        return

    class _Text:
        def __init__(self, data="", *args, **kwargs):
            self.data = data

        def __str__(self):
            return str(self.data)

    def display(*objs, **kwargs):
        for obj in objs:
            print(obj)

    mod, sub = types.ModuleType("IPython"), types.ModuleType("IPython.display")
    sub.display, sub.Markdown, sub.HTML, sub.Image, sub.Latex = display, _Text, _Text, _Text, _Text
    mod.display, mod.get_ipython = sub, lambda: None  # matplotlib asks: not interactive
    mod.version_info = (8, 0, 0)
    sys.modules["IPython"], sys.modules["IPython.display"] = mod, sub
    builtins.display = display


class _Widget:
    """ipywidgets for a Python without it: widgets build and show nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Widget()

    def __getattr__(self, name):
        return _Widget()


def _widget_class(name: str):
    if name.startswith("__"):  # __file__, __path__...: what a module without them answers
        raise AttributeError(name)
    return _Widget


def _stub_ipywidgets() -> None:
    if importlib.util.find_spec("ipywidgets") is None:
        mod = types.ModuleType("ipywidgets")
        mod.__getattr__ = _widget_class
        sys.modules["ipywidgets"] = mod


CELL_TIMEOUT = float(os.environ.get("PLAIN_CELL_TIMEOUT", "0"))
MAGIC = re.compile(r"^\s*[%!]")


def run(path: str) -> bool:
    cells = [c for c in json.load(open(path))["cells"] if c["cell_type"] == "code"]
    namespace = {"__name__": "__main__"}
    start = time.perf_counter()
    print(f"=== {path}: {len(cells)} code cells", flush=True)
    for i, cell in enumerate(cells, 1):
        source = "".join(cell["source"])
        source = "\n".join("pass" if MAGIC.match(line) else line for line in source.splitlines())
        t0 = time.perf_counter()
        if CELL_TIMEOUT:  # a hung cell: every thread's stack, then exit
            faulthandler.dump_traceback_later(CELL_TIMEOUT, exit=True)
        try:
            exec(compile(source, f"{path}#cell{i}", "exec"), namespace)
        except BaseException:
            print(f"--- {path} cell {i} FAILED after {time.perf_counter() - t0:.1f} s:", flush=True)
            traceback.print_exc(file=sys.stdout)
            print(f"=== {path}: FAILED at cell {i}/{len(cells)}", flush=True)
            return False
        faulthandler.cancel_dump_traceback_later()
        print(f"--- cell {i} ok ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"=== {path}: ok in {time.perf_counter() - start:.0f} s", flush=True)
    return True


def main(paths: list[str]) -> int:
    os.environ.setdefault("MPLBACKEND", "Agg")
    _stub_ipython()
    _stub_ipywidgets()
    sys.path.insert(0, os.getcwd())
    return sum(not run(p) for p in paths)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
