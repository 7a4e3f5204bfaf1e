"""The syllabus file: which notebooks make up the course, in order, with their parameter profiles."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
SYLLABUS = REPO / "syllabus.yml"
PROFILES = ("quick", "full")


@dataclass(frozen=True)
class Entry:
    path: Path  # absolute path of the notebook
    title: str
    kind: str  # "lecture" or "lab"
    budget_s: float
    profiles: dict = field(default_factory=dict)

    def parameters(self, profile: str) -> dict:
        """Papermill parameters of this notebook under ``profile`` (quick or full)."""
        if profile not in PROFILES:
            raise ValueError(f"unknown profile {profile!r}: use one of {', '.join(PROFILES)}")
        return dict(self.profiles.get(profile) or {})


def load_syllabus(path: Path | str = SYLLABUS) -> list[Entry]:
    """Read the syllabus and check every entry names an existing notebook."""
    path = Path(path)
    data = yaml.safe_load(path.read_text()) or {}
    entries = []
    for i, item in enumerate(data.get("notebooks") or []):
        missing = {"path", "title", "kind"} - set(item)
        if missing:
            raise ValueError(f"{path}: entry {i} lacks {', '.join(sorted(missing))}")
        nb = (path.parent / item["path"]).resolve()
        if not nb.is_file():
            raise FileNotFoundError(f"{path}: entry {i} names {item['path']}, which does not exist")
        if item["kind"] not in ("lecture", "lab"):
            raise ValueError(
                f"{path}: entry {i} kind must be 'lecture' or 'lab', not {item['kind']!r}"
            )
        entries.append(
            Entry(
                path=nb,
                title=item["title"],
                kind=item["kind"],
                budget_s=float(item.get("budget_s", 600)),
                profiles=item.get("profiles") or {},
            )
        )
    return entries
