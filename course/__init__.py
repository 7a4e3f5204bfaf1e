"""Instructor tooling for the multi-GPU course: register the kernel, run the course headless.

Each command is a plain function in its own module; ``course.cli`` only parses arguments.
"""

from course.kernel import KERNEL_NAME, install_kernel
from course.run import run_notebooks
from course.syllabus import load_syllabus

__all__ = ["KERNEL_NAME", "install_kernel", "load_syllabus", "run_notebooks"]
