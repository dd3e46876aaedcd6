"""Placement of the rollouts (maxlite/rollout/reshard.py): the device split, the rollout mesh's shape,
and the weights pushed from the trainer's mesh to a rollout mesh of another shape."""

import jax
import numpy as np
import pytest
from flax import nnx

from maxlite import config as C, mesh as mesh_lib
from maxlite.plan.topology import parse
from maxlite.rollout import reshard
from maxlite.state import abstract_params
from tests.helpers import SMALL, build

RL = ["base.yml", "train_objective=grpo", "dataset_type=prompts", "reward_functions=[maxlite.objectives.rewards:exact_answer]"]


def test_both_shares_one_is_colocated_and_a_split_takes_the_first_and_last_devices():
    devices = list(range(8))
    together = reshard.split_devices(C.load(RL), devices)
    assert together.colocated and together.trainer == devices
    apart = reshard.split_devices(C.load([*RL, "trainer_devices_fraction=0.75",
                                          "sampler_devices_fraction=0.25"]), devices)
    assert (apart.trainer, apart.sampler, apart.colocated) == ([0, 1, 2, 3, 4, 5], [6, 7], False)


@pytest.mark.parametrize("shares, message", [
    (("0.75", "0.5"), "overlap: separate placement needs their sum ≤ 1"),
    (("1.0", "0.1"), "leave 8 to train and 0 to sample"),
])
def test_shares_that_overlap_or_leave_a_side_empty_are_one_line(shares, message):
    cfg = C.load([*RL, f"trainer_devices_fraction={shares[0]}", f"sampler_devices_fraction={shares[1]}"])
    with pytest.raises(C.ConfigError, match=message):
        reshard.split_devices(cfg, list(range(8)))


def test_the_rollout_mesh_is_data_times_tensor_over_the_samplers_devices():
    cfg = C.load([*RL, "rollout_tensor_parallelism=2", "ici_fsdp_parallelism=4"])
    shaped = reshard.rollout_config(cfg, 8)
    assert shaped.parallelism("ici") == (4, 1, 1, 1, 1, 2) and shaped.parallelism("dcn") == (1,) * 6
    with pytest.raises(C.ConfigError, match="rollout_data_parallelism=3 × rollout_tensor_parallelism=2"):
        reshard.rollout_config(C.load([*RL, "rollout_tensor_parallelism=2", "rollout_data_parallelism=3"]), 8)
    with pytest.raises(C.ConfigError, match="does not divide the sampler's 6 devices"):
        reshard.rollout_config(C.load([*RL, "rollout_tensor_parallelism=4"]), 6)


def _logits(graphdef, params, mesh, ids):
    with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        model = nnx.merge(graphdef, params)
        B, T = ids.shape
        return np.asarray(nnx.jit(lambda m, *a: m(*a))(model, ids, np.broadcast_to(np.arange(T), (B, T)),
                                                         np.ones((B, T), np.int32)))


def test_weights_pushed_from_fsdp4_to_data2_tensor2_on_other_devices_compute_the_same_logits():
    """Trainer: devices 0-3, fsdp 4; rollout: devices 4-7, data 2 × tensor 2. The push copies every
    byte (no cast, no host round trip) onto the rollout devices, sharded by the same logical axes."""
    cfg, mesh, state, _, _ = build([*SMALL, "dtype=float32", "ici_fsdp_parallelism=4"], 4)  # the trainer's
    graphdef = abstract_params(cfg)[0]
    rl = C.load([*RL, "trainer_devices_fraction=0.5", "sampler_devices_fraction=0.5", "rollout_tensor_parallelism=2"])
    placement = reshard.split_devices(rl, jax.devices())
    assert placement.trainer == list(mesh.devices.flat)
    target = reshard.rollout_mesh(rl, placement.sampler)
    assert dict(target.shape) == {"data": 2, "stage": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 2}
    pushed, seconds = reshard.WeightPush(state.params, target)(state.params)
    assert seconds >= 0
    for before, after in zip(jax.tree.leaves(state.params), jax.tree.leaves(pushed)):
        assert set(after.sharding.device_set) <= set(placement.sampler)
        np.testing.assert_array_equal(np.asarray(before), np.asarray(after))
    embed = [a for a in jax.tree.leaves(pushed) if a.ndim == 2 and a.shape[0] == cfg.vocab_size][0]
    assert "tensor" in str(embed.sharding.spec)  # sharded the rollout's way, not the trainer's
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8))
    np.testing.assert_allclose(_logits(graphdef, pushed, target, ids), _logits(graphdef, state.params, mesh, ids),
                               rtol=1e-5, atol=1e-5)


def test_the_push_estimate_grows_with_the_bytes_and_shrinks_with_the_senders():
    """The planner's lower bound for a push (docs/rl.md gives 8B on v6e-16 → v6e-16): twice the bytes
    twice the time, twice the sending chips half, inside a slice (ICI) faster than across (DCN)."""
    chip = parse("v6e:4x4").chip
    across = reshard.push_estimate_seconds(16e9, chip, 16)
    assert reshard.push_estimate_seconds(32e9, chip, 16) == pytest.approx(2 * across)
    assert reshard.push_estimate_seconds(16e9, chip, 32) == pytest.approx(across / 2)
    assert reshard.push_estimate_seconds(16e9, chip, 16, across_slices=False) < across


def test_the_engines_log_probs_after_a_push_equal_the_trainers():
    """The trainer (fsdp 2 on devices 0-1) pushes its weights to a tensor-2 rollout mesh (devices
    6-7); the rollout engine samples there, and the log-probs it reports for its tokens equal what
    the trainer recomputes on its own mesh (float32 rounding)."""
    import jax.numpy as jnp

    from maxlite.data.preference import row
    from maxlite.objectives.rollout import sampler_row
    from maxlite.rollout.continuous import ContinuousEngine
    from maxlite.rollout.engine import Sampling
    from maxlite.step import token_logps

    cfg, mesh, state, _, _ = build([*SMALL, "dtype=float32", "ici_fsdp_parallelism=2", "init_scale=0.5"], 2)
    graphdef = abstract_params(cfg)[0]
    rl = C.load([*RL, "trainer_devices_fraction=0.25", "sampler_devices_fraction=0.25", "rollout_tensor_parallelism=2"])
    target = reshard.rollout_mesh(rl, reshard.split_devices(rl, jax.devices()).sampler)
    pushed, _ = reshard.WeightPush(state.params, target)(state.params)
    prompts, G, T = [[5, 17, 100, 3, 9], [40, 41, 42]], 2, 16
    with jax.set_mesh(target), nnx.logical_axis_rules(mesh_lib.RULES):
        done = ContinuousEngine(cfg, graphdef, 2, 32).generate(pushed, prompts, Sampling(6, 1.0, G), jax.random.key(1))
    rows, sampler = [], []
    for i, toks in enumerate(done.tokens):
        ids = np.asarray(prompts[i // G] + toks.tolist(), np.int32)
        rows.append(row(ids, np.arange(len(ids)) >= len(prompts[i // G]), T))
        sampler.append(sampler_row(done.logps[i], len(prompts[i // G]), T))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        theirs = np.asarray(token_logps(state.params, graphdef, {k: jnp.asarray(np.stack([r[k] for r in rows]))
                                                                  for k in rows[0]}))
    w = np.stack([r["weights"] for r in rows]) > 0
    assert w.sum() == sum(map(len, done.tokens)) > 0
    np.testing.assert_allclose(np.stack(sampler)[w], theirs[w], rtol=1e-5, atol=2e-5)
