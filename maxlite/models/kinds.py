"""A decoder layer is a token mixer + a feed-forward, each a registered kind chosen per layer.

`layer_kinds(cfg)` gives every layer its kind: the recipe's `layer_types` when it states them (a
checkpoint's own pattern: HF config.json's `layer_types`), else the family's `layer_pattern`, with
the feed-forward from the mixture-of-experts keys (`first_num_dense_layers`,
`interleave_moe_layer_step`). The transformer, decoding, the FLOP count, the planner and the bridge
read kinds, never a family's name.

A mixer kind names its module (the NNX class that owns its parameters, their logical axes and its
decode cache), the variants a layer may take (attention: a global or a sliding-window layer) with
the HF `layer_types` names of each, and its forward FLOPs and decode-cache size as functions of the
config. A feed-forward kind likewise. Each kind also declares what the code outside the model asks of
it: its recipe checks (maxlite/models/kind_checks.py; config_checks runs those of the kinds a recipe
uses) and what Megatron-LM's GPT layer can express of it (a mapping in maxlite/bridge/nemo_kinds.py,
or its one-line refusal; maxlite/bridge/nemo.py asks the kinds a model uses). A new architecture
idea is a new entry here and its module.

Pure data: importable without JAX (config validation and the bridge use it).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

from maxlite.models.families import family

Flops = Callable[..., dict]


@dataclasses.dataclass(frozen=True)
class LayerKind:
    mixer: str      # a MIXERS key
    variant: str    # one of the mixer's variants (attention: "global" | "local")
    ffn: str        # a FEED_FORWARDS key ("dense" | "moe")


def _load(path: str) -> Callable:
    """"package.module:name" → the object, imported when first asked for (a kind's module may need JAX,
    its Megatron mapping the bridge: neither is loaded with this table)."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


@dataclasses.dataclass(frozen=True)
class _Declared:
    """What a kind declares for the code outside the model (keyword fields, after each kind's own)."""
    _: dataclasses.KW_ONLY
    # its recipe checks, "module:function(cfg, used) → the one line saying what is wrong, or None", run
    # once each (kinds sharing keys name the same check; `used`: a layer has one of them) before any
    # device count is known (`checks`) and on the resolved mesh (`layout_checks`); JAX-free
    checks: tuple[str, ...] = ()
    layout_checks: tuple[str, ...] = ()
    # what Megatron-LM's GPT layer expresses of it: "module:function(cfg, notes) → maxlite.bridge.
    # nemo_kinds.Part" (its flags, its NeMo fields, what it cannot), or the one line of its refusal
    megatron: str = ""
    megatron_refusal: str = ""

    def check_functions(self, layout: bool) -> tuple[str, ...]:
        return self.layout_checks if layout else self.checks

    def megatron_function(self) -> Callable | None:
        """Its Megatron mapping, None when it declares a refusal."""
        return _load(self.megatron) if self.megatron else None


@dataclasses.dataclass(frozen=True)
class MixerKind(_Declared):
    name: str
    module: str                         # "package.module:Class", the NNX module of a layer's mixer
    variants: dict[str, str]            # variant → its HF `layer_types` name
    flops: Callable                     # (cfg, B, T, variant) → forward FLOPs by part
    cache_numbers: Callable             # (cfg, variant, length) → decode-cache numbers per sequence
    cache_module: str                   # its decode cache: empty(cfg, variant, layers, batch, length) →
                                        # (per-layer cache [L, ...], shared), step(mixer, x_BTD,
                                        # positions_BT, lengths_B, layer_cache, shared, variant,
                                        # prefill_cfg) → (out_BTD, layer_cache), advance(shared,
                                        # positions_BT, lengths_B) → shared; optionally
                                        # step_in_stack(..., stack, j, shared, ...) → (out_BTD,
                                        # stack): layer j updated in place (no per-step copy)

    def cls(self):
        return _load(self.module)

    def cache(self):
        return importlib.import_module(self.cache_module)


@dataclasses.dataclass(frozen=True)
class FeedForwardKind(_Declared):
    name: str
    module: str                         # "package.module:function(cfg, rngs) → module"
    flops: Callable                     # (cfg, tokens) → forward FLOPs
    routed: bool = False                # returns routing statistics (the auxiliary losses' input)
    raw_input: bool = False             # reads the un-normed residual (it norms its own branches)

    def make(self, cfg, rngs):
        return _load(self.module)(cfg, rngs=rngs)


def attention_core_flops(B: int, T: int, N: int, H: int, window: int = 0) -> float:
    """Forward FLOPs of one layer's causal attention (QKᵀ and PV) over the keys it attends: the
    causal half T²/2, or with a sliding window W < T the band T·W − W²/2 (the same T²/2 at W = T)."""
    keys = T * T / 2 if not window or window >= T else T * window - window * window / 2
    return 4 * B * N * H * keys


