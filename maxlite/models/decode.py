"""Decoding with a KV cache: the prompt in one pass (prefill), then one token per step inside one
compiled loop.

Shape legend as in layers.py, plus S cache length (prompt + new tokens) and L layers.
Prompts are right-padded: row b's tokens sit at positions [0, len_b) and generation writes position
len_b on, so a query at position p sees key j iff j <= p — one rule for prefill and decode (padding
written past len_b is overwritten before any query can see it). The cache holds the K/V heads only
(GQA: K of them, not N), per layer [B, S, K, H] in the compute dtype, stacked to [L, B, S, K, H].
The blocks are the training blocks (`Attention.qkv`/`out`, the same norms and MLPs): what was
trained is what decodes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from maxlite.models.families import family
from maxlite.models.layers import constrain

# the cache's logical axes: K/V heads split like the attention's (tensor), layers and batch not split
CACHE_AXES = ("layers", "activation_batch", "activation_length", "activation_kv_heads", "head_dim")


class Cache(NamedTuple):
    k_LBSKH: jax.Array
    v_LBSKH: jax.Array


def empty_cache(cfg, batch: int, length: int) -> Cache:
    shape = (cfg.base_num_decoder_layers, batch, length, cfg.base_num_kv_heads, cfg.head_dim)
    zeros = lambda: constrain(jnp.zeros(shape, jnp.dtype(cfg.dtype)), CACHE_AXES)  # noqa: E731
    return Cache(zeros(), zeros())


def cache_bytes(cfg, batch: int, length: int) -> int:
    """K and V for every layer: 2·L·B·S·K·H elements of the compute dtype."""
    return (2 * cfg.base_num_decoder_layers * batch * length * cfg.base_num_kv_heads * cfg.head_dim
            * jnp.dtype(cfg.dtype).itemsize)


def _write(cache_BSKH, new_BTKH, positions_BT):
    """The T new entries of each row written at their positions (rows may sit at different ones)."""
    S = cache_BSKH.shape[1]
    onehot_BTS = (positions_BT[:, :, None] == jnp.arange(S)).astype(cache_BSKH.dtype)
    keep_BS = 1 - jnp.max(onehot_BTS, axis=1)
    return (cache_BSKH * keep_BS[:, :, None, None]
            + jnp.einsum("bts,btkh->bskh", onehot_BTS, new_BTKH.astype(cache_BSKH.dtype)))


def _attend(q_BTNH, k_BSKH, v_BSKH, positions_BT):
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    scores_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH).astype(jnp.float32) / math.sqrt(H)
    visible_BTS = jnp.arange(k_BSKH.shape[1]) <= positions_BT[:, :, None]
    scores_BKGTS = jnp.where(visible_BTS[:, None, None], scores_BKGTS, jnp.finfo(jnp.float32).min)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(v_BSKH.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS, v_BSKH).reshape(B, T, N, H)


def _block(layer, x_BTD, positions_BT, k_BSKH, v_BSKH):
    q_BTNH, k_new, v_new = layer.attn.qkv(layer.attn_norm(x_BTD), positions_BT)
    k_BSKH, v_BSKH = (constrain(_write(c, new, positions_BT), CACHE_AXES[1:])
                      for c, new in ((k_BSKH, k_new), (v_BSKH, v_new)))
    x_BTD = x_BTD + layer.attn.out(_attend(q_BTNH, k_BSKH, v_BSKH, positions_BT))
    return x_BTD + layer.mlp(layer.mlp_norm(x_BTD)), k_BSKH, v_BSKH


def forward(model, tokens_BT, positions_BT, cache: Cache) -> tuple[jax.Array, Cache]:
    """(final-normed hidden states x_BTD, the cache with these T tokens written in)."""
    cfg = model.cfg
    dt = jnp.dtype(cfg.dtype)
    x_BTD = jnp.take(model.embedding[...], tokens_BT, axis=0).astype(dt)
    if family(cfg).positions == "learned":
        x_BTD = x_BTD + jnp.take(model.positions[...], positions_BT, axis=0).astype(dt)
    if cfg.scan_layers:
        def body(x, layer, k, v, positions):
            x, k, v = _block(layer, x, positions, k, v)
            return x, (k, v)
        scan = nnx.scan(body, in_axes=(nnx.Carry, 0, 0, 0, None), out_axes=(nnx.Carry, 0),
                        transform_metadata={nnx.PARTITION_NAME: "layers"})
        x_BTD, (k_LBSKH, v_LBSKH) = scan(x_BTD, model.layers, cache.k_LBSKH, cache.v_LBSKH, positions_BT)
    else:
        ks, vs = [], []
        for i, layer in enumerate(model.layers):
            x_BTD, k, v = _block(layer, x_BTD, positions_BT, cache.k_LBSKH[i], cache.v_LBSKH[i])
            ks.append(k)
            vs.append(v)
        k_LBSKH, v_LBSKH = jnp.stack(ks), jnp.stack(vs)
    return model.final_norm(x_BTD), Cache(k_LBSKH, v_LBSKH)


def sample(logits_BV, key, temperature: float, top_k: int, top_p: float):
    """One token per row: greedy at temperature 0, else from softmax(logits / T) cut to the top k
    and to the smallest set of top tokens holding probability top_p."""
    if temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV.astype(jnp.float32) / temperature
    lowest = jnp.finfo(jnp.float32).min
    if top_k > 0:
        kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, lowest, logits_BV)
    if top_p < 1.0:
        sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # mass of the tokens ranked above
        cutoff_B1 = jnp.min(jnp.where(before_BV < top_p, sorted_BV, jnp.inf), axis=-1, keepdims=True)
        logits_BV = jnp.where(logits_BV < cutoff_B1, lowest, logits_BV)
    return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


def generate_tokens(graphdef, params, prompt_BP, lengths_B, key, *, max_new_tokens: int,
                    temperature: float, top_k: int, top_p: float, eos_id: int):
    """(new tokens [B, max_new_tokens] — `eos_id` after a row's end —, number of decode steps run).

    Jit it with everything after `key` static; the loop stops when every row has ended."""
    model = nnx.merge(graphdef, params)
    B, P = prompt_BP.shape
    cache = empty_cache(model.cfg, B, P + max_new_tokens)
    x_BPD, cache = forward(model, prompt_BP, jnp.broadcast_to(jnp.arange(P), (B, P)), cache)
    x_B1D = jnp.take_along_axis(x_BPD, (lengths_B - 1)[:, None, None], axis=1)
    key, sub = jax.random.split(key)
    token_B = sample(model.logits(x_B1D)[:, 0], sub, temperature, top_k, top_p)
    out_BN = jnp.full((B, max_new_tokens), eos_id, jnp.int32).at[:, 0].set(token_B)
    # the params ride in the loop state: NNX modules are rebuilt at the loop body's trace level
    state = (jnp.int32(1), token_B, lengths_B, token_B == eos_id, cache, out_BN, key, params)

    def running(s):
        i, _, _, done_B, _, _, _, _ = s
        return (i < max_new_tokens) & ~jnp.all(done_B)

    def step(s):
        i, token_B, pos_B, done_B, cache, out_BN, key, params = s
        model = nnx.merge(graphdef, params)
        x_B1D, cache = forward(model, token_B[:, None], pos_B[:, None], cache)
        key, sub = jax.random.split(key)
        nxt_B = sample(model.logits(x_B1D)[:, 0], sub, temperature, top_k, top_p)
        nxt_B = jnp.where(done_B, eos_id, nxt_B)
        out_BN = jax.lax.dynamic_update_slice(out_BN, nxt_B[:, None], (0, i))
        return i + 1, nxt_B, pos_B + 1, done_B | (nxt_B == eos_id), cache, out_BN, key, params

    steps, _, _, _, _, out_BN, _, _ = jax.lax.while_loop(running, step, state)
    return out_BN, steps
