"""The cores a student needs: the most ranks a lab starts at once, under each profile.

One CPU rank is one device of one core (helpers.world), so a lab whose largest world has n
ranks needs a CPU limit of n for its timings to be scaling rather than ranks taking turns.
Read from each lab's parameters cell and the syllabus's profiles (course.grade.lab_world).
"""

from __future__ import annotations

import nbformat

from course.grade import lab_world
from course.syllabus import PROFILES, load_syllabus


def largest_worlds() -> dict[str, dict[str, int]]:
    """{lab path: {profile: most ranks at once}} for every lab of the syllabus."""
    out = {}
    for entry in load_syllabus():
        if entry.kind == "lab":
            source = nbformat.read(entry.path, as_version=4)
            out[entry.path.name] = {p: lab_world(source, entry.parameters(p)) for p in PROFILES}
    return out


def report() -> str:
    """A table of largest_worlds and the CPU limit that runs every lab unmarked."""
    worlds = largest_worlds()
    lines = [f"{'lab':40} " + " ".join(f"{p:>6}" for p in PROFILES)]
    lines += [f"{lab:40} " + " ".join(f"{w[p]:>6}" for p in PROFILES) for lab, w in worlds.items()]
    for p in PROFILES:
        need = max(w[p] for w in worlds.values())
        lines.append(f"profile {p}: COURSE_HUB_CPU_LIMIT={need} runs every lab's worlds unmarked")
    return "\n".join(lines)
