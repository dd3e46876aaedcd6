"""opt_type=muon: the split (Muon on the layers' matrices, AdamW on the rest), one matrix's update
against optax's Muon on that matrix alone, training, checkpoints (kill → resume, another mesh), the
refusal of another opt_type on resume and reset_optimizer_state, and the state's memory."""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import optax.contrib
import pytest
from flax import nnx

from maxlite import config as C, optim, state as state_lib
from maxlite.checkpoints.saver import Checkpointer
from tests.helpers import MOE, SMALL, build, run_module, start, start_built, train_losses, trained

MUON = ["opt_type=muon", "gradient_clipping_threshold=0", "lr_schedule_type=constant", "warmup_steps_fraction=0",
        "learning_rate=0.02", "muon_weight_decay=0.1"]


def _split(argv):
    return optim.muon_split(state_lib.split_trainable(state_lib.abstract_params(C.load(argv))[1])[0])


def test_the_split_takes_each_layer_and_expert_matrix_at_its_true_shape():
    dense, moe = _split(SMALL), _split(MOE)
    for name in (("embedding",), ("unembedding",), ("final_norm", "scale"), ("layers", "attn_norm", "scale")):
        assert dense[name] is None and moe[name] is None, name
    # [layers, D, N, H]: the layer a batch axis, a D × (N·H) matrix; [layers, N, H, D]: (N·H) × D
    assert tuple(np.atleast_1d(dense[("layers", "attn", "q")].reduction_axis)) == (1,)
    assert tuple(np.atleast_1d(dense[("layers", "attn", "q")].output_axis)) == (2, 3)
    assert tuple(np.atleast_1d(dense[("layers", "attn", "o")].reduction_axis)) == (1, 2)
    assert tuple(np.atleast_1d(dense[("layers", "attn", "o")].output_axis)) == (3,)
    # [layers, experts, F, D]: each expert its own F × D matrix
    assert tuple(np.atleast_1d(moe[("layers", "mlp", "down")].reduction_axis)) == (2,)
    assert tuple(np.atleast_1d(moe[("layers", "mlp", "down")].output_axis)) == (3,)
    assert "AdamW on embedding, final_norm/scale" in optim.describe_split(dense)


def _leaf(tree, *path):
    for name in path:
        tree = tree[name]
    return np.asarray(tree[...] if isinstance(tree, nnx.Variable) else tree)


@pytest.mark.parametrize("argv, path, index, shape", [
    (SMALL, ("layers", "attn", "q"), (1,), (64, 2 * 32)),  # layer 1's q: D × (N·H)
    (SMALL, ("layers", "attn", "o"), (0,), (2 * 32, 64)),  # layer 0's o: (N·H) × D
    (MOE, ("layers", "mlp", "down"), (1, 5), (16, 32)),  # layer 1's expert 5
])
def test_one_matrix_update_is_optax_muon_on_that_matrix_alone(argv, path, index, shape):
    cfg, _, state, _, _ = build([*argv, *MUON], 1)
    tx = optim.make_optimizer(cfg)
    params = jax.device_get(state.params)
    grads = jax.tree.map(lambda p: np.asarray(jax.random.normal(jax.random.key(3), p.shape), p.dtype), params)
    opt_state = tx.init(params)
    for _ in range(2):  # the second update also carries the momentum of the first
        updates, opt_state = tx.update(grads, opt_state, params)
    got = _leaf(updates, *path)[index].reshape(shape)
    alone = optax.contrib.muon(cfg.learning_rate, beta=cfg.muon_beta, weight_decay=cfg.muon_weight_decay)
    w, g = _leaf(params, *path)[index].reshape(shape), _leaf(grads, *path)[index].reshape(shape)
    s = alone.init(w)
    for _ in range(2):
        want, s = alone.update(g, s, w)
    np.testing.assert_allclose(got, np.asarray(want), rtol=2e-5, atol=1e-7)


