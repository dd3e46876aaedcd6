"""GRPO's rollouts on devices of their own, synchronous and asynchronous (maxlite/rollout/pipeline.py),
and the read-ahead iterator under it (maxlite/data/lookahead.py)."""

import json

import numpy as np
import pytest

from maxlite import checkpoints, config as C
from maxlite.bridge import params as P
from maxlite.data.lookahead import Lookahead
from maxlite.data.synthetic import make_synthetic_iterator
from maxlite.train import train
from tests.helpers import GRPO_SEPARATE, SMALL

GRPO = GRPO_SEPARATE


def test_reading_ahead_leaves_the_saved_position_at_the_loops_batch():
    cfg = C.load(SMALL)
    plain, ahead = make_synthetic_iterator(cfg, "train", 0, 1), Lookahead(make_synthetic_iterator(cfg, "train", 0, 1))
    expected = [next(plain) for _ in range(5)]
    np.testing.assert_array_equal(next(ahead)["inputs"], expected[0]["inputs"])
    saved = ahead.get_state()
    np.testing.assert_array_equal(ahead.peek(2)["inputs"], expected[3]["inputs"])  # reads 1..3 ahead
    assert ahead.get_state() == saved  # a checkpoint now resumes at batch 1, not past what was peeked
    np.testing.assert_array_equal(next(ahead)["inputs"], expected[1]["inputs"])
    ahead.set_state(saved)  # a resume drops what was read ahead
    assert [b["inputs"].tolist() for b in (next(ahead), next(ahead))] == [e["inputs"].tolist() for e in expected[1:3]]


def _grpo_rows(run_dir):
    return [r for r in map(json.loads, open(f"{run_dir}/metrics.jsonl")) if "reward" in r]


def test_off_policy_needs_devices_of_its_own_and_placement_is_grpos(tmp_path):
    with pytest.raises(C.ConfigError, match="off_policy_steps=1 samples while the trainer trains"):
        C.load([*GRPO, "off_policy_steps=1", "trainer_devices_fraction=1", "sampler_devices_fraction=1"])
    with pytest.raises(C.ConfigError, match="off_policy_steps places GRPO's rollouts"):
        C.load([*SMALL, "off_policy_steps=1"])
    with pytest.raises(C.ConfigError, match="the trainer's 4 and the sampler's 4 devices may use at most half"):
        train(C.load([*GRPO, "off_policy_steps=1", "trainer_devices_fraction=0.5", "sampler_devices_fraction=0.5",
                      f"base_output_directory={tmp_path}", "steps=1"]))


@pytest.mark.parametrize("extra", [["off_policy_steps=1"], [],
                                   ["rollout_workers=1", "trainer_devices_fraction=1", "sampler_devices_fraction=1"]])
def test_separate_rollouts_on_several_processes_are_refused_with_the_process_count(extra):
    # one process for now: refused where the recipe is resolved for its processes, which ray_entry.train
    # does before any cluster starts (tests/test_ray.py: RT.check)
    cfg = C.load([*GRPO, *extra])
    C.resolve(cfg, 8, num_processes=1)
    with pytest.raises(C.ConfigError, match=r"separate rollout placement, rollout_workers and off_policy_steps run "
                                            r"in one process for now \(this run has 2\): use one process \(under "
                                            r"Ray: ray_num_workers=1\)") as e:
        C.resolve(cfg, 8, num_processes=2)
    assert "\n" not in str(e.value)


def test_separate_placement_trains_on_half_the_devices_and_logs_the_push(tmp_path):
    """Synchronous, the trainer on devices 0-1, the rollouts on 6-7 (tensor 2): each step pushes the
    weights and says how long it took."""
    train(C.load([*GRPO, "steps=2", "rollout_tensor_parallelism=2", f"base_output_directory={tmp_path}",
                  "run_name=sync", "checkpoint_period=0"]))
    rows = _grpo_rows(f"{tmp_path}/sync")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout_staleness"] == 0 and r["weight_push_seconds"] > 0 for r in rows)


def test_one_step_off_policy_samples_with_weights_one_update_old_and_resumes_like_the_uninterrupted_run(tmp_path):
    """off_policy_steps=1, checkpoints every 3 steps: steps 1-3 and 4-6 each start synchronously
    (staleness 0) and then sample one update behind; a run stopped at step 3 and resumed ends with
    the uninterrupted run's rewards and weights."""
    argv = [*GRPO, "off_policy_steps=1", "checkpoint_period=3", f"base_output_directory={tmp_path}"]
    train(C.load([*argv, "steps=6", "run_name=whole"]))
    train(C.load([*argv, "steps=3", "run_name=split"]))
    train(C.load([*argv, "steps=6", "run_name=split"]))
    whole, split = _grpo_rows(f"{tmp_path}/whole"), _grpo_rows(f"{tmp_path}/split")
    assert [r["rollout_staleness"] for r in whole] == [0, 1, 1, 0, 1, 1]
    assert [r["reward"] for r in split] == [r["reward"] for r in whole]
    assert [r["loss"] for r in split] == [r["loss"] for r in whole]
    _, pa = checkpoints.load_params(f"{tmp_path}/whole/checkpoints")
    _, pb = checkpoints.load_params(f"{tmp_path}/split/checkpoints")
    for (path, x), (_, y) in zip(P.leaves(P.to_pure(pa)), P.leaves(P.to_pure(pb))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))
