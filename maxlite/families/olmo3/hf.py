"""OLMo 3 (AI2, `model_type: olmo3`): Olmo3ForCausalLM both ways.

The layer: no norm before attention or the MLP, an RMSNorm after each (before its residual add),
q and k normed over the whole projection (every head at once, [N·H] and [K·H] scales), RoPE, a
SwiGLU MLP; three sliding-window layers to one global (`layer_types`, 4,096 tokens). Tensor names
are Llama's without `input_layernorm`, with `post_attention_layernorm` after attention and
`post_feedforward_layernorm` after the MLP (maxlite.bridge.hf_llama.decoder_maps, by trait).

Each kind of layer may have its own RoPE (`rope_parameters.full_attention` / `.sliding_attention`:
maxlite's `rope_max_timescale` with its scaling, and `local_rope_max_timescale`, unscaled). Published
checkpoints extend the context to 65,536 tokens with YaRN on the global layers only.
"""

from __future__ import annotations

from maxlite.bridge import hf_llama
from maxlite.bridge.hf_convert import TensorMap, config_tail
from maxlite.families.olmo3 import FAMILY
from maxlite.models.layout import hf_layer_types


def check_supported(cfg) -> None:
    if cfg.decoder_block != FAMILY.name:
        raise ValueError(f"decoder_block={cfg.decoder_block} is not olmo3")
    if cfg.use_bias:
        raise ValueError("use_bias=true: Olmo3ForCausalLM has no attention biases")
    if cfg.query_pre_attn_scalar not in (0, cfg.head_dim):
        raise ValueError("Olmo3ForCausalLM scales scores by 1/sqrt(head_dim): set query_pre_attn_scalar=0")


def tensor_maps(cfg) -> list[TensorMap]:
    check_supported(cfg)
    return hf_llama.decoder_maps(cfg)


ignore = hf_llama.ignore


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    check_supported(cfg)
    rope, local = hf_llama.rope_dict(cfg), hf_llama.rope_dict(cfg, local=True)
    return {**hf_llama.common_config(cfg, "Olmo3ForCausalLM", "olmo3", dtype, bos_id, eos_id),
            "hidden_act": "silu", "attention_bias": False, "sliding_window": cfg.sliding_window or None,
            "layer_types": hf_layer_types(cfg) if cfg.sliding_window else ["full_attention"] * cfg.base_num_decoder_layers,
            "rope_parameters": {"full_attention": rope, "sliding_attention": local}, **config_tail(dtype, bos_id, eos_id)}


def config_overrides(hf: dict) -> dict:
    if hf.get("model_type") != "olmo3":
        raise ValueError(f"config.json model_type={hf.get('model_type')!r} is not olmo3")
    hf_llama.check_mlp(hf, "silu")
    if hf.get("attention_bias"):
        raise ValueError("config.json: attention_bias=true is not OLMo 3's layer")
    rope = hf.get("rope_parameters") or {}
    if "full_attention" in rope:  # one RoPE per kind of layer (the global one may be scaled)
        global_rope, local_rope = rope["full_attention"] or {}, rope.get("sliding_attention") or {}
    else:
        global_rope = local_rope = {**rope, "rope_theta": rope.get("rope_theta", hf.get("rope_theta", 500000.0))}
    if local_rope.get("rope_type", "default") != "default":
        raise ValueError(f"config.json: sliding-window layers with {local_rope['rope_type']} RoPE scaling are not "
                         f"modelled by maxlite (their RoPE is unscaled)")
    L = hf["num_hidden_layers"]
    windows = hf_llama.windows_of(hf, L)
    out = {**hf_llama.common_overrides({**hf, "rope_parameters": global_rope}, FAMILY.name), "use_bias": False,
           "sliding_window": max(windows), **hf_llama.pattern_keys(FAMILY.name, windows)}
    local_theta = local_rope.get("rope_theta", out["rope_max_timescale"])
    # its own base, as Gemma 3's; or the global base unscaled when the global layers' RoPE is scaled (YaRN)
    if max(windows) and (float(local_theta) != float(out["rope_max_timescale"]) or out["rope_scaling_factor"] > 0):
        out["local_rope_max_timescale"] = int(local_theta) if float(local_theta).is_integer() else local_theta
    return out
