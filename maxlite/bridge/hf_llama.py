"""The Llama-style tensor table and config.json helpers the family adapters share (llama2's, Qwen's,
Gemma's, OLMo's, ...: maxlite/families/*/hf.py), read from the family's traits.

Conventions (checked against transformers by tests/test_bridge_hf*.py, not assumed):
- RoPE: maxlite rotates split halves of each head (x[:H/2], x[H/2:]), exactly HF's `rotate_half`,
  so q/k need no permutation. (Meta's original checkpoints interleave pairs; HF's own converter
  permutes those once, with the kv-head count for k. Weights already in HF layout need nothing.)
- Kernels: maxlite computes x @ W with W [in, out]; torch's nn.Linear stores [out, in]:
  q [D,N,H] → q_proj.weight [N·H, D]; k,v [D,K,H] → [K·H, D]; o [N,H,D] → o_proj.weight [D, N·H];
  gate/up [D,F] → [F,D]; down [F,D] → [D,F]; unembedding [D,V] → lm_head.weight [V,D].
- Head order: query head n uses kv head n // (N/K) in both (maxlite reshapes N → [K, N/K]).
- Tied embeddings (logits_via_embedding): no lm_head tensor, `tie_word_embeddings: true`.
- Norm scales map 1:1 (RMSNorm in float32 both sides; Gemma's (1 + w) stores w in both).
- By trait: biases (`q/k/v/o_proj.bias`), q/k norms (`self_attn.{q,k}_norm.weight`: [H], or
  [N·H] / [K·H] over every head at once), and with post-norms Gemma's names: `post_attention_layernorm`
  is then the norm *after* attention and `pre_feedforward_layernorm` / `post_feedforward_layernorm`
  surround the MLP (in Llama, `post_attention_layernorm` is the MLP's pre-norm); without pre-norms
  (OLMo 2/3) there is no `input_layernorm` nor `pre_feedforward_layernorm`.
"""

from __future__ import annotations

import re
import sys

from maxlite.bridge.hf_convert import TensorMap, config_tail, linear, same
from maxlite.models.families import family, has_qk_norm
from maxlite.models.layout import check_layer_types, layer_windows


def check_plain_attention(cfg, name: str, qk_norm: bool = False) -> None:
    """Architectures with one RoPE and scores scaled by 1/√head_dim (and `qk_norm`: a use_qk_norm
    switch, as GLM-4.5's; else q/k norms only where the family has them)."""
    if cfg.use_qk_norm and not (qk_norm or family(cfg).qk_norm):
        raise ValueError(f"use_qk_norm=true: {name} has no q/k norms")
    if cfg.local_rope_max_timescale or cfg.query_pre_attn_scalar not in (0, cfg.head_dim):
        raise ValueError(f"{name} has one RoPE for every layer and scales scores by 1/sqrt(head_dim): set "
                         f"local_rope_max_timescale=0 and query_pre_attn_scalar=0 to export as {name}")


def head_maps(cfg, prefix: str = "model.") -> list[TensorMap]:
    """The token embedding, the final norm and (untied) the output head, in HF's naming."""
    D, V = cfg.base_emb_dim, cfg.vocab_size
    maps = [same(prefix + "embed_tokens.weight", ("embedding",), (V, D), layer=False),
            same(prefix + "norm.weight", ("final_norm", "scale"), (D,), layer=False)]
    if not cfg.logits_via_embedding:
        maps.append(linear("lm_head.weight", ("unembedding",), (D,), (V,), layer=False))
    return maps


def decoder_maps(cfg, prefix: str = "model.") -> list[TensorMap]:
    """Every tensor of a Llama-style decoder in HF's naming (layer maps carry `{i}`), by trait;
    `prefix` is the decoder's (a multimodal checkpoint nests it)."""
    fam = family(cfg)
    D, N, K, H = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim
    F = cfg.base_mlp_dim
    layer = prefix + "layers.{i}."
    a, m = layer + "self_attn.", layer + "mlp."
    maps = head_maps(cfg, prefix)
    if fam.pre_norms:
        maps.append(same(layer + "input_layernorm.weight", ("attn_norm", "scale"), (D,)))
    maps += [
        linear(a + "q_proj.weight", ("attn", "q"), (D,), (N, H)),
        linear(a + "k_proj.weight", ("attn", "k"), (D,), (K, H)),
        linear(a + "v_proj.weight", ("attn", "v"), (D,), (K, H)),
        linear(a + "o_proj.weight", ("attn", "o"), (N, H), (D,)),
    ]
    bias_shapes = {"q_bias": ((N, H), (N * H,)), "k_bias": ((K, H), (K * H,)), "v_bias": ((K, H), (K * H,)),
                   "o_bias": ((D,), (D,))}
    for leaf in fam.bias_leaves if cfg.use_bias else ():
        shape, hf_shape = bias_shapes[leaf]
        maps.append(same(f"{a}{leaf[0]}_proj.bias", ("attn", leaf), shape, hf_shape))
    if has_qk_norm(cfg):  # per head [H], or over the whole projection [N·H] / [K·H]
        q_shape, k_shape = ((N * H,), (K * H,)) if fam.qk_norm_heads else ((H,), (H,))
        maps += [same(a + "q_norm.weight", ("attn", "q_norm", "scale"), q_shape),
                 same(a + "k_norm.weight", ("attn", "k_norm", "scale"), k_shape)]
    if fam.post_norms:
        maps += [same(layer + "post_attention_layernorm.weight", ("attn_post_norm", "scale"), (D,)),
                 same(layer + "post_feedforward_layernorm.weight", ("mlp_post_norm", "scale"), (D,))]
    if fam.post_norms and fam.pre_norms:
        maps.append(same(layer + "pre_feedforward_layernorm.weight", ("mlp_norm", "scale"), (D,)))
    elif fam.pre_norms:
        maps.append(same(layer + "post_attention_layernorm.weight", ("mlp_norm", "scale"), (D,)))
    maps += [
        linear(m + "gate_proj.weight", ("mlp", "gate"), (D,), (F,)),
        linear(m + "up_proj.weight", ("mlp", "up"), (D,), (F,)),
        linear(m + "down_proj.weight", ("mlp", "down"), (F,), (D,)),
    ]
    return maps


