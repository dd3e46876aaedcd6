"""maxlite llama2-block params ↔ Hugging Face `LlamaForCausalLM` / `MistralForCausalLM` (config.json +
safetensors), over the shared Llama-style table (maxlite/bridge/hf_llama.py, its conventions).

A sliding window (all layers local) exports as Mistral, which Llama cannot express.
"""

from __future__ import annotations

from maxlite.bridge.hf_convert import TensorMap
from maxlite.bridge.hf_llama import check_mlp, check_plain_attention, common_config, common_overrides, decoder_maps
from maxlite.bridge.hf_llama import ignore  # noqa: F401 (the adapter's interface)


def check_supported(cfg) -> None:
    if cfg.decoder_block != "llama2":
        raise ValueError(
            f"decoder_block={cfg.decoder_block}: only llama2-block models (Llama 2/3/3.1/3.2, Mistral) "
            f"have a Hugging Face Llama equivalent; GPT-3 style models (LayerNorm, GELU, learned "
            f"positions) export as GPT-2 instead")
    if cfg.sliding_window and cfg.use_bias:
        raise ValueError("sliding_window with use_bias=true: Mistral (the HF model with a sliding window) has "
                         "no attention biases")
    check_plain_attention(cfg, "Llama/Mistral")


def tensor_maps(cfg) -> list[TensorMap]:
    check_supported(cfg)
    return decoder_maps(cfg)


def import_maps(cfg, names: set[str]) -> list[TensorMap]:
    return tensor_maps(cfg)


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    check_supported(cfg)
    if cfg.sliding_window:
        return {**common_config(cfg, "MistralForCausalLM", "mistral", dtype, bos_id, eos_id),
                "hidden_act": "silu", "sliding_window": cfg.sliding_window}
    return {**common_config(cfg, "LlamaForCausalLM", "llama", dtype, bos_id, eos_id),
            "hidden_act": "silu", "attention_bias": bool(cfg.use_bias), "mlp_bias": False, "pretraining_tp": 1}


def config_overrides(hf: dict) -> dict:
    """HF config.json → maxlite model keys (for `maxlite.config.load(**overrides)`)."""
    model_type = hf.get("model_type")
    if model_type not in ("llama", "mistral"):
        raise ValueError(f"config.json model_type={model_type!r}: only llama and mistral convert to "
                         f"maxlite's llama2 block")
    check_mlp(hf, "silu")
    out = {**common_overrides(hf, "llama2"), "use_bias": bool(hf.get("attention_bias", False))}
    if model_type == "mistral":
        out["sliding_window"] = hf.get("sliding_window") or 0
    return out
