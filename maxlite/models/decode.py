"""Decoding with a KV cache: the prompt in one pass (prefill), then one token per step inside one
compiled loop.

Shape legend as in layers.py, plus S cache slots and L layers. Prompts are right-padded: row b's
tokens sit at positions [0, len_b) and generation writes position len_b on. The cache holds the K/V
heads only (GQA: K of them, not N) in the compute dtype, one stack per kind of layer
(`families.layer_windows`): global layers keep every position (S = prompt + new tokens), a
sliding-window layer only its last W (S = min(W, prompt + new tokens)) as a ring: position p lives
in slot p mod S, and each stack records the position in every slot (-1: empty). A step's queries
attend to the cache as it was plus the step's own keys, under one rule: key position j is visible
to query position p iff 0 ≤ j ≤ p (and p − j < W in a window); padding past len_b is never
written. The prefill runs the training attention (maxlite.models.attention.attend: blockwise,
splash, cuDNN, and with context parallelism the prompt split over the context axis like a training
sequence, without load balance), so a long prompt never builds its [P, P] scores; new keys go into
their slots by a scatter, never a [T, S] one-hot. The blocks are the training blocks (`Attention.qkv`/`out`, `Block.add_attention`/
`add_mlp`): what was trained is what decodes. A model whose layers differ in window (Gemma 3)
runs its layers one by one (sliced out of a scanned stack); the others scan as they train.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from maxlite.models import attention, context, matmul
from maxlite.models.families import layer_stacks, layer_windows
from maxlite.models.layers import constrain
from maxlite.models.names import resolve_attention
from maxlite.models.platform import target_platform

# the cache's logical axes: K/V heads split like the attention's (tensor), layers and batch not split
CACHE_AXES = ("layers", "activation_batch", "activation_length", "activation_kv_heads", "head_dim")


class Stack(NamedTuple):
    """The cache of every layer with one window: K and V [L_w, B, S, K, H], slot positions [B, S]."""
    k_LBSKH: jax.Array
    v_LBSKH: jax.Array
    pos_BS: jax.Array


class Cache(NamedTuple):
    stacks: dict  # window (0: global) → Stack


def layer_groups(cfg) -> dict[int, list[int]]:
    """window → the layers with it, in order."""
    groups: dict[int, list[int]] = {}
    for i, window in enumerate(layer_windows(cfg)):
        groups.setdefault(window, []).append(i)
    return groups


def slots(window: int, length: int) -> int:
    return min(window, length) if window else length


def empty_cache(cfg, batch: int, length: int) -> Cache:
    def stack(window, layers):
        shape = (len(layers), batch, slots(window, length), cfg.base_num_kv_heads, cfg.head_dim)
        zeros = lambda: constrain(jnp.zeros(shape, jnp.dtype(cfg.dtype)), CACHE_AXES)  # noqa: E731
        return Stack(zeros(), zeros(), jnp.full(shape[1:3], -1, jnp.int32))
    return Cache({w: stack(w, layers) for w, layers in layer_groups(cfg).items()})


def cache_bytes(cfg, batch: int, length: int) -> int:
    """K and V for every layer: 2·B·K·H elements of the compute dtype per layer and slot."""
    return sum(2 * len(layers) * batch * slots(w, length) * cfg.base_num_kv_heads * cfg.head_dim
               * jnp.dtype(cfg.dtype).itemsize for w, layers in layer_groups(cfg).items())


def _slots(positions_BT, lengths_B, size: int):
    """The slot each new token goes to [B, T]: its position mod S, for the last S real tokens
    (position < len_b) only, so no two of them collide; `size` (past the end: dropped) for the rest,
    so padding is never written."""
    valid_BT = (positions_BT < lengths_B[:, None]) & (positions_BT >= lengths_B[:, None] - size)
    return jnp.where(valid_BT, positions_BT % size, size)


def _write(cache_BS, new_BT, slots_BT):
    """cache[b, slots[b, t]] = new[b, t] (slots past the end dropped)."""
    rows_B1 = jnp.arange(cache_BS.shape[0])[:, None]
    return cache_BS.at[rows_B1, slots_BT].set(new_BT.astype(cache_BS.dtype), mode="drop")


def _attend(q_BTNH, k_BSKH, v_BSKH, kpos_BS, qpos_BT, window: int, scale: float):
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    scores_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH).astype(jnp.float32) * scale
    kpos, qpos = kpos_BS[:, None, :], qpos_BT[:, :, None]
    visible_BTS = (kpos >= 0) & (kpos <= qpos)
    if window:
        visible_BTS &= qpos - kpos < window
    scores_BKGTS = jnp.where(visible_BTS[:, None, None], scores_BKGTS, jnp.finfo(jnp.float32).min)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(v_BSKH.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS, v_BSKH).reshape(B, T, N, H)


def _tile(cfg, impl: str) -> int:
    """The block an implementation cuts the sequence into (1: any length)."""
    if impl == "blockwise":
        return cfg.attention_block_size
    if impl == "flash":
        return max(getattr(cfg, f"sa_{k}") for k in attention._SPLASH_KEYS)
    return 1


def _implementation(cfg, length: int, shards: int) -> str:
    impl = cfg.attention
    if impl == "autoselected":
        impl = resolve_attention(impl, target_platform(), length, cfg.attention_block_size, cfg.sa_block_q, shards)
    return impl


def prompt_length(cfg, length: int, shards: int = 1) -> int:
    """The length a batch of prompts of at most `length` tokens is padded to for the prefill: a
    multiple of `shards` (the context shards of the mesh), and of `shards` whole blocks of the
    attention when the prompt spans more than that, so the training attention tiles it."""
    unit = shards * _tile(cfg, _implementation(cfg, length, shards))
    unit = unit if length > unit else shards
    return -(-length // unit) * unit


def prefill_config(cfg, length: int, shards: int = 1):
    """The config the prefill attends with: the training attention where it tiles the prompt (else
    dot_product: a short prompt), never the load-balanced layout (a prompt keeps its order)."""
    impl = _implementation(cfg, length, shards)
    if length % shards or (length // shards) % min(_tile(cfg, impl), length // shards):
        impl = "dot_product"
    return dataclasses.replace(cfg, attention=impl, context_parallel_load_balance=False)


def _block(layer, x_BTD, positions_BT, slots_BT, k_BSKH, v_BSKH, pos_BS, window: int, prefill_cfg=None):
    """One layer over T new tokens: attention to (cache, new keys) — in the prefill, to the new
    keys alone (the cache is empty) through the training attention —, then the cache written."""
    q_BTNH, k_new, v_new = layer.attn.qkv(layer.attn_norm(x_BTD), positions_BT, local=bool(window))
    scale = layer.attn.query_scale or 1.0 / math.sqrt(q_BTNH.shape[-1])
    if prefill_cfg is not None:
        # right-padded rows: padding sits after every real token, so no real query sees it
        segment_ids_BT = jnp.ones(positions_BT.shape, jnp.int32)
        out_BTNH = attention.attend(prefill_cfg, q_BTNH, k_new, v_new, segment_ids_BT, window=window,
                                    scale=layer.attn.query_scale)
    else:
        keys, values = (jnp.concatenate([c, new.astype(c.dtype)], axis=1)
                        for c, new in ((k_BSKH, k_new), (v_BSKH, v_new)))
        kpos_BS = jnp.concatenate([pos_BS, positions_BT], axis=1)
        out_BTNH = _attend(q_BTNH, keys, values, kpos_BS, positions_BT, window, scale)
    x_BTD = layer.add_mlp(layer.add_attention(x_BTD, layer.attn.out(out_BTNH)))
    k_BSKH, v_BSKH = (constrain(_write(c, new, slots_BT), CACHE_AXES[1:]) for c, new in
                      ((k_BSKH, k_new), (v_BSKH, v_new)))
    return x_BTD, k_BSKH, v_BSKH


def forward(model, tokens_BT, positions_BT, lengths_B, cache: Cache, prefill_cfg=None) -> tuple[jax.Array, Cache]:
    """(final-normed hidden states x_BTD, the cache with these T tokens written in); `lengths_B`
    is each row's count of real tokens once these are in (tokens at positions ≥ it are padding).
    With `prefill_cfg` (`prefill_config`) the cache is empty and the tokens attend to each other
    through the training attention."""
    with matmul.quantization(model.cfg.quantization):  # as training runs the layers
        return _forward(model, tokens_BT, positions_BT, lengths_B, cache, prefill_cfg)


def _forward(model, tokens_BT, positions_BT, lengths_B, cache: Cache, prefill_cfg) -> tuple[jax.Array, Cache]:
    cfg = model.cfg
    x_BTD = model.embed(tokens_BT, positions_BT)
    groups = layer_groups(cfg)
    slots = {w: _slots(positions_BT, lengths_B, s.pos_BS.shape[1]) for w, s in cache.stacks.items()}
    stacks = layer_stacks(cfg)
    if cfg.scan_layers and len(groups) == 1 and len(stacks) == 1 and len(stacks[0].unit) == 1:
        # every layer alike and in one stack: scan them as training does
        (window, stack), = cache.stacks.items()

        def body(x, layer, k, v):
            x, k, v = _block(layer, x, positions_BT, slots[window], k, v, stack.pos_BS, window, prefill_cfg)
            return x, (k, v)
        scan = nnx.scan(body, in_axes=(nnx.Carry, 0, 0, 0), out_axes=(nnx.Carry, 0),
                        transform_metadata={nnx.PARTITION_NAME: "layers"})
        x_BTD, (k_LBSKH, v_LBSKH) = scan(x_BTD, model.layers, stack.k_LBSKH, stack.v_LBSKH)
        new = {window: (k_LBSKH, v_LBSKH)}
    else:
        layers, windows = model.blocks(), layer_windows(cfg)
        ks = {w: [] for w in groups}
        vs = {w: [] for w in groups}
        for i, layer in enumerate(layers):
            w = windows[i]
            j = len(ks[w])
            stack = cache.stacks[w]
            x_BTD, k, v = _block(layer, x_BTD, positions_BT, slots[w], stack.k_LBSKH[j], stack.v_LBSKH[j],
                                 stack.pos_BS, w, prefill_cfg)
            ks[w].append(k)
            vs[w].append(v)
        new = {w: (jnp.stack(ks[w]), jnp.stack(vs[w])) for w in groups}
    stacks = {w: Stack(*new[w], _write(s.pos_BS, positions_BT, slots[w])) for w, s in cache.stacks.items()}
    return model.final_norm(x_BTD), Cache(stacks)


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
    x_BPD, cache = forward(model, prompt_BP, jnp.broadcast_to(jnp.arange(P), (B, P)), lengths_B, cache,
                           prefill_config(model.cfg, P, context.shards()))
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
        x_B1D, cache = forward(model, token_B[:, None], pos_B[:, None], pos_B + 1, cache)
        key, sub = jax.random.split(key)
        nxt_B = sample(model.logits(x_B1D)[:, 0], sub, temperature, top_k, top_p)
        nxt_B = jnp.where(done_B, eos_id, nxt_B)
        out_BN = jax.lax.dynamic_update_slice(out_BN, nxt_B[:, None], (0, i))
        return i + 1, nxt_B, pos_B + 1, done_B | (nxt_B == eos_id), cache, out_BN, key, params

    steps, _, _, _, _, out_BN, _, _ = jax.lax.while_loop(running, step, state)
    return out_BN, steps
