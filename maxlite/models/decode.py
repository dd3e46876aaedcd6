"""Decoding with each layer's cache: the prompt in one pass (prefill), then one token per step inside
one compiled loop.

Prompts are right-padded: row b's tokens sit at positions [0, len_b) and generation writes position
len_b on. Each mixer kind owns its decode cache (maxlite/models/kinds.py `MixerKind.cache_module`:
grouped-query attention's K/V ring, maxlite/models/gqa_cache.py); the cache here holds one stack per
(mixer, variant) — the layers whose caches stack —, each a per-layer part [L, ...] and a part its
layers share. The blocks are the training blocks (`Block.mixer_input`/`add_attention`/`add_mlp` and
the mixer's own projections): what was trained is what decodes. A model whose layers all share one
(mixer, variant) and one stack scans them as training does; the others run layer by layer (sliced out
of their scanned stacks). The prefill runs the training attention (`prefill_config`). Each layer's
cache is updated inside its stack, which the loop carries (layer j of the stack: the scanned path
carries the stack and j, not the stack as scanned input and output, which XLA would copy whole each
step), so a decode step's work grows with the context only by its attention's read of the filled slots.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from maxlite.models import attention, context, matmul, paged_cache
from maxlite.models.cache_bits import load, store, viewed
from maxlite.models.carry import Carry, layer_inputs
from maxlite.models.kinds import MIXERS
from maxlite.models.layout import cache_groups, layer_kinds, layer_stacks
from maxlite.models.names import image_blocks, resolve_attention
from maxlite.models.platform import target_platform
from maxlite.models.sides import mixer_args


class Cache(NamedTuple):
    stacks: dict  # (mixer, variant) → (per-layer cache [L, ...], shared part)


def empty_cache(cfg, batch: int, length: int) -> Cache:
    return Cache({key: MIXERS[key[0]].cache().empty(cfg, key[1], len(layers), batch, length)
                  for key, layers in cache_groups(cfg).items()})


def _cache_module(key, shared):
    """The module stepping a stack's cache: its kind's, or the paged one when the stack's shared part
    is a block table (maxlite/models/paged_cache.py, the rollout engine's paged layout)."""
    if isinstance(shared, paged_cache.Table):
        return paged_cache.MODULES[key[0]]
    return MIXERS[key[0]].cache()


def _tile(cfg, impl: str) -> int:
    """The block an implementation cuts the sequence into (1: any length)."""
    if impl == "blockwise":
        return cfg.attention_block_size
    if impl == "flash":
        return max(getattr(cfg, f"sa_{k}") for k in attention._SPLASH_KEYS)
    return 1


def _implementation(cfg, length: int, shards: int) -> str:
    return resolve_attention(cfg.attention, target_platform(), length, cfg.attention_block_size, cfg.sa_block_q,
                             shards, cfg.attention_sink, image_blocks(cfg), cfg.dtype)


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


def _block(layer, key, x_BTD, positions_BT, lengths_B, stack, j, shared, prefill_cfg=None, context=None,
           inputs=None, rope_BT=None):
    """One layer over T new tokens: its mixer through its own cache, layer j of its stack (`key` its
    (mixer, variant); a cache module with CONTEXT also reads and writes `context`, what earlier
    layers of this forward left: key/value sharing), then the feed-forward and the sides' steps
    (`inputs`: this layer's, side name → array, as training's carry holds them). A cache module
    with `step_in_stack` updates the stack where it lies (the decode loop's carried buffer: no copy
    of it per step); the others step on layer j's slice, set back. `rope_BT`: multimodal RoPE's
    positions (grouped-query attention's cache reads them). Returns (x_BTD, the stack)."""
    cache = _cache_module(key, shared)
    extra = {"context": context} if getattr(cache, "CONTEXT", False) else {}
    if rope_BT is not None:
        extra["rope_BT"] = rope_BT
    if prefill_cfg is not None:  # the prefill's mixer reads what training's does (image blocks); a step does not
        extra.update(mixer_args(layer.mixer_sides, inputs or {}))
    args = (layer.attn, layer.mixer_input(x_BTD), positions_BT, lengths_B)
    if hasattr(cache, "step_in_stack"):
        mixed_BTD, stack = cache.step_in_stack(*args, stack, j, shared, key[1], prefill_cfg, **extra)
    else:
        # a stack held as its bits (maxlite/models/cache_bits.py: only values of the compute dtype, the
        # hidden states', are) steps on layer j's values
        dtype = x_BTD.dtype
        mixed_BTD, layer_cache = cache.step(*args, jax.tree.map(lambda a: load(a[j], dtype), stack), shared, key[1],
                                            prefill_cfg, **extra)
        stack = jax.tree.map(lambda a, n: jax.lax.dynamic_update_index_in_dim(a, store(n, a.dtype, dtype), j, 0),
                             stack, layer_cache)
    x_BTD = layer.add_mlp(layer.add_attention(x_BTD, mixed_BTD), None, inputs)
    return layer.finish(x_BTD, Carry(x_BTD, inputs=inputs or {})), stack


def forward(model, tokens_BT, positions_BT, lengths_B, cache: Cache, prefill_cfg=None, images=None,
            rope_BT=None) -> tuple[jax.Array, Cache]:
    """(final-normed hidden states x_BTD, the cache with these T tokens written in); `lengths_B`
    is each row's count of real tokens once these are in (tokens at positions ≥ it are padding).
    With `prefill_cfg` (`prefill_config`) the cache is empty and the tokens attend to each other
    through the training attention. A multimodal prompt: `images` (the batch's image arrays,
    maxlite/models/vision/towers.py) and multimodal RoPE's positions `rope_BT` [B, T, 3] (the
    slots stay `positions_BT`)."""
    with matmul.quantization(model.cfg.quantization):  # as training runs the layers
        return _forward(model, tokens_BT, positions_BT, lengths_B, cache, prefill_cfg, images, rope_BT)


def _forward(model, tokens_BT, positions_BT, lengths_B, cache: Cache, prefill_cfg, images=None,
             rope_BT=None) -> tuple[jax.Array, Cache]:
    cfg = model.cfg
    x_BTD, seen = model.embed_prompt(tokens_BT, positions_BT, images)
    inputs_L = layer_inputs(model, tokens_BT, x_BTD, seen)  # side name → [L, ...] (per-layer embeddings, DeepStack)
    x_BTD = model.streams_in(x_BTD)
    groups, stacks = cache_groups(cfg), layer_stacks(cfg)
    if cfg.scan_layers and len(groups) == 1 and len(stacks) == 1 and len(stacks[0].unit) == 1:
        # every layer alike and in one stack: scan them as training does, the cache stack carried
        (key, (per_layer, shared)), = cache.stacks.items()

        def body(carry, layer, inputs):
            x, stack, j = carry
            x, stack = _block(viewed(layer, x.dtype), key, x, positions_BT, lengths_B, stack, j, shared, prefill_cfg,
                              {}, inputs, rope_BT)
            return x, stack, j + 1
        scan = nnx.scan(body, in_axes=(nnx.Carry, 0, 0 if inputs_L else None), out_axes=nnx.Carry,
                        transform_metadata={nnx.PARTITION_NAME: "layers"})
        x_BTD, per_layer, _ = scan((x_BTD, per_layer, jnp.int32(0)), model.layers, inputs_L or None)
        new = {key: per_layer}
    else:
        kinds, new, context = layer_kinds(cfg), {key: per_layer for key, (per_layer, _) in cache.stacks.items()}, {}
        count = {key: 0 for key in groups}
        for i, (layer, kind) in enumerate(zip(model.blocks(), kinds)):
            key = (kind.mixer, kind.variant)
            x_BTD, new[key] = _block(viewed(layer, x_BTD.dtype), key, x_BTD, positions_BT, lengths_B, new[key],
                                     count[key], cache.stacks[key][1], prefill_cfg, context,
                                     jax.tree.map(lambda a, i=i: a[i], inputs_L), rope_BT)
            count[key] += 1
    stacks = {key: (new[key], _cache_module(key, shared).advance(shared, positions_BT, lengths_B))
              for key, (_, shared) in cache.stacks.items()}
    return model.final_norm(model.streams_out(x_BTD)), Cache(stacks)


def sampling_refusal(temperature: float, top_k: int, top_p: float) -> str | None:
    """The one line saying why `sample` cannot take these settings, or None."""
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        return (f"temperature={temperature}, top_k={top_k}, top_p={top_p}: temperature must be >= 0 (0: greedy), "
                "top_k >= 0 (0: no cut) and top_p in (0, 1] (1: no cut)")
    return None


def sample(logits_BV, key, temperature: float, top_k: int, top_p: float):
    """(one token per row, its log-prob under the distribution it was drawn from): the one sampling
    rule of `generate` and the rollout engine (maxlite/rollout/continuous.py).

    Temperature 0: greedy, the log-prob then log softmax(logits)[token] (T = 1, no cut). Else the
    token is drawn from softmax(logits / T) cut to the top k (0: no cut; k ≥ V: none) and then to
    the smallest set of top tokens holding probability top_p of what is left (1: no cut; vLLM's
    order), renormalised; the log-prob is that renormalised distribution's, what the trainer's
    importance ratio divides by. `key`: one key for the batch, or one per row ([B] keys: a row's
    draw then depends on its own key alone)."""
    if temperature == 0:
        token_B = first_max(logits_BV)
        cut_BV = logits_BV.astype(jnp.float32)
    else:
        cut_BV = _cut(logits_BV.astype(jnp.float32) / temperature, top_k, top_p)
        typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
        if key.ndim == (1 if typed else 2):  # one key per row
            token_B = jax.vmap(_categorical)(key, cut_BV)
        else:
            token_B = _categorical(key, cut_BV)
    logp_B = jnp.take_along_axis(jax.nn.log_softmax(cut_BV, axis=-1), token_B[:, None], axis=-1)[:, 0]
    return token_B, logp_B


def first_max(x_BV):
    """jnp.argmax over the last axis — the first index of the largest value, or of the first NaN
    when there is one — as a max and then a min over indices: XLA:CPU reduces argmax's (value,
    index) pairs element by element (32 rows × 32,000 logits on a 2-core AVX-512 EPYC: 2.3 ms, the max
    and min 0.5 ms)."""
    top_B1 = jnp.max(x_BV, axis=-1, keepdims=True)
    index_BV = jax.lax.broadcasted_iota(jnp.int32, x_BV.shape, x_BV.ndim - 1)
    return jnp.min(jnp.where((x_BV == top_B1) | jnp.isnan(x_BV), index_BV, x_BV.shape[-1]), axis=-1)


def _categorical(key, logits_BV):
    """jax.random.categorical(key, logits_BV, axis=-1), the same draw (Gumbel noise from `key`, the
    largest noisy logit) with `first_max` for its argmax (32 × 32,000: 10.5 ms → 3.0 ms a step)."""
    return first_max(jax.random.gumbel(key, logits_BV.shape, logits_BV.dtype) + logits_BV)


def _cut(logits_BV, top_k: int, top_p: float):
    """The logits with the tokens outside the top k, then outside the nucleus of mass top_p, at
    float32's lowest (probability 0 after the softmax)."""
    lowest = jnp.finfo(jnp.float32).min
    if 0 < top_k < logits_BV.shape[-1]:
        kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, lowest, logits_BV)
    if top_p < 1.0:
        sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # mass of the tokens ranked above
        cutoff_B1 = jnp.min(jnp.where(before_BV < top_p, sorted_BV, jnp.inf), axis=-1, keepdims=True)
        logits_BV = jnp.where(logits_BV < cutoff_B1, lowest, logits_BV)
    return logits_BV


