"""What Megatron-LM's GPT layer expresses of the kinds it can map: one function per kind, named by
the kind's `megatron` in maxlite/models/kinds.py (a kind it cannot map names its one-line refusal
there instead). maxlite/bridge/nemo.py asks every kind a model's layers use.

A function takes (cfg, notes) — `notes`: what maps only approximately, appended to — and returns a
`Part`. Flags are Megatron-LM's `pretrain_gpt.py` arguments, NeMo fields megatron-core's
TransformerConfig names (set as `recipe.model.config.<field>`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from maxlite.models.families import family, has_qk_norm
from maxlite.models.layout import layer_windows


@dataclasses.dataclass
class Part:
    megatron: list[tuple[str, Any]] = dataclasses.field(default_factory=list)  # (flag, value); None: a bare flag
    nemo: list[tuple[str, Any]] = dataclasses.field(default_factory=list)      # (TransformerConfig field, value)
    refused: list[str] = dataclasses.field(default_factory=list)  # what it cannot express, a line each


def attention(cfg, notes: list[str]) -> Part:
    """Grouped-query attention: heads and groups, q/k norms, sliding windows, the score scale, biases."""
    N, K, H = cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim
    fam = family(cfg)
    part = Part([("--num-attention-heads", N), ("--kv-channels", H)],
                [("num_attention_heads", N), ("kv_channels", H), ("num_query_groups", K)])
    if K < N:
        part.megatron += [("--group-query-attention", None), ("--num-query-groups", K)]
    if has_qk_norm(cfg):  # Megatron normalises q and k per head with the model's `normalization`
        part.megatron.append(("--qk-layernorm", None))
    part.nemo.append(("qk_layernorm", has_qk_norm(cfg)))
    if cfg.sliding_window:  # (left, right) keys around each query: i − (W − 1) … i
        part.megatron.append(("--window-size", [cfg.sliding_window - 1, 0]))
        part.nemo.append(("window_size", (cfg.sliding_window - 1, 0)))
        period = _skip_frequency(cfg)
        if period is None:
            part.refused.append("a layer pattern other than every p-th layer global (--window-attn-skip-freq)")
        elif period:  # every period-th layer (1-indexed) is global
            part.megatron.append(("--window-attn-skip-freq", period))
            part.nemo.append(("window_attn_skip_freq", period))
    if cfg.query_pre_attn_scalar:
        part.megatron.append(("--softmax-scale", cfg.query_pre_attn_scalar ** -0.5))
        part.nemo.append(("softmax_scale", cfg.query_pre_attn_scalar ** -0.5))
    if cfg.use_bias and fam.biases in ("attention", "qkv"):
        part.megatron.append(("--add-qkv-bias", None))
    if cfg.use_bias and fam.biases == "attention":
        notes.append(f"use_bias=true on a {cfg.decoder_block} block: maxlite has q/k/v/o biases and no MLP "
                     f"biases; Megatron's --add-qkv-bias covers q/k/v only (no o_proj bias)")
    part.nemo.append(("add_qkv_bias", bool(cfg.use_bias and fam.biases in ("attention", "qkv"))))
    if cfg.attention_sink:
        part.refused.append("attention sinks")
    if cfg.chunk_attn_window_size or fam.global_nope:
        part.refused.append("Llama 4's chunked attention and NoPE global layers")
    return part


def _skip_frequency(cfg) -> int | None:
    """p when exactly every p-th layer (1-indexed) is global (Megatron's --window-attn-skip-freq);
    0 when every layer is local; None for any other layer pattern."""
    windows = layer_windows(cfg)
    if all(windows):
        return 0
    p = windows.index(0) + 1
    return p if all((w == 0) == ((i + 1) % p == 0) for i, w in enumerate(windows)) else None


def dense(cfg, notes: list[str]) -> Part:
    """The dense MLP: its width (its activation is the family's, mapped with the family's traits)."""
    return Part([("--ffn-hidden-size", cfg.base_mlp_dim)], [("ffn_hidden_size", cfg.base_mlp_dim)])
