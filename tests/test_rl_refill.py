"""DAPO's refill (`dynamic_sampling_max_batches`, objectives/grpo.py): the host's choice of groups
against orders worked out by hand (the groups with differing rewards first, in the order sampled, the
surplus dropped, all-equal groups without weight filling a short batch); a small GRPO run whose
reward makes some groups all equal trains every step on a full batch of groups and reads more
prompt batches than steps, its checkpoint counting them; stopped and resumed, it ends where the
uninterrupted run ends; two processes sample every further batch together and each trains a full share;
asynchronous (off_policy_steps), a refill takes the batches already sampled ahead and resumes like the
uninterrupted run; a refill the run cannot make (no dynamic_sampling) fails in one line."""

import json

import numpy as np
import pytest

from maxlite import checkpoints, config as C
from maxlite.bridge import params as P
from maxlite.objectives import grpo
from maxlite.objectives.rollout import Scored
from maxlite.train import train
from tests.helpers import SMALL, run_module

T, F = True, False


@pytest.mark.parametrize("equal_P, wanted, order, kept", [
    # three batches of 4 groups: differing groups 1 | 4, 6, 7 | 8; the batch holds 4, group 8 is surplus
    ([T, F, T, T, F, T, F, F, F, T, T, T], 4, [1, 4, 6, 7], 4),
    # two batches and only groups 1 and 6 differ: the first two all-equal groups (0, 2) fill the batch
    ([T, F, T, T, T, T, F, T], 4, [1, 6, 0, 2], 2),
    ([F, F, F, F], 4, [0, 1, 2, 3], 4),  # the step's own batch was enough: its order unchanged
])
def test_refill_order_keeps_the_first_differing_groups_and_fills_with_equal_ones(equal_P, wanted, order, kept):
    got_order, got_kept = grpo.refill_order(np.array(equal_P), wanted)
    assert got_order.tolist() == order and got_kept == kept


def _scored(rewards_PG, first_row):
    """A scored rollout whose row r's inputs are all `first_row + r` (to see which rows were taken)."""
    R = np.size(rewards_PG)
    ids = np.arange(first_row, first_row + R)
    rows = {"inputs": np.repeat(ids[:, None], 3, 1), "weights": np.ones((R, 3), np.float32)}
    return Scored(np.array(rewards_PG, np.float32), rows, ids + 100, ids % 2 == 0, None, 1, 0)


def test_the_chosen_groups_take_their_rows_and_a_short_batch_pads_without_weight():
    # G = 2; batch A's groups: (1, 1) equal, (0, 2) differ; batch B's: (3, 3) equal, (5, 4) differ
    every = grpo.concat([_scored([[1, 1], [0, 2]], 0), _scored([[3, 3], [5, 4]], 4)])
    assert every.reward_failures == 2
    equal_P = every.rewards_PG.max(1) == every.rewards_PG.min(1)
    order, kept = grpo.refill_order(equal_P, 2)
    chosen = grpo.take_groups(every, order)
    assert kept == 2 and chosen.rewards_PG.tolist() == [[0, 2], [5, 4]]
    assert chosen.rows["inputs"][:, 0].tolist() == [2, 3, 6, 7] and chosen.lengths.tolist() == [102, 103, 106, 107]
    # batch A alone, the batch holding 2 groups: group 1 and then group 0, the padding, with no weight
    only = _scored([[1, 1], [0, 2]], 0)
    order, kept = grpo.refill_order(only.rewards_PG.max(1) == only.rewards_PG.min(1), 2)
    chosen = grpo.take_groups(only, order)
    keep_R, _ = grpo.kept_rows(chosen.rewards_PG, chosen.ended, dynamic=True, overlong=False)
    assert kept == 1 and chosen.rows["inputs"][:, 0].tolist() == [2, 3, 0, 1] and keep_R.tolist() == [1, 1, 0, 0]


# 8 prompts a step (8 devices), 4 completions each; the reward is 0 for every completion of an even
# answer's question (an all-equal group) and differs within the group of an odd answer's
ARGV = [*SMALL, "vocab_size=4096", "dtype=float32", "train_objective=grpo", "dataset_type=prompts",
        "max_target_length=50", "grpo_max_new_tokens=8", "grpo_num_generations=4", "grpo_temperature=1.5",
        "reward_functions=[tests.reward_fns:index_if_odd]", "reward_workers=1", "loss_algo=dapo",
        "dynamic_sampling=true", "dynamic_sampling_max_batches=4", "learning_rate=1e-2",
        "lr_schedule_type=constant", "warmup_steps_fraction=0", "checkpoint_period=0", "log_period=1",
        "eval_interval=0"]


@pytest.mark.parametrize("extra, words", [
    (["dynamic_sampling=false"], "set dynamic_sampling=true, or dynamic_sampling_max_batches=1"),
    (["dynamic_sampling_max_batches=0"], "dynamic_sampling_max_batches"),
])
def test_a_refill_it_cannot_run_fails_in_one_line(extra, words):
    with pytest.raises(C.ConfigError, match=words) as e:
        C.resolve(C.load([*ARGV, *extra]), 8)
    assert "\n" not in str(e.value)