def ignore(name: str) -> bool:
    """Tensors some writers store that carry no weights."""
    return name.endswith("rotary_emb.inv_freq")


# ---- config.json: RoPE, both ways ----

def rope_dict(cfg, local: bool = False) -> dict:
    """HF's rope parameters of global layers (or of sliding-window layers with their own base)."""
    if local and cfg.local_rope_max_timescale > 0:
        return {"rope_type": "default", "rope_theta": float(cfg.local_rope_max_timescale)}
    rope: dict = {"rope_type": "default"}
    if cfg.rope_scaling_factor > 0 and cfg.rope_scaling_type == "linear":
        rope = {"rope_type": "linear", "type": "linear", "factor": cfg.rope_scaling_factor}
    elif cfg.rope_scaling_factor > 0 and cfg.rope_scaling_type == "yarn":
        rope = {"rope_type": "yarn", "type": "yarn", "factor": cfg.rope_scaling_factor,
                "original_max_position_embeddings": cfg.rope_original_max_position,
                "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow, "truncate": cfg.rope_truncate,
                **{k: v for k, v in (("mscale", cfg.mscale), ("mscale_all_dim", cfg.mscale_all_dim),
                                     ("attention_factor", cfg.rope_attention_factor)) if v}}
    elif cfg.rope_scaling_factor > 0:
        rope = {"rope_type": "llama3", "type": "llama3", "factor": cfg.rope_scaling_factor,
                "low_freq_factor": cfg.rope_low_freq_factor,
                "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_position}
    partial = {"partial_rotary_factor": cfg.partial_rotary_factor} if cfg.partial_rotary_factor != 1 else {}
    return {**rope, "rope_theta": float(cfg.rope_max_timescale), **partial}


def max_positions(cfg) -> int:
    """The context length config.json records: the recipe's, and past llama3's original context
    (HF wants it larger; informational for llama3 RoPE). A model's own value is kept as it is."""
    max_pos = max(cfg.max_position_embeddings, cfg.max_target_length)
    if cfg.rope_scaling_factor > 0 and cfg.rope_scaling_type == "llama3" and max_pos <= cfg.rope_original_max_position:
        max_pos = int(cfg.rope_original_max_position * cfg.rope_scaling_factor)
    return max_pos


def rope_keys(rope: dict, theta, hf: dict | None = None) -> dict:
    """HF rope parameters (5.x `rope_parameters` or 4.x `rope_scaling`) → maxlite's global RoPE keys;
    `hf` (config.json) supplies what may sit beside them: partial_rotary_factor, the context length."""
    hf = hf or {}
    theta = rope.get("rope_theta", theta)
    kind = rope.get("rope_type", rope.get("type", "default"))
    out = {"rope_max_timescale": int(theta) if float(theta).is_integer() else theta,
           "rope_scaling_factor": 0.0, "rope_scaling_type": "llama3",
           "partial_rotary_factor": float(rope.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0)}
    if kind == "yarn":
        original = int(rope.get("original_max_position_embeddings") or hf["max_position_embeddings"])
        factor = rope.get("factor") or hf["max_position_embeddings"] / original  # HF's rule when unstated
        out.update(rope_scaling_type="yarn", rope_scaling_factor=float(factor), rope_original_max_position=original,
                   beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                   mscale=float(rope.get("mscale") or 0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
                   rope_truncate=bool(rope.get("truncate", True)),
                   rope_attention_factor=float(rope.get("attention_factor") or 0))
    elif kind == "llama3":
        out.update(rope_scaling_factor=float(rope["factor"]),
                   rope_low_freq_factor=float(rope["low_freq_factor"]),
                   rope_high_freq_factor=float(rope["high_freq_factor"]),
                   rope_original_max_position=int(rope["original_max_position_embeddings"]))
    elif kind == "linear":
        out.update(rope_scaling_factor=float(rope["factor"]), rope_scaling_type="linear")
    elif kind != "default":
        raise ValueError(f"config.json rope type {kind!r} is not supported (default, linear, llama3 and yarn are)")
    return out


def common_config(cfg, architecture: str, model_type: str, dtype: str, bos_id, eos_id) -> dict:
    """The keys every Llama-style config.json has; transformers 5.x reads `rope_parameters` and
    `dtype`, 4.x `rope_scaling`, `rope_theta` and `torch_dtype`."""
    rope = rope_dict(cfg)
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": cfg.base_emb_dim,
        "intermediate_size": cfg.base_mlp_dim,
        "num_hidden_layers": cfg.base_num_decoder_layers,
        "num_attention_heads": cfg.base_num_query_heads,
        "num_key_value_heads": cfg.base_num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": max_positions(cfg),
        "rms_norm_eps": cfg.normalization_layer_epsilon,
        "rope_theta": float(cfg.rope_max_timescale),
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if cfg.rope_scaling_factor > 0 else None,
        "rope_parameters": rope,
        **({"partial_rotary_factor": cfg.partial_rotary_factor} if cfg.partial_rotary_factor != 1 else {}),
        "tie_word_embeddings": bool(cfg.logits_via_embedding),
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_scale,
        **config_tail(dtype, bos_id, eos_id),
    }


def common_overrides(hf: dict, decoder_block: str) -> dict:
    """The Llama-style config.json keys → maxlite model keys."""
    D, N = hf["hidden_size"], hf["num_attention_heads"]
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    return {
        "decoder_block": decoder_block,
        "base_emb_dim": D,
        "base_num_decoder_layers": hf["num_hidden_layers"],
        "base_num_query_heads": N,
        "base_num_kv_heads": hf.get("num_key_value_heads") or N,
        "base_mlp_dim": hf["intermediate_size"],
        "head_dim": hf.get("head_dim") or D // N,
        "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf.get("max_position_embeddings", 8192),
        "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
        "sliding_window": 0,
        **rope_keys(rope, hf.get("rope_theta", 10000.0), hf),
    }


def windows_of(hf: dict, num_layers: int) -> list[int]:
    """Each layer's window as config.json states it (`layer_types`, else Qwen's use_sliding_window
    from max_window_layers on, else Mistral's sliding_window on every layer)."""
    window = hf.get("sliding_window") or 0
    types = hf.get("layer_types")
    if types is None and "use_sliding_window" in hf:
        first = hf.get("max_window_layers", num_layers)
        types = ["sliding_attention" if hf["use_sliding_window"] and i >= first else "full_attention"
                 for i in range(num_layers)]
    if types is None:
        return [window] * num_layers
    problem = check_layer_types(types, num_layers)
    if problem:
        raise ValueError(f"config.json: {problem}")
    if "chunked_attention" in types:
        raise ValueError(f"config.json: chunked_attention layers are Llama 4's (llama4_text), not "
                         f"{hf.get('model_type')}'s as maxlite models it")
    return [window if t == "sliding_attention" else 0 for t in types]


def pattern_keys(decoder_block: str, stated: list[int]) -> dict:
    """The imported model's layer pattern: nothing to record when its windows follow the family's
    pattern, else its own `layer_types` (a checkpoint states its own pattern; that is the pattern)."""
    import types

    shape = types.SimpleNamespace(decoder_block=decoder_block, sliding_window=max(stated), layer_types=(),
                                  attention_type="global", base_num_decoder_layers=len(stated))
    if list(layer_windows(shape)) == stated:
        return {}
    return {"layer_types": ["sliding_attention" if w else "full_attention" for w in stated]}


def check_mlp(hf: dict, activation: str) -> None:
    act = hf.get("hidden_act", hf.get("hidden_activation", activation))
    if act != activation or hf.get("mlp_bias"):
        raise ValueError(f"config.json: hidden_act={act!r}, mlp_bias={hf.get('mlp_bias', False)}: this family's "
                         f"MLP is {activation}-gated without biases")


def left_out(names: set[str], prefixes: tuple[str, ...], what: str, why: str) -> set[str]:
    """An adapter's `skipped`: the tensors under `prefixes` (a part of the checkpoint maxlite does not
    import, `what`), left out and said in one line with `why`."""
    left = {n for n in names if n.startswith(prefixes)}
    if left:
        print(f"maxlite: {len(left)} tensors of {what} ({', '.join(p + '*' for p in prefixes)}) not imported: {why}",
              file=sys.stderr, flush=True)
    return left


def layers_past_the_last(cfg, names: set[str], what: str) -> set[str]:
    """An adapter's `skipped`: the tensors of layers past the last decoder layer (a checkpoint's
    multi-token-prediction modules, `what`), left out and said in one line."""
    L = cfg.base_num_decoder_layers
    extra = {n for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n)) and int(m.group(1)) >= L}
    if extra:
        print(f"maxlite: {len(extra)} tensors of {what} (model.layers.{L}+) are not imported: maxlite's model "
              "predicts the next token only", file=sys.stderr)
    return extra
