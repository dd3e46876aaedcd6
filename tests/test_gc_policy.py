"""A process that builds a model collects cycles less often while it traces and compiles
(maxlite/gc_policy.py): every path that compiles a model (train, generate, the planner) goes through
`maxlite.build.build`."""

import gc

from helpers import SMALL
from maxlite import build as build_lib, config as C
from maxlite.gc_policy import THRESHOLDS


def test_building_a_model_spaces_the_cycle_collectors_passes():
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # Python's defaults, as a fresh training process starts
    try:
        build_lib.build(C.load(SMALL + ["dtype=float32"]))
        assert gc.get_threshold() == THRESHOLDS
        assert all(ours > python for ours, python in zip(THRESHOLDS, (700, 10, 10)))
    finally:
        gc.set_threshold(*before)
