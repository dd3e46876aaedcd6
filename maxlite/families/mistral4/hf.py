"""Mistral 4 (`model_type: mistral4`): Mistral4ForCausalLM both ways.

transformers builds it from DeepSeek-V3's modules; what differs, and where maxlite has it:
- attention: DeepSeek's MLA (query latent, key/value latent + one shared RoPE key), RoPE on
  interleaved pairs (`rope_interleave`, permuted to maxlite's halves as DeepSeek's,
  maxlite/families/deepseek/hf.py), YaRN with its softmax factor (mscale_all_dim) as DeepSeek-V3's.
  config.json states `partial_rotary_factor` = qk_rope_head_dim / (qk_nope + qk_rope): MLA's RoPE
  width is qk_rope_head_dim already, so maxlite's partial_rotary_factor stays 1. transformers' unscaled
  RoPE for Mistral 4 spans the whole head (and fails): unscaled RoPE exports as YaRN with factor 1.
- Llama 4's query scale 1 + β·log(1 + ⌊t / original_max_position_embeddings⌋) (`llama_4_scaling_beta`):
  1 before the original context; maxlite has no position-dependent query scale, so a β ≠ 0 imports
  only when the model's context (max_position_embeddings) ends there (decoding stops at it).
- routing: softmax scores, no choice bias (V3's is sigmoid + e_score_correction_bias), top-k weights
  renormalised (norm_topk_prob) × routed_scaling_factor: routed_score_func=softmax, routed_bias=false.
  Groups (n_group > 1, topk_group < n_group) are scored by their best two softmax scores, which
  maxlite's groups do only with sigmoid: refused (the published model has one group).
- experts stored fused as transformers keeps them (no per-expert names on save):
  mlp.experts.gate_up_proj [E, 2F, D] ↔ mlp.gate, mlp.up [E, D, F]; mlp.experts.down_proj [E, D, F] ↔ mlp.down.
- the first `first_k_dense_replace` layers dense (Llama's mlp.*_proj), shared experts always there,
  no multi-token-prediction layers, no attention biases.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from maxlite.bridge import hf_llama, hf_moe
from maxlite.bridge.hf_convert import TensorMap
from maxlite.families.deepseek.hf import skeleton_maps
from maxlite.families.mistral4 import FAMILY


def check_supported(cfg) -> None:
    if cfg.decoder_block != FAMILY.name:
        raise ValueError(f"decoder_block={cfg.decoder_block} is not mistral4")
    if cfg.attention_type != "mla":
        raise ValueError("Mistral 4 attends with multi-head latent attention: set attention_type=mla")
    if cfg.use_bias or cfg.sliding_window or cfg.layer_types or cfg.local_rope_max_timescale:
        raise ValueError("Mistral4ForCausalLM has no attention biases, sliding windows or per-layer RoPE: set "
                         "use_bias=false, sliding_window=0, layer_types=[]")
    if cfg.mtp_num_layers:
        raise ValueError("Mistral4ForCausalLM has no multi-token-prediction layers: set mtp_num_layers=0")
    if not cfg.num_experts or cfg.interleave_moe_layer_step != 1 or not cfg.shared_experts:
        raise ValueError("Mistral 4 has MoE in every layer after the first dense ones, with shared experts: set "
                         "num_experts > 0, interleave_moe_layer_step=1 and shared_experts > 0")
    if cfg.rope_scaling_factor > 0 and cfg.rope_scaling_type != "yarn":
        raise ValueError(f"rope_scaling_type={cfg.rope_scaling_type}: Mistral4ForCausalLM computes RoPE over "
                         f"qk_rope_head_dim with YaRN only (or unscaled): set rope_scaling_type=yarn")
    if cfg.routed_score_func != "softmax" or cfg.routed_bias or cfg.n_routing_groups > 0:
        raise ValueError("Mistral 4 routes by softmax, without a choice bias or expert groups: set "
                         "routed_score_func=softmax, routed_bias=false, n_routing_groups=-1")


def _fused_experts(cfg, m: str) -> list[TensorMap]:
    """The routed experts as transformers stores Mistral 4's: [E, 2F, D] (gate rows, then up) and [E, D, F]."""
    D, E, F = cfg.base_emb_dim, cfg.num_experts, cfg.base_moe_mlp_dim
    return [TensorMap(m + "experts.gate_up_proj", (("mlp", "gate"), ("mlp", "up")), (E, 2 * F, D),
                      ((E, D, F), (E, D, F)),
                      lambda g, u: np.concatenate([g.transpose(0, 2, 1), u.transpose(0, 2, 1)], axis=1),
                      lambda t: (t[:, :F].transpose(0, 2, 1), t[:, F:].transpose(0, 2, 1)), mlp="moe"),
            TensorMap(m + "experts.down_proj", (("mlp", "down"),), (E, D, F), ((E, F, D),),
                      lambda d: d.transpose(0, 2, 1), lambda t: (t.transpose(0, 2, 1),), mlp="moe")]


