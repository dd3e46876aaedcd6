"""Multi-token prediction (maxlite/models/mtp.py): no prediction across a packed document's boundary,
SFT's loss mask respected, the loss scaled into the objective and reported apart, decoding
untouched."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxlite import api, config as C
from maxlite import step as step_lib
from maxlite.generate import Sampling, generate_ids
from maxlite.models import mtp

T = 16
KEYS = ["base.yml", "decoder_block=deepseek", "attention_type=mla", "base_emb_dim=32", "base_mlp_dim=48",
        "base_num_query_heads=2", "base_num_kv_heads=2", "base_num_decoder_layers=2", "vocab_size=128",
        "q_lora_rank=16", "kv_lora_rank=16", "qk_nope_head_dim=8", "qk_rope_head_dim=8", "v_head_dim=8",
        "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=16", "shared_experts=1",
        "first_num_dense_layers=1", "dtype=float32", f"max_target_length={T}", "mtp_num_layers=1",
        "mtp_loss_scaling_factor=0.3", "init_scale=0.3", "load_balance_loss_weight=0"]


@pytest.fixture(scope="module")
def model():
    return api.create_model(C.load(KEYS), seed=1)


def _batch(tokens, seg, weights=None):
    """A packed batch as the data pipeline makes it: positions restart with each document, a target
    weighs (its `weights`, else 1) only where it is the next token of the same document."""
    tokens, seg = np.asarray(tokens, np.int32), np.asarray(seg, np.int32)
    positions = np.zeros_like(seg)
    for t in range(1, T):
        positions[:, t] = np.where(seg[:, t] == seg[:, t - 1], positions[:, t - 1] + 1, 0)
    targets = np.concatenate([tokens[:, 1:], np.zeros((len(tokens), 1), np.int32)], axis=1)
    w = np.ones(seg.shape, np.float32) if weights is None else np.asarray(weights, np.float32)
    w = w * (seg != 0) * np.concatenate([seg[:, 1:] == seg[:, :-1], np.zeros((len(seg), 1), bool)], axis=1)
    return {k: jnp.asarray(v) for k, v in dict(inputs=tokens, targets=targets, positions=positions,
                                                segment_ids=seg, weights=w).items()}


@nnx.jit
def _jitted_loss(model, batch):
    x, _ = model.forward(batch["inputs"], batch["positions"], batch["segment_ids"])
    return mtp.loss(model, x, batch)[0]


def _mtp_loss(model, batch):
    return float(_jitted_loss(model, batch)), batch


def _valid(batch):
    """Positions whose depth-1 target (token i + 2) is in their document and weighted."""
    seg, w = np.asarray(batch["segment_ids"]), np.asarray(batch["weights"])
    return int(np.sum(w[:, 1:] * (seg[:, 1:] == seg[:, :-1])))


def test_a_packed_row_predicts_within_each_document_only(model):
    """The packed row's loss is the two documents' losses pooled by their counted positions: no
    position predicts into the next document, nor attends to it."""
    rng = np.random.default_rng(0)
    a, b = rng.integers(1, 128, 7), rng.integers(1, 128, 9)
    packed = _batch([np.r_[a, b]], [[1] * 7 + [2] * 9])
    alone_a = _batch([np.r_[a, np.zeros(9, int)]], [[1] * 7 + [0] * 9])
    alone_b = _batch([np.r_[b, np.zeros(7, int)]], [[1] * 9 + [0] * 7])
    (la, ba), (lb, bb), (lp, bp) = (_mtp_loss(model, x) for x in (alone_a, alone_b, packed))
    assert _valid(bp) == _valid(ba) + _valid(bb) == (7 - 2) + (9 - 2)
    np.testing.assert_allclose(lp, (la * _valid(ba) + lb * _valid(bb)) / _valid(bp), rtol=1e-5)


def test_the_loss_mask_decides_which_targets_count(model):
    """A target the SFT mask leaves out can be anything; one it keeps changes the loss."""
    weights = np.ones((1, T), np.float32)
    weights[0, :8] = 0  # the prompt's targets carry no loss
    batch = _batch(np.random.default_rng(1).integers(1, 128, (1, T)), np.ones((1, T)), weights)
    base = _mtp_loss(model, batch)[0]
    for t, counts in ((5, False), (12, True)):  # targets[t]: depth 1's target at position t - 1
        changed = dict(batch, targets=batch["targets"].at[0, t].set((batch["targets"][0, t] + 1) % 127 + 1))
        assert (_mtp_loss(model, changed)[0] != base) == counts, t


def test_the_objective_adds_the_scaled_loss_and_reports_it(model):
    batch = _batch(np.random.default_rng(2).integers(1, 128, (2, T)), np.ones((2, T)))
    graphdef, params = nnx.split(model, nnx.Param)
    loss_sum, (sums, tokens) = jax.jit(step_lib.loss_sums, static_argnums=1)(params, graphdef, batch)
    np.testing.assert_allclose(float(sums["mtp_loss"] / tokens), _mtp_loss(model, batch)[0], rtol=1e-5)
    np.testing.assert_allclose(float(loss_sum - sums["loss"]), 0.3 * float(sums["mtp_loss"]), rtol=1e-4)


def test_decoding_ignores_the_extra_depths(model):
    """The same weights without their prediction depths decode the same tokens."""
    graphdef, params = nnx.split(model, nnx.Param)
    plain = dataclasses.replace(model.cfg, mtp_num_layers=0)
    pure = nnx.to_pure_dict(params)
    pure.pop("mtp")
    _, plain_params = nnx.split(api.create_model(plain, seed=1), nnx.Param)
    nnx.replace_by_pure_dict(plain_params, pure)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    assert (generate_ids(model.cfg, params, prompts, Sampling(max_new_tokens=6)).tokens
            == generate_ids(plain, plain_params, prompts, Sampling(max_new_tokens=6)).tokens)
    jax.clear_caches()
