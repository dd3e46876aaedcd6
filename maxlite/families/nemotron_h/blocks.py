"""Nemotron-H's blocks as layer kinds (the family's `layer_kinds` hook, loaded by maxlite/models/layout.py
when it is asked; the family's data does not import the layout, which reads the families)."""

from __future__ import annotations

from maxlite.models.layout import LayerKind


def layer_kinds(cfg, kinds: tuple[LayerKind, ...]) -> tuple[LayerKind, ...]:
    """A block is its mixer alone (no feed-forward), or, where it has no mixer, the MLP alone."""
    return tuple(LayerKind(k.mixer, k.variant, "dense" if k.mixer == "none" else "none") for k in kinds)
