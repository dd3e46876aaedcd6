"""maxlite qwen3_vl_moe params ↔ Hugging Face `Qwen3VLMoeForConditionalGeneration`, config.json both ways.

Qwen3-VL's adapter (maxlite/families/qwen3_vl/hf.py: the decoder under `model.language_model.`, the
tower under `model.visual.`, the processor's files) with Qwen3-MoE's layers. The experts of a layer are
two fused tensors, as the published checkpoints store them:

  mlp.gate.weight [E, D]                ↔ mlp.router [D, E]
  mlp.experts.gate_up_proj [E, D, 2F]   ↔ mlp.gate, mlp.up [E, D, F] (gate the first half)
  mlp.experts.down_proj [E, F, D]       ↔ mlp.down [E, F, D]

transformers 5 transposes both on load and writes them transposed ([E, 2F, D], [E, D, F]); the import
takes either layout (a shape that reads both ways, 2F = D, is taken as the published one), the export
writes the published one, which transformers loads. Routing as Qwen3-MoE's: softmax, top k, weights
always renormalised; router_aux_loss_coef is load_balance_loss_weight. Experts in every layer
(`mlp_only_layers` empty, `decoder_sparse_step` 1); other layouts are refused in one line.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from maxlite.bridge import hf_llama
from maxlite.bridge.hf_convert import TensorMap, linear
from maxlite.bridge.vision_maps import qwen_vit_maps
from maxlite.families.qwen3_vl import hf as vl
from maxlite.families.qwen3_vl.hf import (  # noqa: F401 (this family's adapter interface)
    PREFIX, VISION_PREFIX, ignore, processor_overrides, vision_overrides, write_processor)
from maxlite.families.qwen3_vl_moe import FAMILY

ARCHITECTURE = "Qwen3VLMoeForConditionalGeneration"
VISION_TYPE = "qwen3_vl_moe_vision"


def check_supported(cfg) -> None:
    if cfg.decoder_block != FAMILY.name:
        raise ValueError(f"decoder_block={cfg.decoder_block} is not qwen3_vl_moe")
    vl.check_supported(cfg)
    if (cfg.shared_experts or cfg.routed_bias or cfg.routed_score_func != "softmax" or cfg.n_routing_groups > 0
            or cfg.routed_scaling_factor != 1 or not cfg.norm_topk_prob):
        raise ValueError("Qwen3-VL-MoE routes by softmax over the top k, renormalised, without shared experts, "
                         "a choice bias, groups or a scale")
    if cfg.first_num_dense_layers or cfg.interleave_moe_layer_step != 1:
        raise ValueError("Qwen3-VL-MoE has experts in every layer: set first_num_dense_layers=0, "
                         "interleave_moe_layer_step=1")


def _either(published: tuple, transposed: tuple, to_published):
    """from_hf's reading of a tensor in either layout (the published one wins where both read)."""
    return lambda x: to_published(x) if tuple(x.shape) == transposed and transposed != published else x


def expert_maps(cfg) -> list[TensorMap]:
    D, E, F = cfg.base_emb_dim, cfg.num_experts, cfg.base_moe_mlp_dim
    x = PREFIX + "layers.{i}.mlp."
    gate_up = _either((E, D, 2 * F), (E, 2 * F, D), lambda t: np.swapaxes(t, 1, 2))
    down = _either((E, F, D), (E, D, F), lambda t: np.swapaxes(t, 1, 2))
    return [dataclasses.replace(linear(x + "gate.weight", ("mlp", "router"), (D,), (E,)), mlp="moe"),
            TensorMap(x + "experts.gate_up_proj", (("mlp", "gate"), ("mlp", "up")), (E, D, 2 * F),
                      ((E, D, F), (E, D, F)), lambda g, u: np.concatenate([g, u], axis=-1),
                      lambda t: (lambda w: (w[..., :F], w[..., F:]))(gate_up(t)), mlp="moe",
                      alt_hf_shape=(E, 2 * F, D)),
            TensorMap(x + "experts.down_proj", (("mlp", "down"),), (E, F, D), ((E, F, D),), lambda w: w,
                      lambda t: (down(t),), mlp="moe", alt_hf_shape=(E, D, F))]


def tensor_maps(cfg) -> list[TensorMap]:
    check_supported(cfg)
    decoder = [t for t in hf_llama.decoder_maps(cfg, PREFIX) if not (t.layer and t.paths[0][0] == "mlp")]
    return decoder + expert_maps(cfg) + qwen_vit_maps(cfg, VISION_PREFIX)


def import_maps(cfg, names: set[str]) -> list[TensorMap]:
    return tensor_maps(cfg)


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    check_supported(cfg)
    out = vl.hf_config(cfg, dtype, bos_id, eos_id)
    text = {**out["text_config"], "model_type": "qwen3_vl_moe_text", "moe_intermediate_size": cfg.base_moe_mlp_dim,
            "num_experts": cfg.num_experts, "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": cfg.load_balance_loss_weight}
    return {**out, "architectures": [ARCHITECTURE], "model_type": FAMILY.hf_model_types[0], "text_config": text,
            "vision_config": {**out["vision_config"], "model_type": VISION_TYPE}}


def config_overrides(hf: dict) -> dict:
    if hf.get("model_type") not in FAMILY.hf_model_types:
        raise ValueError(f"config.json model_type={hf.get('model_type')!r} is not qwen3_vl_moe")
    text = hf["text_config"]
    if text.get("mlp_only_layers") or (text.get("decoder_sparse_step") or 1) != 1:
        raise ValueError(f"config.json: mlp_only_layers={text.get('mlp_only_layers')}, decoder_sparse_step="
                         f"{text.get('decoder_sparse_step')}: maxlite's Qwen3-VL-MoE has experts in every layer")
    vision = hf["vision_config"]
    if vision.get("model_type", VISION_TYPE) != VISION_TYPE:
        raise ValueError(f"config.json: vision_config model_type {vision.get('model_type')!r} is not {VISION_TYPE}")
    # the same tower as Qwen3-VL's (DeepStack included), under its own model type
    out = vl.config_overrides({**hf, "model_type": "qwen3_vl", "vision_config": {**vision, "model_type": "qwen3_vl_vision"}})
    experts = text["num_experts"] if "num_experts" in text else text["num_local_experts"]  # transformers 5 writes the latter
    return {**out, "decoder_block": FAMILY.name, "num_experts": experts,
            "num_experts_per_tok": text["num_experts_per_tok"], "base_moe_mlp_dim": text["moe_intermediate_size"],
            "norm_topk_prob": True, "routed_score_func": "softmax", "shared_experts": 0, "routed_bias": False,
            "load_balance_loss_weight": float(text.get("router_aux_loss_coef", 0.0)),
            "first_num_dense_layers": 0, "interleave_moe_layer_step": 1}
