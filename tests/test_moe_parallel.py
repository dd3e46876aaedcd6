"""maxlite/models/moe_parallel.py: expert parallelism on 8 simulated CPU devices (expert 4 × fsdp 2)
trains like one device: the experts split over `expert`, each device's tokens sent to their experts
by all-to-all and back, dropless (ragged, with DeepSeek-V3's layer: latent attention, DeepSeekMoE
routing with its bias moved by the global expert load, a multi-token-prediction depth) and with
fixed capacity buffers (capacity, softmax routing). Same losses
over two steps, relative 1e-5 (float32: only the order of sums differs), and the same weights
after them. A checkpoint saved at expert 4 restores at expert 2 and trains on as the saving run."""

import jax
import numpy as np
import pytest

from maxlite import state as state_lib
from maxlite.checkpoints.saver import Checkpointer
from maxlite.data.synthetic import make_synthetic_iterator
from tests.helpers import MOE, SMALL, build, start_built, train_losses


# DeepSeekMoE routing: sigmoid, groups, scaled weights, a shared expert, the sequence-wise loss and the
# routing bias moved by each step's global expert load (the same on every mesh)
DEEPSEEK = ["routed_score_func=sigmoid", "routed_bias=true", "routed_bias_update_rate=0.01", "n_routing_groups=4",
            "topk_routing_group=2", "routed_scaling_factor=2.5", "routed_seq_aux_loss_weight=0.01", "shared_experts=1"]


# DeepSeek-V3's whole layer: latent attention and a multi-token-prediction depth (its MoE layer balanced too)
MLA_MTP = ["attention_type=mla", "q_lora_rank=16", "kv_lora_rank=16", "qk_nope_head_dim=8", "qk_rope_head_dim=8",
           "v_head_dim=8", "mtp_num_layers=1"]


