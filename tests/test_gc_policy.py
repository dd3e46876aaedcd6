"""A process that builds a model collects cycles less often while it traces and compiles
(maxlite/gc_policy.py): every path that compiles a model goes through `maxlite.build.wire` (train and
generate through `build`, the planner directly)."""

import gc

import jax
import pytest

from helpers import SMALL
from maxlite import build as build_lib, config as C
from maxlite.gc_policy import THRESHOLDS


@pytest.mark.parametrize("how", ["build", "wire"])
def test_wiring_a_model_spaces_the_cycle_collectors_passes(how):
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # Python's defaults, as a fresh training process starts
    try:
        cfg = C.load(SMALL + ["dtype=float32"])
        if how == "build":  # the trainer's and the sampler's path
            build_lib.build(cfg, jax.devices()[:1], num_processes=1)
        else:  # the planner's (maxlite/plan/compile.py): a resolved recipe wired onto its devices
            build_lib.wire(C.resolve(cfg, 1, 1, 1, "cpu"), jax.devices()[:1])
        assert gc.get_threshold() == THRESHOLDS
        assert all(ours > python for ours, python in zip(THRESHOLDS, (700, 10, 10)))
    finally:
        gc.set_threshold(*before)