def rope_after_prompt(rope_BP3, lengths_B):
    """Multimodal RoPE past the prompt: a new token at slot s turns by s + delta_B on every axis, where
    delta_B = (the prompt's largest position + 1) − its length (an image's tokens take fewer
    positions than slots), as transformers' `rope_deltas`."""
    real_BP = jnp.arange(rope_BP3.shape[1])[None] < lengths_B[:, None]
    top_B = jnp.max(jnp.where(real_BP[..., None], rope_BP3, -1), axis=(1, 2))
    return top_B + 1 - lengths_B


def generate_tokens(graphdef, params, prompt_BP, lengths_B, key, vision: dict | None = None, *,
                    max_new_tokens: int, temperature: float, top_k: int, top_p: float, eos_id: int):
    """(new tokens [B, max_new_tokens] — `eos_id` after a row's end —, number of decode steps run).
    `vision`: a multimodal prompt's {"images": the image arrays, "rope": [B, P, 3] positions}; the
    images are encoded once, in the prefill.

    Jit it with everything after `vision` static; the loop stops when every row has ended."""
    model = nnx.merge(graphdef, params)
    B, P = prompt_BP.shape
    cache = empty_cache(model.cfg, B, P + max_new_tokens)
    vision = vision or {}
    rope_BP = vision.get("rope")
    delta_B = None if rope_BP is None else rope_after_prompt(rope_BP, lengths_B)
    x_BPD, cache = forward(model, prompt_BP, jnp.broadcast_to(jnp.arange(P), (B, P)), lengths_B, cache,
                           prefill_config(model.cfg, P, context.shards()), vision.get("images"), rope_BP)
    x_B1D = jnp.take_along_axis(x_BPD, (lengths_B - 1)[:, None, None], axis=1)
    key, sub = jax.random.split(key)
    token_B = sample(model.logits(x_B1D)[:, 0], sub, temperature, top_k, top_p)[0]
    out_BN = jnp.full((B, max_new_tokens), eos_id, jnp.int32).at[:, 0].set(token_B)
    # the params ride in the loop state: NNX modules are rebuilt at the loop body's trace level
    state = (jnp.int32(1), token_B, lengths_B, token_B == eos_id, cache, out_BN, key, params)

    def running(s):
        i, _, _, done_B, _, _, _, _ = s
        return (i < max_new_tokens) & ~jnp.all(done_B)

    def step(s):
        i, token_B, pos_B, done_B, cache, out_BN, key, params = s
        model = nnx.merge(graphdef, params)
        rope = None if delta_B is None else jnp.broadcast_to((pos_B + delta_B)[:, None, None], (B, 1, 3))
        x_B1D, cache = forward(model, token_B[:, None], pos_B[:, None], pos_B + 1, cache, rope_BT=rope)
        key, sub = jax.random.split(key)
        nxt_B = sample(model.logits(x_B1D)[:, 0], sub, temperature, top_k, top_p)[0]
        nxt_B = jnp.where(done_B, eos_id, nxt_B)
        out_BN = jax.lax.dynamic_update_slice(out_BN, nxt_B[:, None], (0, i))
        return i + 1, nxt_B, pos_B + 1, done_B | (nxt_B == eos_id), cache, out_BN, key, params

    steps, _, _, _, _, out_BN, _, _ = jax.lax.while_loop(running, step, state)
    return out_BN, steps
