"""GLM-4.5 / GLM-4.6 (Zhipu AI, `model_type: glm4_moe`): Glm4MoeForCausalLM both ways.

The layer: Llama's pre-RMSNorms, grouped-query attention with q/k/v biases (no o bias), RoPE on the
first `partial_rotary_factor` (0.5) of each head's dimensions (split halves, as Llama's), optional
per-head q/k RMSNorms (`use_qk_norm`: GLM-4.5 yes, GLM-4.5-Air no); a SwiGLU MLP in the first
`first_k_dense_replace` layers and DeepSeekMoE after them: sigmoid routing with a choice-only bias
(`e_score_correction_bias`), optional groups, weights normalised and × routed_scaling_factor, plus
one shared expert (maxlite/models/moe.py). Tensor names are Llama's for attention and the dense MLP,
DeepSeek-V3's for the experts (maxlite.bridge.hf_moe.deepseek_moe_maps).

The published checkpoints carry a multi-token-prediction layer after the last decoder layer
(`num_nextn_predict_layers`, stored as layer num_hidden_layers), which transformers does not load
either: the import leaves its tensors out in one line, and an export writes none (0 in config.json).
"""

from __future__ import annotations


from maxlite.bridge import hf_llama, hf_moe
from maxlite.bridge.hf_convert import TensorMap, config_tail
from maxlite.families.glm4_moe import FAMILY


def check_supported(cfg) -> None:
    if cfg.decoder_block != FAMILY.name:
        raise ValueError(f"decoder_block={cfg.decoder_block} is not glm4_moe")
    if cfg.sliding_window or cfg.layer_types:
        raise ValueError("Glm4MoeForCausalLM attends to the whole context in every layer: set sliding_window=0")
    if cfg.interleave_moe_layer_step != 1 or cfg.routed_score_func != "sigmoid" or not cfg.routed_bias:
        raise ValueError("GLM-4.5 routes by sigmoid with a choice bias in every layer after the dense ones: set "
                         "routed_score_func=sigmoid, routed_bias=true, interleave_moe_layer_step=1")
    if cfg.shared_experts < 1:
        raise ValueError("Glm4MoeForCausalLM always has a shared expert: set shared_experts >= 1")
    hf_llama.check_plain_attention(cfg, "Glm4MoeForCausalLM", qk_norm=True)


def tensor_maps(cfg) -> list[TensorMap]:
    check_supported(cfg)
    return hf_moe.dense_first(hf_llama.decoder_maps(cfg)) + hf_moe.deepseek_moe_maps(cfg)


def import_maps(cfg, names: set[str]) -> list[TensorMap]:
    return tensor_maps(cfg)


def skipped(cfg, names: set[str]) -> set[str]:
    """The multi-token-prediction layer(s) past the last decoder layer: left out, said in one line."""
    return hf_llama.layers_past_the_last(cfg, names, "GLM's multi-token-prediction layer")


ignore = hf_llama.ignore


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    check_supported(cfg)
    common = hf_llama.common_config(cfg, "Glm4MoeForCausalLM", "glm4_moe", dtype, bos_id, eos_id)
    return {**common, **hf_moe.deepseek_moe_config(cfg), "hidden_act": "silu", "attention_bias": bool(cfg.use_bias),
            "use_qk_norm": bool(cfg.use_qk_norm), "num_nextn_predict_layers": 0,
            **config_tail(dtype, bos_id, eos_id)}


def config_overrides(hf: dict) -> dict:
    if hf.get("model_type") != "glm4_moe":
        raise ValueError(f"config.json model_type={hf.get('model_type')!r} is not glm4_moe")
    hf_llama.check_mlp(hf, "silu")
    return {**hf_llama.common_overrides(hf, FAMILY.name), "use_bias": bool(hf.get("attention_bias", False)),
            "use_qk_norm": bool(hf.get("use_qk_norm", False)), **hf_moe.deepseek_moe_overrides(hf)}