def tensor_maps(cfg) -> list[TensorMap]:
    check_supported(cfg)
    m = "model.layers.{i}.mlp."
    maps, dense = skeleton_maps(cfg, interleaved=True)
    routed_and_shared = [t for t in hf_moe.deepseek_moe_maps(cfg, m) if t.expert is None]  # router, shared experts
    return (maps + [dataclasses.replace(t, mlp="dense") for t in dense] + routed_and_shared
            + _fused_experts(cfg, m))


ignore = hf_llama.ignore


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    check_supported(cfg)
    common = hf_llama.common_config(cfg, "Mistral4ForCausalLM", "mistral4", dtype, bos_id, eos_id)
    for gqa_only in ("head_dim", "rope_scaling"):
        common.pop(gqa_only)
    rope = common["rope_parameters"]
    if rope["rope_type"] == "default":  # transformers' unscaled RoPE spans the whole head (P + R), not R:
        # YaRN with factor 1 is unscaled RoPE, computed over the RoPE dims
        rope = {**rope, "rope_type": "yarn", "type": "yarn", "factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
    # transformers reads both on every forward; β = 0: no Llama 4 query scale (maxlite has none)
    rope = {"original_max_position_embeddings": hf_llama.max_positions(cfg), **rope, "llama_4_scaling_beta": 0.0}
    return {**common, **hf_moe.deepseek_moe_config(cfg), "rope_parameters": rope, "rope_interleave": True,
            "hidden_act": "silu", "attention_bias": False,
            "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim}


def _refuse_unmodelled(hf: dict) -> None:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    original = rope.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 0)
    if rope.get("llama_4_scaling_beta") and hf.get("max_position_embeddings", 0) > original:
        raise ValueError(f"config.json: llama_4_scaling_beta={rope['llama_4_scaling_beta']} scales queries past "
                         f"position {original} (Llama 4's attention scale), which maxlite does not model")
    if hf.get("rope_interleave") is False:
        raise ValueError("config.json: rope_interleave=false (RoPE on split halves) is not modelled by maxlite's "
                         "Mistral 4 import, which converts the interleaved layout")
    if hf.get("attention_bias"):
        raise ValueError("config.json: attention_bias=true is not modelled by maxlite (maxlite has no MLA biases)")
    groups, top = hf.get("n_group") or 1, hf.get("topk_group") or 1
    if 1 < groups and top < groups:
        raise ValueError(f"config.json: n_group={groups}, topk_group={top}: groups scored by their best two "
                         f"softmax scores are not modelled by maxlite (its softmax groups score by the best one)")


def config_overrides(hf: dict) -> dict:
    if hf.get("model_type") != "mistral4":
        raise ValueError(f"config.json model_type={hf.get('model_type')!r} is not mistral4")
    hf_llama.check_mlp(hf, "silu")
    _refuse_unmodelled(hf)
    N = hf["num_attention_heads"]
    return {**hf_llama.common_overrides(hf, FAMILY.name), **hf_moe.deepseek_moe_overrides(hf),
            "attention_type": "mla", "use_bias": False, "partial_rotary_factor": 1.0,
            "base_num_kv_heads": N, "head_dim": hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
            "q_lora_rank": hf.get("q_lora_rank") or 0, "kv_lora_rank": hf["kv_lora_rank"],
            "qk_nope_head_dim": hf["qk_nope_head_dim"], "qk_rope_head_dim": hf["qk_rope_head_dim"],
            "v_head_dim": hf["v_head_dim"], "routed_score_func": "softmax", "routed_bias": False,
            "n_routing_groups": -1, "topk_routing_group": -1}