@pytest.mark.parametrize("impl, routing", [("ragged", DEEPSEEK + MLA_MTP), ("capacity", [])], ids=["ragged", "capacity"])
def test_expert_parallel_training_equals_one_device(impl, routing):
    extra = [f"moe_implementation={impl}", *routing] + (["capacity_factor=1.0"] if impl == "capacity" else [])
    one, state_one = train_losses(MOE + extra + ["per_device_batch_size=8", "ici_fsdp_parallelism=1"], 1, 2)
    ep, state_ep = train_losses(MOE + extra + ["per_device_batch_size=1", "ici_expert_parallelism=4",
                                               "ici_fsdp_parallelism=2"], 8, 2)
    np.testing.assert_allclose(ep, one, rtol=1e-5)
    assert one[1] != one[0]  # it trained: the loss moved
    for a, b in zip(jax.tree.leaves(state_ep.params), jax.tree.leaves(state_one.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def _experts_per_device(params) -> int:
    """How many experts of a layer's gate one device holds."""
    [gate] = [x for path, x in jax.tree_util.tree_leaves_with_path(params) if "gate" in jax.tree_util.keystr(path)]
    return gate.sharding.shard_shape(gate.shape)[-3]  # [layers, E, D, F]


def test_a_checkpoint_saved_at_expert_4_restores_at_expert_2(tmp_path):
    """Two steps at expert 4 × fsdp 2, saved; restored at expert 2 × fsdp 4: the same values
    bitwise, each device now holding 4 experts instead of 2, and the next step's loss equals the
    saving run's next step (relative 1e-5, float32: only the order of sums differs)."""
    moe = [*MOE[1:], "moe_implementation=ragged", "per_device_batch_size=1", "run_name=ep"]
    ep4, ep2 = ["ici_expert_parallelism=4", "ici_fsdp_parallelism=2"], ["ici_expert_parallelism=2", "ici_fsdp_parallelism=4"]
    cfg, _, state, step, sharding = build([*SMALL, f"base_output_directory={tmp_path}/runs", *moe, *ep4], 8)
    data = make_synthetic_iterator(cfg, "train", 0, 1)
    put = lambda batch, where: {k: jax.device_put(v, where) for k, v in batch.items()}  # noqa: E731
    for _ in range(2):
        state, _ = step(state, put(next(data), sharding))
    saver = Checkpointer(cfg, True, state_lib.nbytes(state))
    assert saver.save(2, state, data)
    saver.close()
    want = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]
    assert _experts_per_device(state.params) == 2
    _, went_on = step(state, put(next(data), sharding))  # the saving run's third step

    built, started, data2, c = start_built(tmp_path, [*moe, *ep2], 8)
    c.close()
    assert (started.step, started.source) == (2, "checkpoint")
    got = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(started.state))]
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
    assert _experts_per_device(started.state.params) == 4
    _, resumed = built.train_step(started.state, put(next(data2), built.batch_sharding))
    np.testing.assert_allclose(float(resumed["loss"]), float(went_on["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(resumed["moe_lb_loss"]), float(went_on["moe_lb_loss"]), rtol=1e-5)


def _kept_by_capped_buffers(experts_BTk, ep: int, El: int, R: int) -> np.ndarray:
    """Which assignments a receive buffer of R rows keeps, from the rule: rows of row b (the device
    at expert index b % ep of its group b // ep) sorted by expert (stably), each destination's
    buffer filled source after source, a source's rows for it cut where the buffer ends."""
    B, T, k = experts_BTk.shape
    kept = np.ones((B, T * k), bool)
    for group in range(B // ep):
        rows = [group * ep + e for e in range(ep)]
        for d in range(ep):
            filled = 0
            for b in rows:
                flat = experts_BTk[b].reshape(-1)
                mine = [i for i in np.argsort(flat, kind="stable") if flat[i] // El == d]
                fit = max(0, min(len(mine), R - filled))
                kept[b, mine[fit:]] = False
                filled += len(mine)
    return kept.reshape(B, T, k)


def test_capped_receive_buffers_drop_each_senders_last_rows_and_count_them():
    """ragged_buffer_factor=1 at expert 4 × fsdp 2 (a buffer of one balanced routing's rows): the
    experts' output equals one device's with exactly the assignments the rule drops set to weight
    0, and the count of dropped assignments is theirs; factor 4 (every sender's rows) drops none."""
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import AxisType, Mesh

    from maxlite import config as C, mesh as mesh_lib
    from maxlite.models import moe, moe_kernels, moe_parallel
    from maxlite.models.layers import glu

    E, k, T, D, F = 8, 2, 8, 16, 8
    cfg = C.load([*MOE, f"num_experts={E}", f"num_experts_per_tok={k}", f"base_emb_dim={D}"])
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(0, 1, (8, T, D)), jnp.float32)
    router = jnp.asarray(rng.normal(0, 1, (D, E)) + np.array([2.0, 1.5, 0, 0, 0, 0, 0, 0]), jnp.float32)
    gate, up, down = (jnp.asarray(rng.normal(0, 0.3, s), jnp.float32) for s in ((E, D, F), (E, D, F), (E, F, D)))
    routing = moe.route(cfg, x, router, None, jnp.ones((8, T), bool), 0)
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(1, 1, 2, 1, 4, 1), mesh_lib.MESH_AXES,
                axis_types=(AxisType.Auto,) * len(mesh_lib.MESH_AXES))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        run = jax.jit(lambda f: moe_parallel.experts("ragged", x, routing, 0, gate, up, down, glu(cfg), f),
                      static_argnums=0)
        capped, dropped = run(1.0)
        whole, none = run(4.0)
    kept = _kept_by_capped_buffers(np.asarray(routing.experts_BTk), 4, E // 4, T * k)
    assert 0 < (~kept).sum() < kept.size // 4  # the case the test is about: some, not most, dropped
    assert float(dropped) == (~kept).sum() and float(none) == 0
    want = moe_kernels.dense(x, routing._replace(weights_BTk=routing.weights_BTk * kept), gate, up, down, glu(cfg))
    np.testing.assert_allclose(np.asarray(capped), np.asarray(want), rtol=1e-5, atol=1e-5)
    full = moe_kernels.dense(x, routing, gate, up, down, glu(cfg))
    np.testing.assert_allclose(np.asarray(whole), np.asarray(full), rtol=1e-5, atol=1e-5)