def _window(cfg, variant: str) -> int:
    return cfg.sliding_window if variant == "local" else 0


def _attention_flops(cfg, B: int, T: int, variant: str) -> dict:
    D, N, K, H = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim
    return {"qkv": 2 * B * T * D * (N + 2 * K) * H, "out": 2 * B * T * N * H * D,
            "attention": attention_core_flops(B, T, N, H, _window(cfg, variant))}


def _attention_cache(cfg, variant: str, length: int) -> int:
    """K and V of every kept position (a sliding-window layer keeps its last W only)."""
    w = _window(cfg, variant)
    return 2 * (min(w, length) if w else length) * cfg.base_num_kv_heads * cfg.head_dim


def _mla_flops(cfg, B: int, T: int, variant: str) -> dict:
    """Multi-head latent attention (maxlite/models/mla.py): the query projection (through its latent
    when q_lora_rank > 0), the key/value latent and its up-projection to every head, the output, and
    the attention over heads P + R wide for the scores and V wide for the values."""
    D, N = cfg.base_emb_dim, cfg.base_num_query_heads
    Q, C, P, R, V = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    q = D * Q + Q * N * (P + R) if Q else D * N * (P + R)
    return {"qkv": 2 * B * T * (q + D * (C + R) + C * N * (P + V)), "out": 2 * B * T * N * V * D,
            "attention": attention_core_flops(B, T, N, (P + R + V) / 2, _window(cfg, variant))}


def _mla_cache(cfg, variant: str, length: int) -> int:
    """The latent and the shared RoPE key of every kept position: C + R numbers per token."""
    w = _window(cfg, variant)
    return (min(w, length) if w else length) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def gated_matrices(cfg) -> int:
    """Weight matrices of the family's MLP (3 gated, 2 for GELU's up/down)."""
    return family(cfg).mlp_matrices


def _dense_flops(cfg, tokens: int) -> float:
    return 2 * tokens * cfg.base_emb_dim * cfg.base_mlp_dim * gated_matrices(cfg)


def _moe_flops(cfg, tokens: int) -> float:
    """The router and the active experts (k routed + the shared ones), as MaxText counts them."""
    active = cfg.num_experts_per_tok + cfg.shared_experts
    return 2 * tokens * cfg.base_emb_dim * (cfg.num_experts + active * cfg.base_moe_mlp_dim * gated_matrices(cfg))


def _gdn_flops(cfg, B: int, T: int, variant: str) -> dict:
    """The gated delta-net layer as it runs (maxlite/models/gated_deltanet.py, chunks of C): the
    projections (q, k, v, z, b, a), the convolution, and per token and value head the chunked rule:
    kβ·kᵀ and q·kᵀ within the chunk (2·C·E each), the chunk's triangular inverse (2/3·C² by
    recursive doubling) applied to [v, k] (2·C·(U + E)), the intra-chunk product with the new
    values (2·C·U) and three products with the state (6·E·U)."""
    D, J, M = cfg.base_emb_dim, cfg.gdn_num_key_heads, cfg.gdn_num_value_heads
    E, U, W, C = cfg.gdn_key_head_dim, cfg.gdn_value_head_dim, cfg.gdn_conv_kernel_dim, cfg.gdn_chunk_size
    C = min(C, T)
    channels = 2 * J * E + M * U
    return {"qkv": 2 * B * T * D * (channels + M * U + 2 * M) + 2 * B * T * W * channels,
            "out": 2 * B * T * M * U * D,
            "attention": B * T * M * (4 * C * E + 2 * C * C / 3 + 2 * C * (U + E) + 2 * C * U + 6 * E * U)}


def _gdn_cache(cfg, variant: str, length: int) -> int:
    """The state [M, E, U] and the last W−1 convolution inputs: the same whatever the length. In
    numbers of the compute dtype, as every cache is counted: the float32 state is two bfloat16s."""
    channels = 2 * cfg.gdn_num_key_heads * cfg.gdn_key_head_dim + cfg.gdn_num_value_heads * cfg.gdn_value_head_dim
    state = cfg.gdn_num_value_heads * cfg.gdn_key_head_dim * cfg.gdn_value_head_dim
    return state * (2 if cfg.dtype == "bfloat16" else 1) + (cfg.gdn_conv_kernel_dim - 1) * channels


def attention_shape(cfg, wide: bool) -> tuple[int, int]:
    """(K kv heads, H head dim) of a layer: a wide one (Gemma 4's global layers) has its own."""
    if wide:
        return cfg.global_num_kv_heads or cfg.base_num_kv_heads, cfg.global_head_dim or cfg.head_dim
    return cfg.base_num_kv_heads, cfg.head_dim


