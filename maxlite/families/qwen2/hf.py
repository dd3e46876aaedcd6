"""maxlite qwen2 / qwen3 params ↔ Hugging Face `Qwen2ForCausalLM` / `Qwen3ForCausalLM` (qwen3/hf.py is this
module's, and Mixtral's adapter reads `window_config`).

Both use Llama's tensor names (hf_llama.decoder_maps reads the traits): Qwen2 adds q/k/v biases
(always present: a qwen2 model has use_bias=true), Qwen3 adds `self_attn.q_norm`/`k_norm` and may
have q/k/v/o biases (`attention_bias`). A sliding window exports as `use_sliding_window` from layer
0 (`max_window_layers: 0`); a config.json whose windows start at a later layer is refused.
"""

from __future__ import annotations

from maxlite.bridge import hf_llama
from maxlite.bridge.hf_convert import TensorMap

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}  # by decoder_block


def check_supported(cfg) -> None:
    if cfg.decoder_block not in ARCHITECTURES:
        raise ValueError(f"decoder_block={cfg.decoder_block} is not a Qwen family")
    if cfg.decoder_block == "qwen2" and not cfg.use_bias:
        raise ValueError("decoder_block=qwen2 with use_bias=false: Qwen2 always has q/k/v biases "
                         "(use qwen3, or llama2, for a model without)")
    hf_llama.check_plain_attention(cfg, ARCHITECTURES[cfg.decoder_block])


def tensor_maps(cfg) -> list[TensorMap]:
    check_supported(cfg)
    return hf_llama.decoder_maps(cfg)


def import_maps(cfg, names: set[str]) -> list[TensorMap]:
    return tensor_maps(cfg)


ignore = hf_llama.ignore


def window_config(cfg) -> dict:
    """Qwen's sliding-window keys (Qwen2/3 and Qwen3-MoE): every layer windowed, or none."""
    window = cfg.sliding_window
    return {"use_sliding_window": bool(window), "sliding_window": window or None,
            "max_window_layers": 0 if window else cfg.base_num_decoder_layers}


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    check_supported(cfg)
    window = cfg.sliding_window
    out = {**hf_llama.common_config(cfg, ARCHITECTURES[cfg.decoder_block], cfg.decoder_block, dtype, bos_id, eos_id),
           "hidden_act": "silu", **window_config(cfg),
           "layer_types": ["sliding_attention" if window else "full_attention"] * cfg.base_num_decoder_layers}
    if cfg.decoder_block == "qwen3":
        out["attention_bias"] = bool(cfg.use_bias)
    return out


def config_overrides(hf: dict) -> dict:
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"config.json model_type={model_type!r} is not qwen2 or qwen3")
    hf_llama.check_mlp(hf, "silu")
    if hf.get("use_mrope"):
        raise ValueError("config.json: use_mrope (Qwen2-VL's multimodal RoPE) is not modelled by maxlite")
    L = hf["num_hidden_layers"]
    windows = hf_llama.windows_of(hf, L)
    if len(set(windows)) > 1:
        raise ValueError(f"config.json: sliding windows on layers {windows.index(max(windows))}..{L - 1} only "
                         f"(max_window_layers={hf.get('max_window_layers')}): maxlite windows every layer or none")
    use_bias = True if model_type == "qwen2" else bool(hf.get("attention_bias", False))
    return {**hf_llama.common_overrides(hf, model_type), "use_bias": use_bias, "sliding_window": windows[0]}
