"""maxlite llama2-block params ↔ Hugging Face `LlamaForCausalLM` (config.json + safetensors).

Conventions (checked against transformers by tests/test_bridge_hf.py, not assumed):
- RoPE: maxlite rotates split halves of each head (x[:H/2], x[H/2:]), exactly HF's `rotate_half`,
  so q/k need no permutation. (Meta's original checkpoints interleave pairs; HF's own converter
  permutes those once, with the kv-head count for k. Weights already in HF layout need nothing.)
- Kernels: maxlite computes x @ W with W [in, out]; torch's nn.Linear stores [out, in]:
  q [D,N,H] → q_proj.weight [N·H, D]; k,v [D,K,H] → [K·H, D]; o [N,H,D] → o_proj.weight [D, N·H];
  gate/up [D,F] → [F,D]; down [F,D] → [D,F]; unembedding [D,V] → lm_head.weight [V,D].
- Head order: query head n uses kv head n // (N/K) in both (maxlite reshapes N → [K, N/K]).
- Tied embeddings (logits_via_embedding): no lm_head tensor, `tie_word_embeddings: true`.
- RMSNorm scales map 1:1 (both compute x·rsqrt(mean(x²)+eps)·scale in float32).
"""

from __future__ import annotations

from maxlite.bridge.hf_convert import TensorMap, config_tail, linear, same


def check_supported(cfg) -> None:
    if cfg.decoder_block != "llama2":
        raise ValueError(
            f"decoder_block={cfg.decoder_block}: only llama2-block models (Llama 2/3/3.1/3.2, Mistral) "
            f"have a Hugging Face Llama equivalent; GPT-3 style models (LayerNorm, GELU, learned "
            f"positions) export as GPT-2 instead")


def tensor_maps(cfg) -> list[TensorMap]:
    """Every tensor of the model in HF's naming (layer maps carry `{i}`)."""
    check_supported(cfg)
    D, N, K, H = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim
    F, V = cfg.base_mlp_dim, cfg.vocab_size
    a, m = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    maps = [same("model.embed_tokens.weight", ("embedding",), (V, D), layer=False),
            same("model.norm.weight", ("final_norm", "scale"), (D,), layer=False)]
    if not cfg.logits_via_embedding:
        maps.append(linear("lm_head.weight", ("unembedding",), (D,), (V,), layer=False))
    maps += [
        same("model.layers.{i}.input_layernorm.weight", ("attn_norm", "scale"), (D,)),
        linear(a + "q_proj.weight", ("attn", "q"), (D,), (N, H)),
        linear(a + "k_proj.weight", ("attn", "k"), (D,), (K, H)),
        linear(a + "v_proj.weight", ("attn", "v"), (D,), (K, H)),
        linear(a + "o_proj.weight", ("attn", "o"), (N, H), (D,)),
    ]
    if cfg.use_bias:  # maxlite's llama2 block has attention biases only (HF: attention_bias)
        maps += [same(a + "q_proj.bias", ("attn", "q_bias"), (N, H), (N * H,)),
                 same(a + "k_proj.bias", ("attn", "k_bias"), (K, H), (K * H,)),
                 same(a + "v_proj.bias", ("attn", "v_bias"), (K, H), (K * H,)),
                 same(a + "o_proj.bias", ("attn", "o_bias"), (D,))]
    maps += [
        same("model.layers.{i}.post_attention_layernorm.weight", ("mlp_norm", "scale"), (D,)),
        linear(m + "gate_proj.weight", ("mlp", "gate"), (D,), (F,)),
        linear(m + "up_proj.weight", ("mlp", "up"), (D,), (F,)),
        linear(m + "down_proj.weight", ("mlp", "down"), (F,), (D,)),
    ]
    return maps


def ignore(name: str) -> bool:
    """Tensors some writers store that carry no weights."""
    return name.endswith("rotary_emb.inv_freq")


# ---- config.json ----

def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """A config.json that transformers 5.x (`rope_parameters`, `dtype`) and 4.x (`rope_scaling`,
    `rope_theta`, `torch_dtype`) both read."""
    check_supported(cfg)
    rope: dict = {"rope_type": "default"}
    max_pos = max(cfg.max_position_embeddings, cfg.max_target_length)
    if cfg.rope_scaling_factor > 0:
        rope = {"rope_type": "llama3", "type": "llama3", "factor": cfg.rope_scaling_factor,
                "low_freq_factor": cfg.rope_low_freq_factor,
                "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_position}
        # HF wants the context to exceed the original one (informational for llama3 RoPE); a model's
        # own value (an imported Llama 3.1's 131072) is kept as it is.
        if max_pos <= cfg.rope_original_max_position:
            max_pos = int(cfg.rope_original_max_position * cfg.rope_scaling_factor)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.base_emb_dim,
        "intermediate_size": cfg.base_mlp_dim,
        "num_hidden_layers": cfg.base_num_decoder_layers,
        "num_attention_heads": cfg.base_num_query_heads,
        "num_key_value_heads": cfg.base_num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": max_pos,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.normalization_layer_epsilon,
        "rope_theta": float(cfg.rope_max_timescale),
        "rope_scaling": rope if cfg.rope_scaling_factor > 0 else None,
        "rope_parameters": {**rope, "rope_theta": float(cfg.rope_max_timescale)},
        "tie_word_embeddings": bool(cfg.logits_via_embedding),
        "attention_bias": bool(cfg.use_bias),
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": cfg.init_scale,
        "pretraining_tp": 1,
        **config_tail(dtype, bos_id, eos_id),
    }


def config_overrides(hf: dict) -> dict:
    """HF config.json → maxlite model keys (for `maxlite.config.load(**overrides)`)."""
    model_type = hf.get("model_type")
    if model_type not in ("llama", "mistral"):
        raise ValueError(f"config.json model_type={model_type!r}: only llama (and mistral without a "
                         f"sliding window) convert to maxlite's llama2 block")
    if hf.get("hidden_act", "silu") != "silu" or hf.get("mlp_bias"):
        raise ValueError("config.json: only SwiGLU MLPs (hidden_act silu, mlp_bias false) are supported")
    window = hf.get("sliding_window")
    if window and window < hf.get("max_position_embeddings", 0):
        raise ValueError(f"config.json: sliding_window={window} is not modelled by maxlite")
    D, N = hf["hidden_size"], hf["num_attention_heads"]
    rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    out = {
        "decoder_block": "llama2",
        "base_emb_dim": D,
        "base_num_decoder_layers": hf["num_hidden_layers"],
        "base_num_query_heads": N,
        "base_num_kv_heads": hf.get("num_key_value_heads") or N,
        "base_mlp_dim": hf["intermediate_size"],
        "head_dim": hf.get("head_dim") or D // N,
        "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf.get("max_position_embeddings", 8192),
        "rope_max_timescale": int(theta) if float(theta).is_integer() else theta,
        "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
        "use_bias": bool(hf.get("attention_bias", False)),
        "rope_scaling_factor": 0.0,
    }
    if kind == "llama3":
        out.update(rope_scaling_factor=float(rope["factor"]),
                   rope_low_freq_factor=float(rope["low_freq_factor"]),
                   rope_high_freq_factor=float(rope["high_freq_factor"]),
                   rope_original_max_position=int(rope["original_max_position_embeddings"]))
    elif kind != "default":
        raise ValueError(f"config.json rope type {kind!r} is not supported (only default and llama3)")
    return out