def _shaped_attention(wide: bool, shared: bool) -> tuple[Callable, Callable]:
    """FLOPs and decode-cache numbers of an attention layer of its own shape (`wide`) that may take its
    keys and values from an earlier layer (`shared`: no projections, no cache of its own)."""
    def flops(cfg, B: int, T: int, variant: str) -> dict:
        D, N = cfg.base_emb_dim, cfg.base_num_query_heads
        K, H = attention_shape(cfg, wide)
        kv = 0 if shared else (1 if wide and cfg.attention_k_eq_v else 2) * K
        return {"qkv": 2 * B * T * D * (N + kv) * H, "out": 2 * B * T * N * H * D,
                "attention": attention_core_flops(B, T, N, H, _window(cfg, variant))}

    def cache(cfg, variant: str, length: int) -> int:
        K, H = attention_shape(cfg, wide)
        w = _window(cfg, variant)
        return 0 if shared else 2 * (min(w, length) if w else length) * K * H
    return flops, cache


_CHECKS = "maxlite.models.kind_checks:"
_MEGATRON = "maxlite.bridge.nemo_kinds:"
# Gemma 4's attention layers: Megatron's has no v norm, no second head shape, no proportional RoPE
_GEMMA4_REFUSAL = "Gemma 4's attention (a v norm; global layers of their own width with proportional RoPE)"

MIXERS = {m.name: m for m in (
    MixerKind("attention", "maxlite.models.layers:Attention",
              {"global": "full_attention", "local": "sliding_attention"}, _attention_flops, _attention_cache,
              "maxlite.models.gqa_cache", megatron=_MEGATRON + "attention"),
    MixerKind("mla", "maxlite.models.mla:MLA",
              {"global": "full_attention", "local": "sliding_attention"}, _mla_flops, _mla_cache,
              "maxlite.models.mla_cache", checks=(_CHECKS + "mla",),
              megatron_refusal="multi-head latent attention (not mapped yet: --multi-latent-attention and its ranks)"),
    MixerKind("gated_deltanet", "maxlite.models.gated_deltanet:GatedDeltaNet", {"linear": "linear_attention"},
              _gdn_flops, _gdn_cache, "maxlite.models.gdn_cache", layout_checks=(_CHECKS + "gated_deltanet_layout",),
              megatron_refusal="gated delta-net layers (its GPT layer is attention only)"),
    # Gemma 4 (maxlite/models/gemma4.py): local and (wide) global layers, each also as a layer that
    # reuses the keys and values of the last earlier layer of its kind
    *(MixerKind(f"gemma4_{v}{'_shared' if shared else ''}", f"maxlite.models.gemma4:{v}_attention{'_shared' if shared else ''}",
                {v: hf}, *_shaped_attention(v == "global", shared),
                f"maxlite.models.gemma4_{'shared_' if shared else ''}cache",
                checks=(_CHECKS + "gemma4", *((_CHECKS + "kv_sharing",) if shared else ())),
                megatron_refusal="layers reusing an earlier layer's keys and values (num_kv_shared_layers)" if shared
                else _GEMMA4_REFUSAL)
      for v, hf in (("local", "sliding_attention"), ("global", "full_attention")) for shared in (False, True)),
)}
_MOE_REFUSAL = "a mixture of experts (not mapped yet: --num-experts and its routing keys)"
FEED_FORWARDS = {f.name: f for f in (
    FeedForwardKind("dense", "maxlite.models.layers:make_mlp", _dense_flops, megatron=_MEGATRON + "dense"),
    FeedForwardKind("moe", "maxlite.models.moe:MoE", _moe_flops, routed=True, checks=(_CHECKS + "moe",),
                    layout_checks=(_CHECKS + "moe_layout",), megatron_refusal=_MOE_REFUSAL),
    FeedForwardKind("dense_wide", "maxlite.models.gemma4:wide_mlp", lambda cfg, tokens: 2 * _dense_flops(cfg, tokens),
                    megatron_refusal="MLPs of two widths (use_double_wide_mlp)"),
    FeedForwardKind("gemma4_moe", "maxlite.models.gemma4:MoEBlock",
                    lambda cfg, tokens: _dense_flops(cfg, tokens) + _moe_flops(cfg, tokens), routed=True, raw_input=True,
                    checks=(_CHECKS + "moe",), layout_checks=(_CHECKS + "moe_layout",),
                    megatron_refusal=_MOE_REFUSAL),
)}
# HF layer_types name → (mixer, variant), and a pattern's variant → its mixer; the first mixer naming
# it keeps it (MLA's layers carry GQA's names: which attention a layer has is `attention_type`'s,
# `attention_mixer`)
HF_LAYER_TYPES = {hf: (mixer.name, variant) for mixer in reversed(MIXERS.values())
                  for variant, hf in mixer.variants.items()}
