"""Llama 4's ideas as kinds and traits, each against an independent reference (the whole family against
transformers: tests/test_bridge_hf_families.py, tests/test_hf_parity.py): chunked attention against a
per-query loop in every implementation (packed documents chunked from their own starts), its FLOPs against a count of the pairs
it sees, the router's weight on the expert's input against a per-token loop in every dropless
implementation, and what is refused in one line."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxlite import config as C
from maxlite.models import attention
from maxlite.models.kinds import attention_core_flops
from maxlite.models.moe import MoE
from tests.helpers import value_and_grads

CHUNK = 8


def _loop_attention(q, k, v, pos, seg, chunk):
    """Query by query in numpy: softmax over the keys j ≤ i of its document whose position lies in its
    own chunk (pos // chunk equal), kv heads repeated."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, N, H = q.shape
    G = N // k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        for i in range(T):
            keys = [j for j in range(i + 1) if seg[b, j] == seg[b, i] and pos[b, j] // chunk == pos[b, i] // chunk]
            for n in range(N):
                s = np.array([q[b, i, n] @ k[b, j, n // G] for j in keys]) / np.sqrt(H)
                p = np.exp(s - s.max())
                out[b, i, n] = (p / p.sum()) @ v[b, keys, n // G]
    return out


@pytest.mark.parametrize("impl", ["dot_product", "blockwise", "flash"])
def test_chunked_attention_equals_a_per_query_loop_with_documents_chunked_from_their_starts(impl):
    """Every implementation (blockwise in blocks of 32 over chunks of 16: the offsets the window reaches;
    splash in the Pallas interpreter), a second document starting off every chunk and block boundary."""
    B, T, N, K, H, chunk = 2, 128, 4, 2, 8, 16
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(0, 1, (B, T, n, H)).astype(np.float32) for n in (N, K, K))
    seg = np.ones((B, T), np.int32)
    seg[0, 37:] = 2  # its chunks start at 37, 53, ...
    pos = np.stack([np.concatenate([np.arange(37), np.arange(T - 37)]), np.arange(T)]).astype(np.int32)
    cfg = C.load(["base.yml", "model_name=tiny", f"attention={impl}", "attention_block_size=32", "dtype=float32"])
    got = attention.attend(cfg, *(jnp.asarray(a) for a in (q, k, v, seg)), window=chunk, chunk=chunk,
                           positions_BT=jnp.asarray(pos))
    np.testing.assert_allclose(got, _loop_attention(q, k, v, pos, seg, chunk), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("T, chunk", [(64, 8), (40, 8), (64, 64), (16, 32)])
def test_chunked_attention_flops_count_the_pairs_it_sees(T, chunk):
    """4·B·N·H per visible (query, key) pair, counted from the mask; T·C/2 when C divides T (each
    chunk's causal half, the diagonal counted as half as for global layers)."""
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    pairs = int(((j <= i) & (i // chunk == j // chunk)).sum())
    flops = attention_core_flops(1, T, 1, 1, window=chunk, chunk=chunk)
    if T % chunk == 0 or chunk >= T:
        assert flops == pytest.approx(4 * (pairs - T / 2))  # the same convention as T²/2 for a causal layer
    else:
        assert flops == pytest.approx(4 * (pairs - T / 2), rel=0.1)


D, E, F, B, T = 16, 4, 8, 2, 6


def _llama4_moe_cfg(**overrides):
    argv = ["base.yml", "model_name=llama4-scout-17b-16e", "dtype=float32", f"base_emb_dim={D}",
            f"base_moe_mlp_dim={F}", f"num_experts={E}", "base_num_query_heads=2", "base_num_kv_heads=1",
            "head_dim=8", "base_mlp_dim=16", "vocab_size=64", "base_num_decoder_layers=4", "max_target_length=8"]
    return C.load(argv + [f"{k}={v}" for k, v in overrides.items()])


def _loop_moe(p, x_BTD):
    """Token by token: the top-1 logit's sigmoid w, the chosen expert's SwiGLU of w·x, plus the shared
    expert's SwiGLU of x (Llama 4's layer, as transformers computes it)."""
    def swiglu(x, gate, up, down):
        return (jax.nn.silu(x @ gate) * (x @ up)) @ down

    def one(x):
        logits = x @ p["router"]
        e = jnp.argmax(jax.lax.stop_gradient(logits))
        w = jax.nn.sigmoid(logits[e])
        return swiglu(w * x, p["gate"][e], p["up"][e], p["down"][e]) + swiglu(x, p["s_gate"], p["s_up"], p["s_down"])
    return jax.vmap(jax.vmap(one))(x_BTD)


@pytest.mark.parametrize("impl", ["dense", "ragged", "blocked"])
def test_the_router_weight_on_the_expert_input_equals_a_per_token_loop(impl):
    cfg = _llama4_moe_cfg(moe_implementation=impl)
    with nnx.use_eager_sharding(False):
        layer = MoE(cfg, rngs=nnx.Rngs(0))
    layer.router[...] = layer.router[...] * 5.0  # apart enough for no near-ties, weights well below 1
    names = {"router": layer.router, "gate": layer.gate, "up": layer.up, "down": layer.down,
             "s_gate": layer.shared.gate, "s_up": layer.shared.up, "s_down": layer.shared.down}
    params = {n: v[...] for n, v in names.items()}
    graphdef, state = nnx.split(layer)

    def ours(p, x):
        module = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
        for n, v in p.items():
            target = module.shared if n.startswith("s_") else module
            getattr(target, n.removeprefix("s_"))[...] = v
        return module.routed(x)[0]

    x = jnp.asarray(np.random.default_rng(0).normal(0, 1, (B, T, D)).astype(np.float32))
    value, (g_p, g_x) = value_and_grads(jax.jit(ours), params, x)
    ref, (r_p, r_x) = value_and_grads(jax.jit(_loop_moe), params, x)
    np.testing.assert_allclose(value, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g_x, r_x, rtol=1e-4, atol=1e-5)
    for n in params:  # the router's gradient flows through the weight on the input
        np.testing.assert_allclose(g_p[n], r_p[n], rtol=1e-4, atol=1e-5, err_msg=n)
    weights = jax.nn.sigmoid(jnp.max(x @ params["router"], axis=-1))
    assert float(jnp.mean(1 - weights)) > 0.2  # the weight matters: scaling the input or the output differ


@pytest.mark.parametrize("argv, message", [
    (["model_name=llama4-scout-17b-16e", "attention=cudnn_flash"],
     "attention=cudnn_flash: cuDNN's packed layout counts documents, not the chunks"),
    (["model_name=llama4-scout-17b-16e", "sliding_window=16"], "not both (set sliding_window=0)"),
    (["model_name=llama4-scout-17b-16e", "chunk_attn_window_size=0"], "need chunk_attn_window_size > 0"),
    (["model_name=tiny", "chunk_attn_window_size=8"], "no layer of decoder_block=llama2 is chunked"),
    (["model_name=llama4-scout-17b-16e", "num_experts_per_tok=2"],
     "routed_weight_on_input=true with num_experts_per_tok=2"),
])
def test_what_llama4_cannot_run_is_refused_in_one_line(argv, message):
    with pytest.raises(C.ConfigError, match=re.escape(message)):
        C.load(["base.yml", *argv])


def test_chunked_layers_refuse_context_parallelism():
    with pytest.raises(C.ConfigError, match=re.escape("does not split chunked-attention layers")):
        C.resolve(C.load(["base.yml", "model_name=llama4-scout-17b-16e", "ici_context_parallelism=2"]), 2)


def test_chunked_layers_of_another_family_are_not_exported_as_it(tmp_path):
    """A llama2 recipe with chunked layers has no Llama architecture to go to: one line, nothing written."""
    from maxlite.bridge import hf, params as P

    cfg = C.load(["base.yml", "model_name=tiny", "chunk_attn_window_size=8", "base_num_decoder_layers=2",
                  "layer_types=[chunked_attention, full_attention]"])
    with pytest.raises(ValueError, match="chunked-attention layers are Llama 4's"):
        hf.export_hf(cfg, P.random_params(cfg), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def _small_llama4():
    from maxlite import api

    cfg = C.load(["base.yml", "model_name=llama4-scout-17b-16e", "dtype=float32", "base_emb_dim=32",
                  "base_mlp_dim=32", "base_moe_mlp_dim=16", "num_experts=4", "base_num_query_heads=2",
                  "base_num_kv_heads=1", "head_dim=16", "base_num_decoder_layers=4", "vocab_size=64",
                  f"chunk_attn_window_size={CHUNK}", "temperature_tuning_floor_scale=4", "max_target_length=32",
                  "interleave_moe_layer_step=2", "init_scale=0.3"])
    return cfg, api.create_model(cfg, seed=0)


def test_decoding_in_steps_of_several_tokens_across_chunk_boundaries_equals_training():
    """A prefill of 6 tokens, then steps of 5, 4 and 1 tokens (the chunked layers' ring of 8 slots
    written past its wrap while a step's own earlier queries still read it, chunk boundaries inside
    steps) give training's final hidden states on the whole sequence, row by row (rows of different
    lengths: the shorter one padded in every step)."""
    from maxlite.models import decode

    cfg, model = _small_llama4()
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 64, (2, 16)).astype(np.int32)
    lengths = np.array([16, 13])
    # compiled, as the sampler runs them (op by op, this test compiled 781 small programs: 22.6 CPU-seconds)
    hidden = nnx.jit(lambda m, *args: m.hidden(*args))
    full = np.asarray(hidden(model, tokens, np.broadcast_to(np.arange(16), (2, 16)), np.ones((2, 16), np.int32)))
    cache = decode.empty_cache(cfg, 2, 16)
    start, got = 0, []
    for n in (6, 5, 4, 1):
        span = np.arange(start, start + n)
        lens = np.minimum(lengths, start + n)
        prefill = decode.prefill_config(cfg, n) if start == 0 else None
        step = nnx.jit(lambda m, *args, prefill=prefill: decode.forward(m, *args, prefill))
        x, cache = step(model, tokens[:, span], np.broadcast_to(span, (2, n)), jnp.asarray(lens), cache)
        got.append(np.asarray(x))
        start += n
    got = np.concatenate(got, axis=1)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(got[b, :n], full[b, :n], rtol=1e-4, atol=1e-5)


def test_a_packed_row_trains_as_its_documents_one_by_one():
    """Training's forward on two documents packed in one row equals each document alone: the chunks,
    the temperature and RoPE follow each document's own positions."""
    cfg, model = _small_llama4()
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 64, 13), rng.integers(0, 64, 19)
    row = np.concatenate([a, b])[None]
    pos = np.concatenate([np.arange(13), np.arange(19)])[None]
    seg = np.concatenate([np.ones(13), 2 * np.ones(19)]).astype(np.int32)[None]
    packed = np.asarray(model(row, pos, seg))
    for doc, span in ((a, slice(0, 13)), (b, slice(13, 32))):
        alone = np.asarray(model(doc[None], np.arange(len(doc))[None], np.ones((1, len(doc)), np.int32)))
        np.testing.assert_allclose(packed[:, span], alone, rtol=1e-5, atol=1e-5)
