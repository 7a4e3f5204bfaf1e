"""The Axes a plot draws on: the caller's, or a new figure's."""

from __future__ import annotations


def _axes(ax=None, figsize=(6, 4)):
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax
