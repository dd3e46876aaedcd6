"""Nemotron-H (`model_type: nemotron_h`, NemotronHForCausalLM), both ways.

Each HF block is `norm` (RMSNorm) then its `mixer`: a Mamba-2 layer (maxlite/models/mamba2.py), an
attention layer without positions (GQA, scores by 1/√head_dim), or an MLP (up, relu², down); maxlite
keeps the norm as the mixer's `attn_norm`, or the MLP's `mlp_norm` in a layer without a mixer.
HF names a Mamba-2 block `linear_attention` (maxlite's layer_types: `mamba`). HF's tensors:

  mixer.in_proj [M·P + M·P + 2·G·S + M, D]: z, x, B, C, dt  ↔ attn.z, attn.x [D, M, P], attn.B, attn.C
    [D, G, S], attn.dt [D, M]
  mixer.conv1d.weight [M·P + 2·G·S, 1, W], .bias  ↔ attn.conv_x / conv_B / conv_C [W, ·, ·], conv_bias_*
  mixer.A_log, D, dt_bias [M], norm.weight [M·P], out_proj [D, M·P]  ↔ attn.A_log, D, dt_bias,
    norm_scale [M, P], o [M, P, D]
  mixer.{q,k,v,o}_proj  ↔ attn.q, k, v, o;   mixer.up_proj, down_proj  ↔ mlp.up, mlp.down

Not modelled (refused at import in one line): its mixture-of-experts blocks (`moe`, Nemotron 3),
multi-token prediction, biases, a clamped time step, other activations.
"""

from __future__ import annotations

import math

import numpy as np

from maxlite.bridge import hf_llama
from maxlite.bridge.hf_convert import TensorMap, config_tail, linear, same
from maxlite.families.nemotron_h import FAMILY
from maxlite.models.layout import hf_layer_types

# HF's block names ↔ maxlite's layer_types (HF calls a Mamba-2 block linear attention)
TO_MAXLITE = {"linear_attention": "mamba", "full_attention": "full_attention", "mlp": "mlp"}
TO_HF = {v: k for k, v in TO_MAXLITE.items()}
M2 = "mamba2"


def check_supported(cfg) -> None:
    if cfg.decoder_block != FAMILY.name:
        raise ValueError(f"decoder_block={cfg.decoder_block} is not nemotron_h")
    if cfg.use_bias:
        raise ValueError("use_bias=true: NemotronHForCausalLM has no attention biases")
    if cfg.sliding_window:
        raise ValueError(f"sliding_window={cfg.sliding_window}: Nemotron-H's attention layers are global")
    hf_llama.check_plain_attention(cfg, "NemotronHForCausalLM")


def _split(name: str, paths, shapes, lead: tuple[int, ...], tail: tuple[int, ...] = ()) -> TensorMap:
    """One HF tensor [Σ parts, *tail] (a fused projection: lead = (D,), kernels [D, *part]; a conv:
    lead = (W,), taps [W, *part] ↔ [Σ, 1, W]; lead = (): biases) ↔ several leaves side by side."""
    sizes = [math.prod(s) for s in shapes]
    cuts = np.cumsum(sizes)[:-1]
    n = math.prod(lead)
    ml = tuple((*lead, *s) for s in shapes)

    def to_hf(*ws):
        return np.concatenate([w.reshape(n, -1) for w in ws], axis=1).T.reshape(sum(sizes), *tail)

    def from_hf(t):
        return tuple(p.T.reshape(m) for p, m in zip(np.split(t.reshape(sum(sizes), n), cuts, axis=0), ml))
    return TensorMap(name, tuple(paths), (sum(sizes), *tail), ml, to_hf, from_hf, mixer=M2)


def _with(t: TensorMap, mixer: str) -> TensorMap:
    import dataclasses
    return dataclasses.replace(t, mixer=mixer)


def tensor_maps(cfg, prefix: str = "backbone.") -> list[TensorMap]:
    """Every tensor, the decoder's under `prefix`: `backbone.` as transformers saves and NVIDIA
    publishes them (transformers' own module path, `model.`, loads too)."""
    check_supported(cfg)
    D, N, K, H, F = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim, cfg.base_mlp_dim
    M, P, G, S, W = (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_num_groups, cfg.mamba_state_dim,
                     cfg.mamba_conv_kernel_dim)
    V = cfg.vocab_size
    b = prefix + "layers.{i}."
    x = b + "mixer."
    maps = [same(prefix + "embeddings.weight", ("embedding",), (V, D), layer=False),
            same(prefix + "norm_f.weight", ("final_norm", "scale"), (D,), layer=False)]
    if not cfg.logits_via_embedding:
        maps.append(linear("lm_head.weight", ("unembedding",), (D,), (V,), layer=False))
    norm = same(b + "norm.weight", ("attn_norm", "scale"), (D,))
    maps += [_with(norm, M2), _with(norm, "attention"),
             _with(same(b + "norm.weight", ("mlp_norm", "scale"), (D,)), "none")]
    maps += [_with(t, "attention") for t in (
        linear(x + "q_proj.weight", ("attn", "q"), (D,), (N, H)), linear(x + "k_proj.weight", ("attn", "k"), (D,), (K, H)),
        linear(x + "v_proj.weight", ("attn", "v"), (D,), (K, H)), linear(x + "o_proj.weight", ("attn", "o"), (N, H), (D,)))]
    maps += [_with(t, "none") for t in (linear(x + "up_proj.weight", ("mlp", "up"), (D,), (F,)),
                                        linear(x + "down_proj.weight", ("mlp", "down"), (F,), (D,)))]
    conv = [(M, P), (G, S), (G, S)]
    maps += [_split(x + "in_proj.weight", [("attn", k) for k in ("z", "x", "B", "C", "dt")],
                    [(M, P), (M, P), (G, S), (G, S), (M,)], (D,), (D,)),
             _split(x + "conv1d.weight", [("attn", k) for k in ("conv_x", "conv_B", "conv_C")], conv, (W,), (1, W))]
    if cfg.mamba_conv_bias:
        maps.append(_split(x + "conv1d.bias", [("attn", k) for k in ("conv_bias_x", "conv_bias_B", "conv_bias_C")],
                           conv, ()))
    maps += [_with(t, M2) for t in (
        same(x + "A_log", ("attn", "A_log"), (M,)), same(x + "D", ("attn", "D"), (M,)),
        same(x + "dt_bias", ("attn", "dt_bias"), (M,)), same(x + "norm.weight", ("attn", "norm_scale"), (M, P), (M * P,)),
        linear(x + "out_proj.weight", ("attn", "o"), (M, P), (D,)))]
    return maps


def import_maps(cfg, names: set[str]) -> list[TensorMap]:
    return tensor_maps(cfg, "model." if "model.embeddings.weight" in names else "backbone.")


ignore = hf_llama.ignore


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    check_supported(cfg)
    return {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.base_emb_dim,
            "layers_block_type": [TO_HF[t] for t in hf_layer_types(cfg)],
            "num_attention_heads": cfg.base_num_query_heads, "num_key_value_heads": cfg.base_num_kv_heads,
            "head_dim": cfg.head_dim, "intermediate_size": cfg.base_mlp_dim, "mlp_hidden_act": "relu2",
            "max_position_embeddings": hf_llama.max_positions(cfg), "layer_norm_epsilon": cfg.normalization_layer_epsilon,
            "mamba_num_heads": cfg.mamba_num_heads, "mamba_head_dim": cfg.mamba_head_dim,
            "ssm_state_size": cfg.mamba_state_dim, "n_groups": cfg.mamba_num_groups, "conv_kernel": cfg.mamba_conv_kernel_dim,
            "use_conv_bias": bool(cfg.mamba_conv_bias), "chunk_size": cfg.mamba_chunk_size, "mamba_hidden_act": "silu",
            "use_bias": False, "mlp_bias": False, "attention_bias": False, "mamba_proj_bias": False,
            "tie_word_embeddings": bool(cfg.logits_via_embedding), "initializer_range": cfg.init_scale,
            "num_nextn_predict_layers": 0, **config_tail(dtype, bos_id, eos_id)}


def _block_types(hf: dict) -> list[str]:
    """config.json's blocks: `layers_block_type`, or the older `hybrid_override_pattern` (M * - E)."""
    types = hf.get("layers_block_type") or hf.get("layer_types")
    if types is None and hf.get("hybrid_override_pattern"):
        types = [{"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}.get(c, c)
                 for c in hf["hybrid_override_pattern"]]
    types = [{"mamba": "linear_attention", "attention": "full_attention"}.get(t, t) for t in types or []]
    unknown = sorted({t for t in types if t not in TO_MAXLITE})
    if not types or unknown:
        raise ValueError(f"config.json: block type {(unknown or ['(none)'])[0]!r} is not modelled by maxlite's "
                         f"Nemotron-H (Mamba-2, attention and MLP blocks are)")
    return types


def _number(v) -> float:
    """A config.json number; transformers writes infinity as {"__float__": "Infinity"}."""
    return float(v["__float__"] if isinstance(v, dict) else v)


def config_overrides(hf: dict) -> dict:
    if hf.get("model_type") != "nemotron_h":
        raise ValueError(f"config.json model_type={hf.get('model_type')!r} is not nemotron_h")
    types = _block_types(hf)
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if hf.get(key, want) != want:
            raise ValueError(f"config.json: {key}={hf[key]!r}: maxlite's Nemotron-H has {want}")
    biased = [k for k in ("use_bias", "mlp_bias", "attention_bias", "mamba_proj_bias") if hf.get(k)]
    if biased:
        raise ValueError(f"config.json: {biased[0]}=true: maxlite's Nemotron-H has no such biases")
    limit = [_number(v) for v in hf.get("time_step_limit", hf.get("mamba_dt_limit")) or (0.0, float("inf"))]
    if limit[0] > 0 or limit[1] != float("inf"):
        raise ValueError(f"config.json: time_step_limit={list(limit)}: maxlite's Mamba-2 does not clamp the time step")
    if hf.get("num_nextn_predict_layers"):
        raise ValueError("config.json: num_nextn_predict_layers > 0: maxlite does not model multi-token prediction")
    D, N = hf["hidden_size"], hf["num_attention_heads"]
    return {"decoder_block": FAMILY.name, "base_emb_dim": D, "base_num_decoder_layers": len(types),
            "layer_types": [TO_MAXLITE[t] for t in types],
            "base_num_query_heads": N, "base_num_kv_heads": hf.get("num_key_value_heads") or N,
            "head_dim": hf.get("head_dim") or D // N, "base_mlp_dim": hf["intermediate_size"],
            "vocab_size": hf["vocab_size"], "max_position_embeddings": hf.get("max_position_embeddings", 4096),
            "normalization_layer_epsilon": float(hf.get("layer_norm_epsilon", 1e-5)),
            "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)), "sliding_window": 0, "use_bias": False,
            "mamba_num_heads": hf.get("mamba_num_heads", 128), "mamba_head_dim": hf.get("mamba_head_dim", 64),
            "mamba_state_dim": hf.get("ssm_state_size", 128),
            "mamba_num_groups": hf.get("n_groups", hf.get("mamba_n_groups", 8)),
            "mamba_conv_kernel_dim": hf.get("conv_kernel", hf.get("mamba_d_conv", 4)),
            "mamba_conv_bias": bool(hf.get("use_conv_bias", hf.get("mamba_conv_bias", True))),
            "mamba_chunk_size": hf.get("chunk_size", hf.get("mamba_chunk_size", 128))}
