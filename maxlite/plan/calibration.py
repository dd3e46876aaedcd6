"""How much slower real steps run than the planner's roofline: one factor, from MaxText's measurements.

`calibration.json` (beside this file, written by `python benchmarks/plan_calibration.py` from the
plans in benchmarks/results) holds one row per figure MaxText publishes that the planner compiles:
the recipe, MaxText's measured step (or the step its published TFLOP/s or tokens/s imply), the
planner's estimate of the same recipe, and the plan's JSON. The factor is the geometric mean of
measured ÷ estimated over the rows; a row is left out only with the reason in the row (a known
fault of the estimate, open in the issues), never to fit a model. docs/plan.md shows the table.

JAX-free: the planner's estimate and its report read it.
"""

from __future__ import annotations

import functools
import json
import math
import pathlib

TABLE = pathlib.Path(__file__).with_name("calibration.json")


@functools.cache
def rows() -> tuple[dict, ...]:
    return tuple(json.loads(TABLE.read_text())["rows"])


def ratio(row: dict) -> float:
    """MaxText's measured step ÷ the planner's estimate of it."""
    return row["maxtext_step_seconds"] / row["estimated_step_seconds"]


def factor(table: tuple[dict, ...] | None = None) -> float:
    """The geometric mean of measured ÷ estimated over the rows not left out."""
    used = [ratio(r) for r in (rows() if table is None else table) if not r.get("left_out")]
    return math.exp(sum(map(math.log, used)) / len(used))
