"""A decoder layer is a token mixer + a feed-forward, each a registered kind chosen per layer: the registry.

Which kind each layer has (`layer_kinds`) and where it sits (`layer_stacks`, `layer_place`) is
maxlite/models/layout.py's, below every implementation; each kind's variants and whether it routes
are declared there too. The transformer, decoding, the FLOP count, the planner and the bridge read
kinds, never a family's name.

A mixer kind names its module (the NNX class that owns its parameters, their logical axes and its
decode cache) and its forward FLOPs and decode-cache size as functions of the config; the variants a
layer of it may take, with their HF `layer_types` names, are its entry in layout.VARIANTS. A
feed-forward kind likewise (whether it routes tokens: layout.ROUTED). Each kind also declares what the
code outside the model asks of it: its recipe checks (maxlite/models/kind_checks.py; config_checks
runs those of the kinds a recipe uses) and what Megatron-LM's GPT layer can express of it (a mapping
in maxlite/bridge/nemo_kinds.py, or its one-line refusal; maxlite/bridge/nemo.py asks the kinds a
model uses). A new architecture idea is a new entry here, its layout in layout.py, and its module.

Pure data: importable without JAX (config validation and the bridge use it).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

from maxlite.models.families import family
from maxlite.models.layout import ROUTED, VARIANTS, attention_shape, chunk, layer_kinds, load, window

Flops = Callable[..., dict]


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
        return load(self.megatron) if self.megatron else None


@dataclasses.dataclass(frozen=True)
class MixerKind(_Declared):
    name: str
    module: str                         # "package.module:Class", the NNX module of a layer's mixer
    flops: Callable                     # (cfg, B, T, variant) → forward FLOPs by part
    cache_numbers: Callable             # (cfg, variant, length) → decode-cache numbers per sequence
    cache_module: str                   # its decode cache: empty(cfg, variant, layers, batch, length) →
                                        # (per-layer cache [L, ...], shared), step(mixer, x_BTD,
                                        # positions_BT, lengths_B, layer_cache, shared, variant,
                                        # prefill_cfg) → (out_BTD, layer_cache), advance(shared,
                                        # positions_BT, lengths_B) → shared; optionally
                                        # step_in_stack(..., stack, j, shared, ...) → (out_BTD,
                                        # stack): layer j updated in place (no per-step copy);
                                        # BATCH_AXES: the batch axis of (every per-layer leaf,
                                        # every shared leaf), where a sequence's cache is cut
    raw_input: bool = False             # reads the un-normed residual (no norm before it: the `none` kind)
    recurrent: bool = False             # its decode cache is a state of fixed size per sequence
                                        # (cache_numbers the same at any length), not a record per token
    image_blocks: bool = False          # it draws a prompt's image blocks both ways (its mixer and its
                                        # cache's prefill take `blocks_BT`: names.image_blocks)

    def cls(self):
        return load(self.module)

    def cache(self):
        return importlib.import_module(self.cache_module)


@dataclasses.dataclass(frozen=True)
class FeedForwardKind(_Declared):
    name: str
    module: str                         # "package.module:function(cfg, rngs) → module"
    flops: Callable                     # (cfg, tokens) → forward FLOPs
    raw_input: bool = False             # reads the un-normed residual (it norms its own branches)
    side_args: bool = False             # takes the sides' ffn_arg keywords (hash routing's token ids)

    @property
    def routed(self) -> bool:
        """Whether it returns routing statistics (the auxiliary losses' input): layout.ROUTED."""
        return self.name in ROUTED

    def make(self, cfg, rngs):
        return load(self.module)(cfg, rngs=rngs)


def attention_core_flops(B: int, T: int, N: int, H: int, window: int = 0, chunk: int = 0) -> float:
    """Forward FLOPs of one layer's causal attention (QKᵀ and PV) over the keys it attends: the
    causal half T²/2, or with a sliding window W < T the band T·W − W²/2 (the same T²/2 at W = T), or
    in chunks of C < T (Llama 4's chunked layers) a causal half per chunk, T·C/2."""
    if chunk and chunk < T:
        keys = T * chunk / 2
    else:
        keys = T * T / 2 if not window or window >= T else T * window - window * window / 2
    return 4 * B * N * H * keys


def _attention_flops(cfg, B: int, T: int, variant: str) -> dict:
    D, N, K, H = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim
    return {"qkv": 2 * B * T * D * (N + 2 * K) * H, "out": 2 * B * T * N * H * D,
            "attention": attention_core_flops(B, T, N, H, window(cfg, variant), chunk(cfg, variant))}


def _attention_cache(cfg, variant: str, length: int) -> int:
    """K and V of every kept position (a sliding-window layer keeps its last W only)."""
    w = window(cfg, variant)
    return 2 * (min(w, length) if w else length) * cfg.base_num_kv_heads * cfg.head_dim


def _mla_flops(cfg, B: int, T: int, variant: str) -> dict:
    """Multi-head latent attention (maxlite/models/mla.py): the query projection (through its latent
    when q_lora_rank > 0), the key/value latent and its up-projection to every head, the output, and
    the attention over heads P + R wide for the scores and V wide for the values."""
    D, N = cfg.base_emb_dim, cfg.base_num_query_heads
    Q, C, P, R, V = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    q = D * Q + Q * N * (P + R) if Q else D * N * (P + R)
    return {"qkv": 2 * B * T * (q + D * (C + R) + C * N * (P + V)), "out": 2 * B * T * N * V * D,
            "attention": attention_core_flops(B, T, N, (P + R + V) / 2, window(cfg, variant))}


def _mla_cache(cfg, variant: str, length: int) -> int:
    """The latent and the shared RoPE key of every kept position: C + R numbers per token."""
    w = window(cfg, variant)
    return (min(w, length) if w else length) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def _dsa_flops(cfg, B: int, T: int, variant: str) -> dict:
    """DeepSeek sparse attention (maxlite/models/dsa.py): latent attention's projections, the
    indexer's (queries from the query latent, one key, a weight per head) and its scores over the
    causal half, and the attention over min(s, index_topk) keys per query (the band of a window of
    index_topk: the sparse algorithm's count; maxlite's dense masked softmax computes more)."""
    D, N, Q, I, J = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim
    P, R, V = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    mla = _mla_flops(cfg, B, T, "global")
    index = 2 * B * T * (Q * I * J + D * J + D * I) + 2 * B * (T * T / 2) * I * J
    return {"qkv": mla["qkv"] + index, "out": mla["out"],
            "attention": attention_core_flops(B, T, N, (P + R + V) / 2, cfg.index_topk)}


def _dsa_cache(cfg, variant: str, length: int) -> int:
    """Latent attention's C + R numbers per token and the indexer's key, J more."""
    return length * (cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.index_head_dim)


def _v4_flops(cfg, B: int, T: int, variant: str) -> dict:
    """DeepSeek-V4's attention (maxlite/models/v4_attention.py): the query through its latent, the one
    shared key=value head, the grouped output projection; the attention over the sliding window's
    keys, plus the compressed entries a query sees (HCA: every earlier one, T/m of them at most;
    CSA: the indexer's index_topk), with the compressors' projections and the indexer's scoring."""
    D, N, H, Q = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.head_dim, cfg.q_lora_rank
    out = 2 * B * T * (N * H * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * D) if cfg.o_groups else 2 * B * T * N * H * D
    flops = {"qkv": 2 * B * T * (D * Q + Q * N * H + D * H), "out": out,
             "attention": attention_core_flops(B, T, N, H, cfg.sliding_window)}
    if variant == "hca":
        m = cfg.compress_rate_hca
        flops["qkv"] += 2 * B * T * D * 2 * H
        flops["attention"] += 4 * B * N * H * T * (T / m) / 2
    elif variant == "csa":
        m, I, J = cfg.compress_rate_csa, cfg.index_n_heads, cfg.index_head_dim
        flops["qkv"] += 2 * B * T * (D * 4 * H + D * 4 * J + Q * I * J + D * I)
        flops["attention"] += 4 * B * N * H * T * min(cfg.index_topk, T / m) + 2 * B * T * I * J * (T / m) / 2
    return flops


def _v4_cache(cfg, variant: str, length: int) -> int:
    """What maxlite/models/v4_cache.py keeps per position: the key=value head, and a compressed layer's
    compressor projections (kv and gate), a sparse layer's indexer's too."""
    per_token = cfg.head_dim
    if variant == "hca":
        per_token += 2 * cfg.head_dim
    elif variant == "csa":
        per_token += 4 * cfg.head_dim + 4 * cfg.index_head_dim
    return length * per_token


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


def _kda_flops(cfg, B: int, T: int, variant: str) -> dict:
    """Kimi delta attention (maxlite/models/kda.py, chunks of C): q, k, v, β and the two low-rank
    gates (D·E then E·M·E each), the convolution, and the gated delta-net's chunked rule with the
    pairwise decay per channel: kβ·kᵀ and q·kᵀ weighted by exp(γ_i − γ_j) per key dim cost 3·C·E
    each; the rest as the gated delta-net's with U = E."""
    D, M, E, W, C = (cfg.base_emb_dim, cfg.gdn_num_value_heads, cfg.gdn_key_head_dim, cfg.gdn_conv_kernel_dim,
                     min(cfg.gdn_chunk_size, T))
    channels = 3 * M * E
    return {"qkv": 2 * B * T * (D * (channels + M + 2 * E) + 2 * E * M * E) + 2 * B * T * W * channels,
            "out": 2 * B * T * M * E * D,
            "attention": B * T * M * (6 * C * E + 2 * C * C / 3 + 4 * C * E + 2 * C * E + 6 * E * E)}


def _mamba2_flops(cfg, B: int, T: int, variant: str) -> dict:
    """The Mamba-2 layer as it runs (maxlite/models/mamba2.py, chunks of C): the projections (z, x, B,
    C, dt), the convolution, and the chunked scan: C·Bᵀ within the chunk per group (2·C·S per token),
    its product with the inputs (2·C·P per head) and two products with the state (4·P·S per head)."""
    D, M, P = cfg.base_emb_dim, cfg.mamba_num_heads, cfg.mamba_head_dim
    G, S, W, C = cfg.mamba_num_groups, cfg.mamba_state_dim, cfg.mamba_conv_kernel_dim, min(cfg.mamba_chunk_size, T)
    channels = M * P + 2 * G * S
    return {"qkv": 2 * B * T * D * (channels + M * P + M) + 2 * B * T * W * channels,
            "out": 2 * B * T * M * P * D,
            "attention": B * T * (2 * G * C * S + M * (2 * C * P + 4 * P * S))}


def _mamba2_cache(cfg, variant: str, length: int) -> int:
    """The state [M, P, S] and the last W−1 convolution inputs: the same whatever the length. In numbers
    of the compute dtype, as every cache is counted: the float32 state is two bfloat16s."""
    channels = cfg.mamba_num_heads * cfg.mamba_head_dim + 2 * cfg.mamba_num_groups * cfg.mamba_state_dim
    state = cfg.mamba_num_heads * cfg.mamba_head_dim * cfg.mamba_state_dim
    return state * (2 if cfg.dtype == "bfloat16" else 1) + (cfg.mamba_conv_kernel_dim - 1) * channels


def _shaped_attention(wide: bool, shared: bool) -> tuple[Callable, Callable]:
    """FLOPs and decode-cache numbers of an attention layer of its own shape (`wide`) that may take its
    keys and values from an earlier layer (`shared`: no projections, no cache of its own)."""
    def flops(cfg, B: int, T: int, variant: str) -> dict:
        D, N = cfg.base_emb_dim, cfg.base_num_query_heads
        K, H = attention_shape(cfg, wide)
        kv = 0 if shared else (1 if wide and cfg.attention_k_eq_v else 2) * K
        return {"qkv": 2 * B * T * D * (N + kv) * H, "out": 2 * B * T * N * H * D,
                "attention": attention_core_flops(B, T, N, H, window(cfg, variant))}

    def cache(cfg, variant: str, length: int) -> int:
        K, H = attention_shape(cfg, wide)
        w = window(cfg, variant)
        return 0 if shared else 2 * (min(w, length) if w else length) * K * H
    return flops, cache


_CHECKS = "maxlite.models.kind_checks:"
_MEGATRON = "maxlite.bridge.nemo_kinds:"
# Gemma 4's attention layers: Megatron's has no v norm, no second head shape, no proportional RoPE
_GEMMA4_REFUSAL = "Gemma 4's attention (a v norm; global layers of their own width with proportional RoPE)"

MIXERS = {m.name: m for m in (
    MixerKind("attention", "maxlite.models.layers:Attention", _attention_flops, _attention_cache,
              "maxlite.models.gqa_cache", checks=(_CHECKS + "chunked",),
              layout_checks=(_CHECKS + "chunked_layout",), megatron=_MEGATRON + "attention", image_blocks=True),
    MixerKind("mla", "maxlite.models.mla:MLA", _mla_flops, _mla_cache, "maxlite.models.mla_cache",
              checks=(_CHECKS + "mla",),
              megatron_refusal="multi-head latent attention (not mapped yet: --multi-latent-attention and its ranks)"),
    MixerKind("dsa", "maxlite.models.dsa:DSA", _dsa_flops, _dsa_cache, "maxlite.models.dsa_cache",
              checks=(_CHECKS + "mla", _CHECKS + "dsa"), layout_checks=(_CHECKS + "dsa_layout",),
              megatron_refusal="DeepSeek sparse attention (its indexer is not Megatron-LM's GPT layer)"),
    MixerKind("gated_deltanet", "maxlite.models.gated_deltanet:GatedDeltaNet", _gdn_flops, _gdn_cache,
              "maxlite.models.gdn_cache", recurrent=True, layout_checks=(_CHECKS + "gated_deltanet_layout",),
              megatron_refusal="gated delta-net layers (its GPT layer is attention only)"),
    # Kimi Linear's delta attention: the delta-net's decode cache (the same state and windows) and checks
    MixerKind("kda", "maxlite.models.kda:KimiDeltaAttention", _kda_flops, _gdn_cache, "maxlite.models.gdn_cache",
              recurrent=True, checks=(_CHECKS + "kda",), layout_checks=(_CHECKS + "gated_deltanet_layout",),
              megatron_refusal="Kimi delta attention layers (its GPT layer is attention only)"),
    MixerKind("mamba2", "maxlite.models.mamba2:Mamba2", _mamba2_flops, _mamba2_cache, "maxlite.models.mamba2_cache",
              recurrent=True, checks=(_CHECKS + "mamba2",), layout_checks=(_CHECKS + "mamba2_layout",),
              megatron_refusal="Mamba-2 layers (its GPT layer is attention only; Megatron's hybrid model is not mapped)"),
    # DeepSeek-V4 (maxlite/models/v4_attention.py): one shared key=value head over a sliding window, alone
    # or with compressed entries of the whole context (heavily compressed, or compressed and sparse)
    *(MixerKind(f"v4_{v}", f"maxlite.models.v4_attention:{cls}", _v4_flops, _v4_cache, "maxlite.models.v4_cache",
                checks=(_CHECKS + "v4",), megatron_refusal="DeepSeek-V4's attention (a shared key=value head, compressed entries, grouped output)")
      for v, cls in (("sliding", "SlidingAttention"), ("hca", "HeavilyCompressedAttention"),
                     ("csa", "CompressedSparseAttention"))),
    # a layer without a mixer (Nemotron-H's MLP blocks): nothing added, no norm, no cache
    MixerKind("none", "maxlite.models.no_branch:NoMixer", lambda cfg, B, T, variant: {},
              lambda cfg, variant, length: 0, "maxlite.models.no_branch", raw_input=True,
              megatron_refusal="layers without a mixer (its GPT layer has attention in every layer)"),
    # Gemma 4 (maxlite/models/gemma4.py): local and (wide) global layers, each also as a layer that
    # reuses the keys and values of the last earlier layer of its kind
    *(MixerKind(f"gemma4_{v}{'_shared' if shared else ''}", f"maxlite.models.gemma4:{v}_attention{'_shared' if shared else ''}",
                *_shaped_attention(v == "global", shared),
                "maxlite.models.gemma4_shared_cache" if shared else "maxlite.models.gemma4_cache",
                checks=(_CHECKS + "gemma4", *((_CHECKS + "kv_sharing",) if shared else ())),
                megatron_refusal="layers reusing an earlier layer's keys and values (num_kv_shared_layers)" if shared
                else _GEMMA4_REFUSAL, image_blocks=True)
      for v in ("local", "global") for shared in (False, True)),
)}
_MOE_REFUSAL = "a mixture of experts (not mapped yet: --num-experts and its routing keys)"
FEED_FORWARDS = {f.name: f for f in (
    FeedForwardKind("dense", "maxlite.models.layers:make_mlp", _dense_flops, megatron=_MEGATRON + "dense"),
    FeedForwardKind("moe", "maxlite.models.moe:MoE", _moe_flops, checks=(_CHECKS + "moe",),
                    layout_checks=(_CHECKS + "moe_layout",), megatron_refusal=_MOE_REFUSAL),
    # DeepSeek-V4's first layers: experts chosen by a table of token ids (the token_ids side), weighted by the router
    FeedForwardKind("hash_moe", "maxlite.models.moe:hash_moe", _moe_flops, checks=(_CHECKS + "moe",),
                    layout_checks=(_CHECKS + "moe_layout",), megatron_refusal=_MOE_REFUSAL, side_args=True),
    # a layer without a feed-forward (Nemotron-H's Mamba-2 and attention blocks)
    FeedForwardKind("none", "maxlite.models.no_branch:no_feed_forward", lambda cfg, tokens: 0, raw_input=True,
                    megatron_refusal="layers without an MLP (its GPT layer has an MLP in every layer)"),
    FeedForwardKind("dense_wide", "maxlite.models.gemma4:wide_mlp", lambda cfg, tokens: 2 * _dense_flops(cfg, tokens),
                    megatron_refusal="MLPs of two widths (use_double_wide_mlp)"),
    FeedForwardKind("gemma4_moe", "maxlite.models.gemma4:MoEBlock",
                    lambda cfg, tokens: _dense_flops(cfg, tokens) + _moe_flops(cfg, tokens), raw_input=True,
                    checks=(_CHECKS + "moe",), layout_checks=(_CHECKS + "moe_layout",),
                    megatron_refusal=_MOE_REFUSAL),
)}
# every kind has its layout (its variants) and the registry its entry: one set of names
assert set(MIXERS) == set(VARIANTS) and ROUTED <= set(FEED_FORWARDS)


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
    return next(filter(None, (load(path)(cfg, used) for path, used in checks.items())), None)


def decode_cache_numbers(cfg, length: int) -> tuple[int, int]:
    """(The decode cache of one sequence of `length` positions, all layers; the part of it the
    recurrent layers hold: their state, the same at any length), in numbers of the compute dtype. The
    rest grows with the length (a sliding window's keeps at most W positions)."""
    total = state = 0
    for k in layer_kinds(cfg):
        mixer = MIXERS[k.mixer]
        numbers = mixer.cache_numbers(cfg, k.variant, length)
        total += numbers
        state += numbers if mixer.recurrent else 0
    return total, state


def cache_numbers_per_token(cfg, length: int) -> float:
    """Decode-cache numbers per token of a sequence of `length` positions, all layers (a sliding
    window's keeps at most W positions whatever the length)."""
    return decode_cache_numbers(cfg, length)[0] / length
