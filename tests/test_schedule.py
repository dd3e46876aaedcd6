"""The warmup-stable-decay learning rate: every step against its formula, written here on its own;
and a branched decay: a stable-phase checkpoint trained on with a larger `steps` keeps the steps
already taken and decays at the new end (real runs, tiny model, CPU)."""

from __future__ import annotations

import json
import math

import pytest

from maxlite import config as C, optim
from tests.helpers import SMALL, run_module

PEAK, FINAL = 1e-3, 0.1


def wsd(step: int, total: int, warmup: int, decay: int, style: str) -> float:
    """Linear warmup from 0 over `warmup` steps, PEAK until `total - decay`, then PEAK → PEAK × FINAL
    over `decay` steps in `style`, held after `total`."""
    if step < warmup:
        return PEAK * step / warmup
    start = total - decay
    if step < start:
        return PEAK
    t = min((step - start) / decay, 1.0)
    left = {"linear": 1 - t, "cosine": (1 + math.cos(math.pi * t)) / 2, "1-sqrt": 1 - math.sqrt(t)}[style]
    return PEAK * FINAL + (PEAK - PEAK * FINAL) * left


@pytest.mark.parametrize("style", ["linear", "cosine", "1-sqrt"])
def test_wsd_learning_rate_at_every_step_is_the_formula(style):
    cfg = C.load(["base.yml", "model_name=tiny", "steps=50", f"learning_rate={PEAK}", "lr_schedule_type=wsd",
                  f"learning_rate_final_fraction={FINAL}", "warmup_steps_fraction=0.1",
                  "wsd_decay_steps_fraction=0.2", f"wsd_decay_style={style}"])
    schedule = optim.learning_rate_schedule(cfg)
    for step in range(60):  # past the end: held at the final rate
        assert float(schedule(step)) == pytest.approx(wsd(step, 50, 5, 10, style), rel=1e-6, abs=1e-12), step


def test_wsd_refuses_a_warmup_and_decay_longer_than_the_schedule():
    with pytest.raises(C.ConfigError, match="lr_schedule_type=wsd: warmup"):
        C.load(["base.yml", "steps=10", "lr_schedule_type=wsd", "warmup_steps_fraction=0.5",
                "wsd_decay_steps_fraction=0.6"])


def _records(run_dir: str) -> dict[int, dict]:
    with open(f"{run_dir}/metrics.jsonl") as f:
        lines = [json.loads(x) for x in f.read().splitlines()]
    return {r["step"]: r for r in lines if "learning_rate" in r}


def test_a_branched_decay_keeps_the_steps_taken_and_decays_at_the_new_end(tmp_path):
    """A run of 8 steps (warmup 2, decay over the last 2) saves at step 4, in its stable phase; a
    branch starts from that checkpoint with steps=12 and a decay over its last 3 steps."""
    common = [*SMALL, f"base_output_directory={tmp_path}", f"learning_rate={PEAK}", "lr_schedule_type=wsd",
              f"learning_rate_final_fraction={FINAL}", "lr_warmup_steps=2", "wsd_decay_style=cosine",
              "checkpoint_period=4", "max_num_checkpoints_to_keep=0", "async_checkpointing=false"]
    codes, outs = run_module("maxlite.train", [*common, "run_name=stable", "steps=8", "wsd_decay_steps_fraction=0.25"],
                             devices=1)
    assert codes == [0], outs[0][-3000:]
    codes, outs = run_module("maxlite.train", [*common, "run_name=branch", "steps=12", "wsd_decay_steps_fraction=0.25",
                                               f"load_full_state_path={tmp_path}/stable/checkpoints/4"], devices=1)
    assert codes == [0], outs[0][-3000:]
    stable, branch = _records(f"{tmp_path}/stable"), _records(f"{tmp_path}/branch")
    assert sorted(stable) == list(range(1, 9)) and sorted(branch) == list(range(5, 13))
    # the record of step k is the rate step k trained with: the schedule at k - 1 steps taken
    for k, r in stable.items():
        assert r["learning_rate"] == pytest.approx(wsd(k - 1, 8, 2, 2, "cosine"), rel=1e-6), k
    for k, r in branch.items():
        assert r["learning_rate"] == pytest.approx(wsd(k - 1, 12, 2, 3, "cosine"), rel=1e-6), k
    for k in range(1, 5):  # the steps before the branch: the branch's schedule gives what they trained with
        assert stable[k]["learning_rate"] == pytest.approx(wsd(k - 1, 12, 2, 3, "cosine"), rel=1e-6), k
    assert branch[5]["loss"] == stable[5]["loss"]  # the same state, data position and rate at the branch
    assert branch[8]["learning_rate"] == pytest.approx(PEAK, rel=1e-6) and stable[8]["learning_rate"] < 0.6 * PEAK
