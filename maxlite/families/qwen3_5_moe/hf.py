"""Qwen3.5-MoE (`model_type: qwen3_5_moe_text`, Qwen3_5MoeForCausalLM): Qwen3.5's hybrid layers
(maxlite/families/qwen3_5/: separate delta-net projections) with a mixture of experts in every
layer and Qwen3-Next's gated shared expert (maxlite/families/qwen3_next/: the MoE tensors). A
multimodal checkpoint (Qwen3_5MoeForConditionalGeneration) imports and exports with its vision tower
as Qwen3.5's does.
"""

from __future__ import annotations

from maxlite.bridge.hf_convert import TensorMap
from maxlite.families.qwen3_5 import hf as qwen3_5
from maxlite.families.qwen3_5_moe import FAMILY
from maxlite.families.qwen3_next import hf as qwen3_next


def check_supported(cfg) -> None:
    qwen3_next.check_moe(cfg, "Qwen3.5-MoE")
    if cfg.first_num_dense_layers or cfg.interleave_moe_layer_step != 1:
        raise ValueError("Qwen3.5-MoE has experts in every layer: set first_num_dense_layers=0, "
                         "interleave_moe_layer_step=1")


def tensor_maps(cfg, prefix: str | None = None) -> list[TensorMap]:
    check_supported(cfg)
    prefix = prefix or qwen3_5.default_prefix(cfg)
    return qwen3_5.hybrid_maps(cfg, prefix=prefix) + qwen3_next.moe_maps(cfg, prefix) + qwen3_5.vision_maps(cfg)


def import_maps(cfg, names: set[str]) -> list[TensorMap]:
    return tensor_maps(cfg, qwen3_5.decoder_prefix(names))


ignore = qwen3_5.ignore
processor_overrides, write_processor = qwen3_5.processor_overrides, qwen3_5.write_processor


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    check_supported(cfg)
    out = qwen3_5.hybrid_config(cfg, "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", dtype, bos_id, eos_id)
    del out["intermediate_size"]  # no dense MLP anywhere
    out = {**out, **qwen3_next.moe_config(cfg)}
    return qwen3_5.multimodal_config(cfg, out, "qwen3_5_moe") if cfg.vision_encoder else out


def config_overrides(hf: dict) -> dict:
    text = qwen3_5.text_config(hf)
    if text.get("model_type") != "qwen3_5_moe_text":
        raise ValueError(f"config.json model_type={text.get('model_type')!r} is not qwen3_5_moe_text")
    # no dense layers: base_mlp_dim (unused) takes the experts' width
    text = {"intermediate_size": text["moe_intermediate_size"], **text}
    return {**qwen3_5.hybrid_overrides(text, FAMILY.name), **qwen3_next.moe_overrides(text),
            "first_num_dense_layers": 0, "interleave_moe_layer_step": 1, **qwen3_5.vision_overrides(hf, text)}