def _metrics(run_dir):
    return [r for r in map(json.loads, open(f"{run_dir}/metrics.jsonl")) if "loss" in r]


def _batches_read(run_dir, step):
    data = checkpoints.restore_items(f"{run_dir}/checkpoints", step, {"data": None})["data"]
    return data["position"]["batches_read"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("refill")
    train(C.load([*ARGV, "steps=4", f"base_output_directory={out}", "run_name=b"]))
    return out


def test_a_refilled_step_trains_a_full_batch_of_differing_groups(uninterrupted):
    rows = _metrics(uninterrupted / "b")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["groups_kept"] == 1.0 for r in rows)  # 8 groups with differing rewards, every step
    assert any(r["generation_batches"] > 1 for r in rows[:2])  # refilled before the resume test's stop
    # the checkpoint's data position counts every batch sampled, the refills included
    assert _batches_read(uninterrupted / "b", 4) == sum(r["generation_batches"] for r in rows) > 4


def test_a_refilling_run_stopped_and_resumed_ends_at_the_uninterrupted_parameters(uninterrupted, tmp_path):
    argv = [*ARGV, f"base_output_directory={tmp_path}", "run_name=a"]
    train(C.load([*argv, "steps=2"]))
    train(C.load([*argv, "steps=4"]))  # resumes from step 2's checkpoint
    a, b = _metrics(tmp_path / "a"), _metrics(uninterrupted / "b")
    assert any(r["generation_batches"] > 1 for r in a[:2]) and any(r["generation_batches"] > 1 for r in a[2:])
    assert [(r["step"], r["loss"], r["generation_batches"]) for r in a] == \
           [(r["step"], r["loss"], r["generation_batches"]) for r in b]
    _, pa = checkpoints.load_params(f"{tmp_path}/a/checkpoints")
    _, pb = checkpoints.load_params(f"{uninterrupted}/b/checkpoints")
    for (path, x), (_, y) in zip(P.leaves(P.to_pure(pa)), P.leaves(P.to_pure(pb))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


def test_a_refill_samples_on_the_sampler_devices_of_a_separate_placement(tmp_path):
    # the refill batches' keys are made on the sampler's mesh, as the step's own key is
    train(C.load([*ARGV, "steps=1", "trainer_devices_fraction=0.5", "sampler_devices_fraction=0.5",
                  f"base_output_directory={tmp_path}", "run_name=s"]))
    (row,) = _metrics(tmp_path / "s")
    assert row["generation_batches"] > 1 and row["groups_kept"] == 1.0


def test_two_processes_refill_together_and_each_trains_a_full_share(tmp_path):
    # jax.distributed over gloo, 4 devices each: every further batch is one collective program, so both
    # processes must decide alike to sample it, though each finds its own groups with differing rewards
    args = [*ARGV, "steps=3", "checkpoint_period=3", f"base_output_directory={tmp_path}", "run_name=p"]
    codes, outs = run_module("maxlite.train", args, processes=2, devices=4)
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    rows = _metrics(tmp_path / "p")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["groups_kept"] == 1.0 for r in rows)  # 4 differing groups in each process's share, every step
    assert any(r["generation_batches"] > 1 for r in rows)
    assert _batches_read(tmp_path / "p", 3) == sum(r["generation_batches"] for r in rows)


def test_an_asynchronous_refill_takes_the_batches_sampled_ahead_and_resumes_like_the_uninterrupted_run(tmp_path):
    # one step off-policy on devices of its own (a quarter each), checkpoints every 3 steps: a refill's
    # batches are those the sampler read ahead, so each step trains at most one update behind; a run
    # stopped at step 3 and resumed ends with the uninterrupted run's losses and weights
    argv = [*ARGV, "off_policy_steps=1", "trainer_devices_fraction=0.25", "sampler_devices_fraction=0.25",
            "per_device_batch_size=4", "checkpoint_period=3", f"base_output_directory={tmp_path}"]
    train(C.load([*argv, "steps=6", "run_name=whole"]))
    train(C.load([*argv, "steps=3", "run_name=split"]))
    train(C.load([*argv, "steps=6", "run_name=split"]))
    whole, split = _metrics(tmp_path / "whole"), _metrics(tmp_path / "split")
    assert all(r["groups_kept"] == 1.0 for r in whole)
    assert any(r["generation_batches"] > 1 for r in whole[1:3]) and any(r["generation_batches"] > 1 for r in whole[4:])
    # the restart steps (0, 3) sample their own batch now; the others take what was sampled one update before
    assert [r["rollout_staleness"] for r in whole] == [0, 1, 1, 0, 1, 1]
    assert [(r["loss"], r["generation_batches"]) for r in split] == \
           [(r["loss"], r["generation_batches"]) for r in whole]
    assert _batches_read(tmp_path / "whole", 6) == sum(r["generation_batches"] for r in whole)
    _, pa = checkpoints.load_params(f"{tmp_path}/whole/checkpoints")
    _, pb = checkpoints.load_params(f"{tmp_path}/split/checkpoints")
    for (path, x), (_, y) in zip(P.leaves(P.to_pure(pa)), P.leaves(P.to_pure(pb))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))