VARIANT_MIXER = {variant: mixer.name for mixer in reversed(MIXERS.values()) for variant in mixer.variants}


def attention_mixer(cfg, mixer: str) -> str:
    """An attention layer's mixer: latent attention where `attention_type: mla` says so."""
    return "mla" if mixer == "attention" and cfg.attention_type == "mla" else mixer


def pattern_mixers(cfg) -> tuple[tuple[str, str], ...]:
    """Each layer's (mixer, variant): the recipe's `layer_types`, else the family's pattern."""
    L = cfg.base_num_decoder_layers
    mixer = attention_mixer(cfg, "attention")
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
    return _load(hook)(cfg, kinds) if hook else kinds


def used_kinds(cfg) -> tuple[FeedForwardKind | MixerKind, ...]:
    """The kinds the layers have, each once: the feed-forwards, then the mixers, in layer order."""
    kinds = layer_kinds(cfg)
    return (*(FEED_FORWARDS[f] for f in dict.fromkeys(k.ffn for k in kinds)),
            *(MIXERS[m] for m in dict.fromkeys(k.mixer for k in kinds)))


def check_kinds(cfg, layout: bool = False) -> str | None:
    """The first problem the kinds' own checks find in the recipe (`layout`: those of the resolved
    mesh), or None. Every check a kind names runs once, feed-forwards' first, told whether a layer
    has a kind naming it (a check also refuses its keys on a model without its kinds). Needs the
    layer pattern `check_layer_pattern` accepts."""
    present = {id(k) for k in used_kinds(cfg)}
    checks: dict[str, bool] = {}  # each check → whether a layer has a kind naming it
    for kind in (*FEED_FORWARDS.values(), *MIXERS.values()):
        for path in kind.check_functions(layout):
            checks[path] = checks.get(path, False) or id(kind) in present
    return next(filter(None, (_load(path)(cfg, used) for path, used in checks.items())), None)


def cache_groups(cfg) -> dict[tuple[str, str], list[int]]:
    """(mixer, variant) → the layers with it, in order: the layers whose decode caches stack."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, k in enumerate(layer_kinds(cfg)):
        groups.setdefault((k.mixer, k.variant), []).append(i)
    return groups


def cache_numbers_per_token(cfg, length: int) -> float:
    """Decode-cache numbers per token of a sequence of `length` positions, all layers (a sliding
    window's keeps at most W positions whatever the length)."""
    return sum(MIXERS[k.mixer].cache_numbers(cfg, k.variant, length) for k in layer_kinds(cfg)) / length


def hf_layer_types(cfg) -> list[str]:
    """Each layer's HF `layer_types` name (what an export writes to config.json)."""
    return [MIXERS[k.mixer].variants[k.variant] for k in layer_kinds(cfg)]


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
    return tuple(_window(cfg, variant) for _, variant in pattern_mixers(cfg))


def layer_mlps(cfg) -> tuple[str, ...]:
    """Each layer's feed-forward kind ("dense" | "moe" | a family's own)."""
    return tuple(k.ffn for k in layer_kinds(cfg))


@dataclasses.dataclass(frozen=True)
class Stack:
    """Layers stored (and scanned) together: `count` units of consecutive layers, a unit's layers of
    the structures `unit` (mixer, feed-forward); the mixer's variant (a window) may differ between
    the layers of one position, their parameters being alike."""
    name: str                   # the parameter tree's key: "layers" or "dense_layers"
    count: int
    unit: tuple[tuple[str, str], ...]   # (mixer, ffn) of each layer of a unit
    first: int                  # the index of its first layer


def layer_stacks(cfg) -> tuple[Stack, ...]:
    """How a scanned model stores its layers: a MoE model's first_num_dense_layers dense layers in
    `dense_layers`, the rest in `layers` as units of the shortest period of their structures: one
    layer per unit when the layers are alike; with interleave_moe_layer_step = s > 1, units of s
    layers (s - 1 dense, 1 MoE); a hybrid's repeating block (three of one mixer, one of another)."""
    kinds = layer_kinds(cfg)
    first = cfg.first_num_dense_layers if family(cfg).moe else 0
    rest = [(k.mixer, k.ffn) for k in kinds[first:]]
    n = len(rest)
    period = next(p for p in range(1, n + 1) if n % p == 0 and all(rest[i] == rest[i % p] for i in range(n)))
    stacks = (Stack("dense_layers", first, ((kinds[0].mixer, "dense"),), 0),) if first else ()
    return stacks + (Stack("layers", n // period, tuple(rest[:period]), first),)


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
