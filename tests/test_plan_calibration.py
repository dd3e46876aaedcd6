"""The planner's calibration: one factor from MaxText's measured steps against the planner's estimates
of the same recipes (maxlite/plan/calibration.json, written by benchmarks/plan_calibration.py).
The table's estimates are the plans' own (each plan's JSON in benchmarks/results), the factor is
their geometric mean, the estimate applies it, and docs/plan.md shows what the table holds."""

import json
import math
import pathlib
import types

import numpy as np
import pytest

from maxlite import config as C
from maxlite.plan import calibration, estimate as estimate_lib, topology as T

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _numbers(node, keys=("step_seconds", "estimated_step_seconds")) -> list[float]:
    """Every value under one of `keys`, anywhere in a JSON tree."""
    if isinstance(node, dict):
        return [v for k, v in node.items() if k in keys and isinstance(v, float)] + \
               [x for v in node.values() for x in _numbers(v, keys)]
    if isinstance(node, list):
        return [x for v in node for x in _numbers(v, keys)]
    return []


@pytest.mark.parametrize("row", calibration.rows(), ids=lambda r: f"{r['recipe']} on {r['topology']}")
def test_each_rows_estimate_is_its_plans_own(row):
    plan = json.loads((RESULTS / row["plan_json"]).read_text())
    assert "command" in plan, row["plan_json"]
    assert row["estimated_step_seconds"] in _numbers(plan)
    assert row["maxtext_step_seconds"] > 0 and row["source"]


def test_the_factor_is_the_geometric_mean_of_the_rows_not_left_out_and_each_left_out_row_says_why():
    used = np.array([r["maxtext_step_seconds"] / r["estimated_step_seconds"] for r in calibration.rows()
                     if not r.get("left_out")])
    assert len(used) >= 4
    assert calibration.factor() == pytest.approx(float(np.exp(np.log(used).mean())), rel=1e-12)
    assert all(len(r["left_out"]) > 40 for r in calibration.rows() if "left_out" in r)


def test_the_estimate_carries_the_calibrated_step():
    cfg = C.load(["base.yml", "model_name=tiny"])
    plan = types.SimpleNamespace(num_devices=8, flops_formula=8e15, hbm_bytes=4e12, collectives={},
                                 dcn={}, param_bytes=1e9)
    e = estimate_lib.estimate(plan, cfg, T.parse("v6e:2x4").chip, 1)
    assert e["calibrated_step_seconds"] == pytest.approx(e["step_seconds"] * calibration.factor(), rel=1e-12)
    assert e["calibration_factor"] > 1  # a roofline: real steps ran slower in every row


def test_docs_plan_shows_each_row_and_the_factor():
    page = (ROOT / "docs" / "plan.md").read_text()
    for r in calibration.rows():
        line = next((ln for ln in page.splitlines() if ln.startswith(f"| {r['recipe']} | {r['topology']} |")), None)
        assert line is not None, f"docs/plan.md has no row for {r['recipe']} on {r['topology']}"
        ratio = r["maxtext_step_seconds"] / r["estimated_step_seconds"]
        assert f"| {ratio:.2f}" in line and r["plan_json"] in line, line
    assert f"× {calibration.factor():.2f}" in page
    assert not math.isnan(calibration.factor())
