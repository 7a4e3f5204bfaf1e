"""The project's Jupyter kernel: every notebook names it, papermill and nbval run with it."""

from __future__ import annotations

import sys

KERNEL_NAME = "multigpu-course"
DISPLAY_NAME = "Python 3 (multi-GPU course)"
KERNELSPEC = {"name": KERNEL_NAME, "display_name": DISPLAY_NAME, "language": "python"}


def install_kernel(user: bool = False, quiet: bool = False) -> str:
    """Register this interpreter as the kernel ``multigpu-course`` and return the spec's folder.

    By default the spec goes inside the active environment (``--sys-prefix``), so Jupyter
    started from that environment finds it and several checkouts never overwrite each other;
    ``user=True`` registers it for every Jupyter of this user instead.
    """
    from ipykernel.kernelspec import install

    path = install(
        kernel_name=KERNEL_NAME,
        display_name=DISPLAY_NAME,
        user=user,
        prefix=None if user else sys.prefix,
    )
    if not quiet:
        print(f"registered kernel {KERNEL_NAME!r} ({sys.executable}) in {path}")
    return path
