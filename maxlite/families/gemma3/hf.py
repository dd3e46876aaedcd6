"""maxlite gemma3 params ↔ Hugging Face `Gemma3ForCausalLM` (`model_type: gemma3_text`).

Tensor names are Llama's with Gemma's norms (hf_llama.decoder_maps, by trait). config.json
carries the layer pattern (`layer_types`: 5 `sliding_attention` to 1 `full_attention`), the window,
one RoPE per kind of layer (`rope_parameters.full_attention` / `.sliding_attention`; 4.x:
`rope_theta`, `rope_local_base_freq`, `rope_scaling`) and `query_pre_attn_scalar`.

Import also reads the multimodal checkpoints (`model_type: gemma3`, Gemma 3 4B/12B/27B on the
hub): the text model from `text_config` (whose absent keys take Gemma3TextConfig's defaults,
below) and its tensors under `language_model.model.` (transformers 4.x) or `model.language_model.`
(5.x); the vision tower and projector are left behind.
"""

from __future__ import annotations

from maxlite.bridge import hf_llama
from maxlite.bridge.hf_convert import TensorMap, config_tail

ACTIVATION = "gelu_pytorch_tanh"  # GeGLU: GELU's tanh approximation on the gate
# Gemma3TextConfig's defaults (transformers 5.x; checked by tests/test_bridge_hf_families.py):
# a multimodal config.json's text_config states only what differs from them
TEXT_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                 "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                 "hidden_activation": ACTIVATION, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
                 "tie_word_embeddings": True, "attention_bias": False, "query_pre_attn_scalar": 256,
                 "sliding_window": 4096, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                 "final_logit_softcapping": None, "attn_logit_softcapping": None}
PREFIXES = ("model.", "model.language_model.", "language_model.model.")  # the text decoder's, by writer
SKIPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
           "language_model.lm_head.")


def check_supported(cfg) -> None:
    if cfg.decoder_block != "gemma3":
        raise ValueError(f"decoder_block={cfg.decoder_block} is not gemma3")


def tensor_maps(cfg) -> list[TensorMap]:
    check_supported(cfg)
    return hf_llama.decoder_maps(cfg)


def import_maps(cfg, names: set[str]) -> list[TensorMap]:
    """The tensor table under whichever prefix the checkpoint's writer used."""
    prefix = next((p for p in PREFIXES if f"{p}embed_tokens.weight" in names), "model.")
    return hf_llama.decoder_maps(cfg, prefix)


def ignore(name: str) -> bool:
    return hf_llama.ignore(name) or name.startswith(SKIPPED)


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    check_supported(cfg)
    from maxlite.models.layout import layer_windows

    out = hf_llama.common_config(cfg, "Gemma3ForCausalLM", "gemma3_text", dtype, bos_id, eos_id)
    global_rope, local_rope = hf_llama.rope_dict(cfg), hf_llama.rope_dict(cfg, local=True)
    out.update({
        "hidden_activation": ACTIVATION,
        "query_pre_attn_scalar": _number(cfg.query_pre_attn_scalar or cfg.head_dim),  # 5.x: an int
        "sliding_window": cfg.sliding_window or None,
        "layer_types": ["sliding_attention" if w else "full_attention" for w in layer_windows(cfg)],
        "rope_parameters": {"full_attention": global_rope, "sliding_attention": local_rope},
        "rope_local_base_freq": local_rope["rope_theta"],
        "attention_bias": bool(cfg.use_bias),
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
        **config_tail(dtype, bos_id, eos_id),
    })
    return out


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def text_config(hf: dict) -> dict:
    """The text model's config.json keys, defaults filled (a multimodal config nests them)."""
    if hf.get("model_type") == "gemma3":
        text = hf.get("text_config") or {}
        return {**TEXT_DEFAULTS, "model_type": "gemma3_text", **text,
                **{k: hf[k] for k in ("dtype", "torch_dtype") if k in hf and k not in text}}
    return {**TEXT_DEFAULTS, **hf}


def config_overrides(hf: dict) -> dict:
    hf = text_config(hf)
    hf_llama.check_mlp(hf, ACTIVATION)
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key):
            raise ValueError(f"config.json: {key}={hf[key]} (Gemma 2's softcapping) is not modelled by maxlite")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("config.json: use_bidirectional_attention (an encoder) is not modelled by maxlite")
    rope = hf.get("rope_parameters") or {}
    if "full_attention" in rope:  # 5.x: one dict per kind of layer
        global_rope, local_rope = rope["full_attention"], rope.get("sliding_attention") or {}
    else:  # 4.x: rope_theta + rope_scaling for global layers, rope_local_base_freq for local ones
        global_rope = {**(hf.get("rope_scaling") or {}), "rope_theta": hf["rope_theta"]}
        local_rope = {"rope_type": "default", "rope_theta": hf["rope_local_base_freq"]}
    if local_rope.get("rope_type", "default") != "default":
        raise ValueError(f"config.json: sliding-window layers with {local_rope['rope_type']} RoPE scaling are not "
                         f"modelled by maxlite (their RoPE is unscaled)")
    L = hf["num_hidden_layers"]
    if "layer_types" not in hf and "sliding_window_pattern" in hf:  # 4.x
        period = hf["sliding_window_pattern"]
        hf = {**hf, "layer_types": ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(L)]}
    windows = hf_llama.windows_of(hf, L)
    local_theta = local_rope.get("rope_theta", hf["rope_local_base_freq"])
    out = {**hf_llama.common_overrides({**hf, "rope_parameters": global_rope}, "gemma3"),
           "use_bias": bool(hf.get("attention_bias", False)), "sliding_window": max(windows),
           "local_rope_max_timescale": int(local_theta) if float(local_theta).is_integer() else local_theta,
           "query_pre_attn_scalar": float(hf["query_pre_attn_scalar"]), **hf_llama.pattern_keys("gemma3", windows)}
    if not out["sliding_window"]:
        out["local_rope_max_timescale"] = 0
    return out

