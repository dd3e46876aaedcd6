"""Qwen3-Next (`model_type: qwen3_next`, Qwen3NextForCausalLM): Qwen3.5's hybrid layers
(maxlite/families/qwen3_5/) with a mixture of experts, both ways; the MoE tensor and config.json
maps Qwen3.5-MoE shares.

Differences from Qwen3.5's tensors: the delta-net's q, k, v, z projections are one in_proj_qkvz and
b, a one in_proj_ba, grouped by key head. The MoE layer (`decoder_sparse_step`, `mlp_only_layers` as
Qwen3-MoE's) is a softmax top-k router over `num_experts` SwiGLU experts plus one shared expert whose
output is scaled by sigmoid(x · w) (`shared_expert_gate`):

  mlp.gate.weight [E, D]  ↔ mlp.router [D, E]
  mlp.experts.{j}.gate_proj / up_proj / down_proj .weight  ↔ mlp.gate / up / down [j]
  mlp.shared_expert.gate_proj / up_proj / down_proj .weight  ↔ mlp.shared.gate / up / down
  mlp.shared_expert_gate.weight [1, D]  ↔ mlp.shared_gate [D]
"""

from __future__ import annotations

import dataclasses

from maxlite.bridge import hf_moe
from maxlite.bridge.hf_convert import TensorMap, linear, of_expert, same
from maxlite.families.qwen3_5 import hf as qwen3_5
from maxlite.families.qwen3_next import FAMILY


def check_moe(cfg, name: str) -> None:
    qwen3_5.check_supported(cfg, name)
    if cfg.shared_experts != 1 or not cfg.shared_expert_gate:
        raise ValueError(f"{name} has one shared expert with a sigmoid gate: set shared_experts=1, "
                         f"shared_expert_gate=true")
    if cfg.routed_bias or cfg.routed_score_func != "softmax" or not cfg.norm_topk_prob:
        raise ValueError(f"{name} routes by softmax with renormalised top-k weights: set routed_bias=false, "
                         f"routed_score_func=softmax, norm_topk_prob=true")


def moe_maps(cfg, prefix: str = "model.") -> list[TensorMap]:
    """The MoE layers' tensors (router, experts, the gated shared expert) and the dense layers' MLP."""
    D, E, F = cfg.base_emb_dim, cfg.num_experts, cfg.base_moe_mlp_dim
    m = prefix + "layers.{i}.mlp."
    dense = [dataclasses.replace(t, mlp="dense") for t in qwen3_5.mlp_maps(cfg, prefix)]
    shared = [linear(m + "shared_expert.gate_proj.weight", ("mlp", "shared", "gate"), (D,), (F,)),
              linear(m + "shared_expert.up_proj.weight", ("mlp", "shared", "up"), (D,), (F,)),
              linear(m + "shared_expert.down_proj.weight", ("mlp", "shared", "down"), (F,), (D,)),
              same(m + "shared_expert_gate.weight", ("mlp", "shared_gate"), (D,), (1, D)),
              linear(m + "gate.weight", ("mlp", "router"), (D,), (E,))]
    one_expert = [linear(m + "experts.{j}.gate_proj.weight", ("mlp", "gate"), (D,), (F,)),
                  linear(m + "experts.{j}.up_proj.weight", ("mlp", "up"), (D,), (F,)),
                  linear(m + "experts.{j}.down_proj.weight", ("mlp", "down"), (F,), (D,))]
    return (dense + [dataclasses.replace(t, mlp="moe") for t in shared]
            + [of_expert(t, j) for j in range(E) for t in one_expert])


def tensor_maps(cfg) -> list[TensorMap]:
    check_moe(cfg, "Qwen3-Next")
    return qwen3_5.hybrid_maps(cfg, fused=True) + moe_maps(cfg)


ignore = qwen3_5.ignore


def moe_config(cfg) -> dict:
    return {"moe_intermediate_size": cfg.base_moe_mlp_dim, "shared_expert_intermediate_size": cfg.base_moe_mlp_dim,
            "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "norm_topk_prob": True, "router_aux_loss_coef": cfg.load_balance_loss_weight,
            "output_router_logits": False}


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    check_moe(cfg, "Qwen3-Next")
    return {**qwen3_5.hybrid_config(cfg, "Qwen3NextForCausalLM", "qwen3_next", dtype, bos_id, eos_id),
            **moe_config(cfg), "decoder_sparse_step": cfg.interleave_moe_layer_step,
            "mlp_only_layers": list(range(cfg.first_num_dense_layers))}


def moe_overrides(hf: dict) -> dict:
    """config.json → maxlite's MoE keys (a shared expert as wide as the routed ones)."""
    if hf.get("shared_expert_intermediate_size", hf["moe_intermediate_size"]) != hf["moe_intermediate_size"]:
        raise ValueError(f"config.json: shared_expert_intermediate_size={hf['shared_expert_intermediate_size']} "
                         f"≠ moe_intermediate_size={hf['moe_intermediate_size']}: maxlite's shared expert is "
                         f"shared_experts × base_moe_mlp_dim wide")
    return {"num_experts": hf["num_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
            "base_moe_mlp_dim": hf["moe_intermediate_size"], "shared_experts": 1, "shared_expert_gate": True,
            "norm_topk_prob": bool(hf.get("norm_topk_prob", True)), "routed_score_func": "softmax",
            "routed_bias": False, "load_balance_loss_weight": float(hf.get("router_aux_loss_coef", 0.0))}


def config_overrides(hf: dict) -> dict:
    if hf.get("model_type") != "qwen3_next":
        raise ValueError(f"config.json model_type={hf.get('model_type')!r} is not qwen3_next")
    first, step = hf_moe.dense_layout(hf, hf["num_hidden_layers"])
    return {**qwen3_5.hybrid_overrides(hf, FAMILY.name), **moe_overrides(hf),
            "first_num_dense_layers": first, "interleave_moe_layer_step": step}
