"""Which kind each decoder layer has and where its parameters sit: plain data and the functions over it.

`layer_kinds(cfg)` gives every layer its kind: the recipe's `layer_types` when it states them (a
checkpoint's own pattern: HF config.json's `layer_types`), else the family's `layer_pattern`, with
the feed-forward from the mixture-of-experts keys (`first_num_dense_layers`,
`interleave_moe_layer_step`). `layer_stacks` and `layer_place` say how a model stores those layers.

This module sits below every layer implementation: it imports none and names none. What a kind is
made of (its module, FLOPs, decode cache, checks, Megatron mapping) is its entry in
maxlite/models/kinds.py, which takes each kind's variants and routing from here.

Pure data: importable without JAX (config validation and the bridge use it).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

from maxlite.models.families import family

# Each mixer kind's variants (the forms a layer of it may take: attention a global or a sliding-window
# layer, or a chunked one: Llama 4's, each token attending within its own chunk of chunk_attn_window_size
# positions), each with its HF `layer_types` name. Gemma 4 (maxlite/models/gemma4.py): local and (wide)
# global layers, each also as a layer reusing the keys and values of the last earlier layer of its kind.
VARIANTS: dict[str, dict[str, str]] = {
    "attention": {"global": "full_attention", "local": "sliding_attention", "chunked": "chunked_attention"},
    "mla": {"global": "full_attention", "local": "sliding_attention"},
    # DeepSeek sparse attention: latent attention over the tokens its indexer keeps (a family's
    # `layer_kinds` makes its latent attention layers DSA)
    "dsa": {"global": "indexed_attention"},
    "gated_deltanet": {"linear": "linear_attention"},
    # Kimi delta attention takes the delta-net's name (a family's `layer_kinds` makes its linear layers KDA)
    "kda": {"linear": "linear_attention"},
    # Nemotron-H's layers (its adapter translates HF's `linear_attention` for Mamba-2 to "mamba"): a
    # Mamba-2 layer, and a layer of an MLP alone (no mixer)
    "mamba2": {"mamba": "mamba"},
    "none": {"none": "mlp"},
    # DeepSeek-V4's layers (its family's `layer_kinds` makes its sliding-window layers `v4_sliding`)
    "v4_sliding": {"v4_local": "sliding_attention"},
    "v4_hca": {"hca": "heavily_compressed_attention"},
    "v4_csa": {"csa": "compressed_sparse_attention"},
    **{f"gemma4_{v}{'_shared' if shared else ''}": {v: hf}
       for v, hf in (("local", "sliding_attention"), ("global", "full_attention")) for shared in (False, True)},
}
# The feed-forward kinds that route tokens to experts (and return routing statistics: the auxiliary
# losses' input)
ROUTED = frozenset({"moe", "gemma4_moe", "hash_moe"})
# HF layer_types name → (mixer, variant), and a pattern's variant → its mixer; the first mixer naming
# it keeps it (MLA's layers carry GQA's names: which attention a layer has is `attention_type`'s,
# `attention_mixer`)
HF_LAYER_TYPES = {hf: (mixer, variant) for mixer, variants in reversed(VARIANTS.items())
                  for variant, hf in variants.items()}
VARIANT_MIXER = {variant: mixer for mixer, variants in reversed(VARIANTS.items()) for variant in variants}


@dataclasses.dataclass(frozen=True)
class LayerKind:
    mixer: str      # a VARIANTS (and kinds.MIXERS) key
    variant: str    # one of the mixer's variants (attention: "global" | "local")
    ffn: str        # a kinds.FEED_FORWARDS key ("dense" | "moe" | a family's own)


def load(path: str) -> Callable:
    """"package.module:name" → the object, imported when first asked for (a family's `layer_kinds`
    hook; in kinds.py a kind's module, which may need JAX, and its Megatron mapping, the bridge)."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def window(cfg, variant: str) -> int:
    """A layer's sliding window (0: a global layer, or a mixer without one). A chunked layer's keys lie
    less than its chunk back, so its window is the chunk: its decode cache is a ring of that many slots
    (`chunk` adds the rule that cuts at chunk boundaries)."""
    if variant == "chunked":
        return cfg.chunk_attn_window_size
    return cfg.sliding_window if variant == "local" else 0


def chunk(cfg, variant: str) -> int:
    """A chunked-attention layer's chunk (0: every other layer)."""
    return cfg.chunk_attn_window_size if variant == "chunked" else 0


def attention_shape(cfg, wide: bool) -> tuple[int, int]:
    """(K kv heads, H head dim) of a layer: a wide one (Gemma 4's global layers) has its own."""
    if wide:
        return cfg.global_num_kv_heads or cfg.base_num_kv_heads, cfg.global_head_dim or cfg.head_dim
    return cfg.base_num_kv_heads, cfg.head_dim


def attention_mixer(cfg, mixer: str) -> str:
    """An attention layer's mixer: latent attention where `attention_type: mla` says so."""
    return "mla" if mixer == "attention" and cfg.attention_type == "mla" else mixer


def pattern_mixers(cfg) -> tuple[tuple[str, str], ...]:
    """Each layer's (mixer, variant): the recipe's `layer_types`, else the family's pattern."""
    L = cfg.base_num_decoder_layers
    if cfg.layer_types:
        return tuple((attention_mixer(cfg, HF_LAYER_TYPES[t][0]), HF_LAYER_TYPES[t][1]) for t in cfg.layer_types)
    pattern = family(cfg).layer_pattern
    return tuple((attention_mixer(cfg, VARIANT_MIXER[pattern[i % len(pattern)]]), pattern[i % len(pattern)])
                 for i in range(L))


def layer_ffns(cfg) -> tuple[str, ...]:
    """Each layer's feed-forward: a MoE family's first `first_num_dense_layers` layers are dense, and
    of the layers after them every `interleave_moe_layer_step`-th is MoE (the others dense); a family
    without experts is dense throughout."""
    L = cfg.base_num_decoder_layers
    if not family(cfg).moe:
        return ("dense",) * L
    first, step = cfg.first_num_dense_layers, cfg.interleave_moe_layer_step
    return tuple("dense" if i < first or (i - first + 1) % step else "moe" for i in range(L))


def layer_kinds(cfg) -> tuple[LayerKind, ...]:
    """Each layer's kinds: the pattern's, then the family's own rewrite (`Family.layer_kinds`) if any."""
    kinds = tuple(LayerKind(m, v, f) for (m, v), f in zip(pattern_mixers(cfg), layer_ffns(cfg)))
    hook = family(cfg).layer_kinds
    return load(hook)(cfg, kinds) if hook else kinds


def cache_groups(cfg) -> dict[tuple[str, str], list[int]]:
    """(mixer, variant) → the layers with it, in order: the layers whose decode caches stack."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, k in enumerate(layer_kinds(cfg)):
        groups.setdefault((k.mixer, k.variant), []).append(i)
    return groups


def hf_layer_types(cfg) -> list[str]:
    """Each layer's HF `layer_types` name (what an export writes to config.json)."""
    return [VARIANTS[k.mixer][k.variant] for k in layer_kinds(cfg)]


def check_layer_types(types, num_layers: int) -> str | None:
    """Why a `layer_types` list cannot describe this model, or None."""
    if not types:
        return None
    unknown = sorted({t for t in types if t not in HF_LAYER_TYPES})
    if unknown:
        return f"layer_types: {unknown[0]!r} is no layer kind maxlite has (known: {', '.join(HF_LAYER_TYPES)})"
    if len(types) != num_layers:
        return f"layer_types names {len(types)} layers but base_num_decoder_layers is {num_layers}"
    return None


def check_layer_pattern(cfg) -> str | None:
    """Why the recipe's layers have no kinds, or None: its `layer_types`, and in a mixture-of-experts
    family the layers `first_num_dense_layers` and `interleave_moe_layer_step` leave to the experts."""
    problem = check_layer_types(cfg.layer_types, cfg.base_num_decoder_layers)
    if problem or not family(cfg).moe:
        return problem
    L, first, step = cfg.base_num_decoder_layers, cfg.first_num_dense_layers, cfg.interleave_moe_layer_step
    if first < 0 or L - first < 1:
        return f"first_num_dense_layers={first} must leave at least one of the {L} layers for the experts"
    if step < 1 or (L - first) % step:
        return f"interleave_moe_layer_step={step} must divide the {L - first} layers after first_num_dense_layers"
    return None


def layer_windows(cfg) -> tuple[int, ...]:
    """Each layer's sliding window (0: global layers and mixers without one)."""
    return tuple(window(cfg, variant) for _, variant in pattern_mixers(cfg))


def layer_mlps(cfg) -> tuple[str, ...]:
    """Each layer's feed-forward kind ("dense" | "moe" | a family's own)."""
    return tuple(k.ffn for k in layer_kinds(cfg))


@dataclasses.dataclass(frozen=True)
class Stack:
    """Layers stored (and scanned) together: `count` units of consecutive layers, a unit's layers of
    the structures `unit` (mixer, feed-forward); the mixer's variant (a window) may differ between
    the layers of one position, their parameters being alike."""
    name: str                   # the parameter tree's key: "layers", "dense_layers", "hash_layers", "tail_layers"
    count: int
    unit: tuple[tuple[str, str], ...]   # (mixer, ffn) of each layer of a unit
    first: int                  # the index of its first layer


def layer_stacks(cfg) -> tuple[Stack, ...]:
    """How a scanned model stores its layers: a MoE model's first_num_dense_layers dense layers in
    `dense_layers`, DeepSeek-V4's num_hash_layers hash-routed ones after them in `hash_layers`, the rest
    in `layers` as units of the shortest period of their structures: one
    layer per unit when the layers are alike; with interleave_moe_layer_step = s > 1, units of s
    layers (s - 1 dense, 1 MoE); a hybrid's repeating block (three of one mixer, one of another)."""
    kinds = layer_kinds(cfg)
    dense = cfg.first_num_dense_layers if family(cfg).moe else 0
    first = dense + cfg.num_hash_layers
    stacks = (Stack("dense_layers", dense, ((kinds[0].mixer, "dense"),), 0),) if dense else ()
    if cfg.num_hash_layers:  # DeepSeek-V4's hash-routed first layers: the rest then repeats (a real scan)
        head = [(k.mixer, k.ffn) for k in kinds[dense:first]]
        period = _period(head)
        stacks += (Stack("hash_layers", len(head) // period, tuple(head[:period]), dense),)
    rest = [(k.mixer, k.ffn) for k in kinds[first:]]
    period, count = _repeating(rest)
    stacks += (Stack("layers", count, tuple(rest[:period]), first),)
    tail = rest[period * count:]
    if tail:  # what is left after the repeats (Kimi Linear's last layers): one unit of its own
        stacks += (Stack("tail_layers", 1, tuple(tail), first + period * count),)
    return stacks


def _period(structures: list) -> int:
    """The shortest p that the list repeats with (its length when nothing shorter)."""
    n = len(structures)
    return next(p for p in range(1, n + 1) if n % p == 0 and all(structures[i] == structures[i % p] for i in range(n)))


def _repeating(structures: list) -> tuple[int, int]:
    """(p, m): the list as m ≥ 2 repeats of its first p structures and a tail shorter than p, with the
    fewest layers in a unit and the tail together (each is compiled once, the repeats are scanned); the
    whole list's own period (no tail) when nothing is shorter. Kimi Linear's 26 layers after the dense
    one: 6 × 4 + 2, not one unit of 26; Nemotron-H 8B's 52: 4 × 11 + 8."""
    n = len(structures)
    best = (_period(structures), n // _period(structures))
    for p in range(1, n + 1):
        run = next((i for i in range(p, n) if structures[i] != structures[i % p]), n)
        m = run // p
        if m >= 2 and n - m * p < p and p + n - m * p < best[0] + n - best[0] * best[1]:
            best = (p, m)
    return best


def layer_place(cfg, i: int) -> tuple[tuple, int | None]:
    """Where layer i's parameters live: (the path of its block in the parameter tree, its index on
    the stacked axis, None when unrolled). `("layers",), 3` is the 4th unit of `layers`; a unit of
    several layers adds ("blocks", position)."""
    if not cfg.scan_layers:
        return ("layers", i), None
    for stack in layer_stacks(cfg):
        j = i - stack.first
        if 0 <= j < stack.count * len(stack.unit):
            size = len(stack.unit)
            return ((stack.name,) if size == 1 else (stack.name, "blocks", j % size)), j // size
    raise IndexError(f"layer {i} of {cfg.base_num_decoder_layers}")