def test_muon_trains_tiny_and_its_state_holds_one_moment():
    losses, _ = train_losses([*SMALL, "opt_type=muon", "learning_rate=0.01", "steps=10", "per_device_batch_size=8"],
                             1, 10)
    assert losses[-3:].mean() < losses[:3].mean() - 0.2, losses
    sizes = {}
    for opt in ("adamw", "muon"):
        abstract = state_lib.abstract_train_state(C.load([*SMALL, f"opt_type={opt}"]), optim.make_optimizer(
            C.load([*SMALL, f"opt_type={opt}"])))
        sizes[opt] = sum(x.size for k, x in jax.tree_util.tree_leaves_with_path(abstract.opt_state)
                         if not any(getattr(p, "name", "") in ("count", "ns_coeffs") for p in k))  # moments only
    split, params = _split(SMALL), state_lib.abstract_params(C.load(SMALL))[1]
    matrices = sum(v.size for k, v in jax.tree_util.tree_leaves_with_path(params)
                   if split[optim.path_key(k)] is not None)
    n = sum(x.size for x in jax.tree.leaves(params))
    assert sizes["adamw"] == 2 * n and sizes["muon"] == 2 * (n - matrices) + matrices


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def test_muon_state_restores_onto_another_mesh_bitwise(tmp_path):
    cfg, state, data = trained(tmp_path, MUON, steps=2)
    saver = Checkpointer(cfg, True, state_lib.nbytes(state))
    assert saver.save(2, state, data)
    saver.close()
    _, started, _, c = start(tmp_path, ["run_name=src", *MUON, "ici_fsdp_parallelism=2"], 2)
    c.close()
    assert started.source == "checkpoint" and int(started.state.step) == 2
    assert len(jax.tree.leaves(started.state.opt_state)[-1].sharding.device_set) <= 2
    got, want = _host(started.state), _host(state)
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))


def test_another_opt_type_on_resume_is_refused_unless_the_optimizer_is_reset(tmp_path):
    cfg, state, data = trained(tmp_path, steps=1, devices=1, mesh=("ici_fsdp_parallelism=1",))  # AdamW
    saver = Checkpointer(cfg, True, state_lib.nbytes(state))
    assert saver.save(1, state, data)
    saver.close()
    with pytest.raises(C.ConfigError, match="holds the optimizer state of opt_type=adamw, this run has opt_type=muon"):
        start(tmp_path, ["run_name=src", *MUON], 1)
    reset = ["run_name=src", *MUON, "reset_optimizer_state=true"]
    built, started, data, c = start_built(tmp_path, reset, 1)
    assert int(started.state.step) == 1
    assert all(np.array_equal(a, b) for a, b in zip(_host(started.state.params), _host(state.params)))
    fresh = optim.make_optimizer(C.load([*SMALL, *MUON])).init(jax.device_get(started.state.params))
    assert all(np.array_equal(a, b) for a, b in zip(_host(started.state.opt_state), _host(fresh)))
    # the reset happens once: the reset run's own checkpoint comes back with its Muon state
    trained_on, _ = built.train_step(started.state, {k: jax.device_put(v, built.batch_sharding)
                                                     for k, v in next(data).items()})
    assert c.save(2, trained_on, data)
    c.close()
    _, again, _, c = start(tmp_path, reset, 1)
    c.close()
    assert int(again.state.step) == 2
    assert all(np.array_equal(a, b) for a, b in zip(_host(again.state.opt_state), _host(trained_on.opt_state)))
    assert any(np.any(a) for a in _host(again.state.opt_state[0].inner_states["muon"]))  # not a fresh momentum


def _final_loss(run_dir: str, step: int) -> float:
    with open(f"{run_dir}/metrics.jsonl") as f:
        return [r["loss"] for r in map(json.loads, f.read().splitlines()) if r.get("step") == step and "loss" in r][-1]


def test_a_killed_muon_run_resumes_to_the_straight_runs_loss(tmp_path):
    common = [*SMALL, *MUON, f"base_output_directory={tmp_path}", "steps=6", "checkpoint_period=2",
              "async_checkpointing=false"]
    codes, outs = run_module("maxlite.train", [*common, "run_name=straight"], devices=1)
    assert codes == [0], outs[0][-3000:]
    assert "maxlite: opt_type=muon: Muon on layers/attn/k" in outs[0]
    codes, outs = run_module("maxlite.train", [*common, "run_name=killed", "fault_type=crash", "fault_step=5"],
                             devices=1)
    assert codes == [1] and "fault injection: crash at step 5" in outs[0], outs[0][-3000:]
    codes, outs = run_module("maxlite.train", [*common, "run_name=killed", "fault_type=crash", "fault_step=5"],
                             devices=1)
    assert codes == [0] and "resumed from step 4" in outs[0], outs[0][-3000:]
    assert _final_loss(f"{tmp_path}/killed", 6) == _final_loss(f"{tmp_path}/straight", 6)


def test_lora_adapters_train_with_muon():
    argv = [*SMALL, "opt_type=muon", "lora_rank=4"]
    split = _split(argv)
    assert split and all(d is not None for d in split.values())  # the adapters' matrices; no AdamW half
    assert all(k[-1].endswith(("_lora_a", "_lora_b")) for k in split)
    losses, _ = train_losses([*argv, "learning_rate=0.01", "per_device_batch_size=4"], 1, 3)
    assert np.isfinite(losses).all()
