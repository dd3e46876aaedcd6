"""The mixture-of-experts tensor tables and config.json keys family adapters share: a Llama decoder's
dense layers (`dense_first`), Qwen3-MoE-style dense layouts (`dense_layout`), and DeepSeekMoE.

DeepSeekMoE (DeepSeek-V3, GLM-4.5: `deepseek_moe_maps`, `deepseek_moe_config`, `deepseek_moe_overrides`,
what their family modules share): dense layers keep Llama's MLP names; a MoE layer stores

  mlp.gate.weight [E, D], mlp.gate.e_score_correction_bias [E]  ↔ mlp.router [D, E], mlp.router_bias
  mlp.experts.{j}.gate_proj / up_proj / down_proj .weight      ↔ mlp.gate / up / down [j]
  mlp.shared_experts.gate_proj / up_proj / down_proj .weight   ↔ mlp.shared.gate / up / down
"""

from __future__ import annotations

import dataclasses

from maxlite.bridge.hf_convert import TensorMap, linear, of_expert, same


def dense_first(maps: list[TensorMap]) -> list[TensorMap]:
    """A Llama decoder's MLP tensors as those of the dense layers only."""
    return [t if t.paths[0][0] != "mlp" else dataclasses.replace(t, mlp="dense") for t in maps]


def deepseek_moe_maps(cfg, prefix: str = "model.layers.{i}.mlp.") -> list[TensorMap]:
    """The MoE layers' MLP tensors of DeepSeekMoE (the dense layers' are Llama's, decoder_maps')."""
    D, E, F = cfg.base_emb_dim, cfg.num_experts, cfg.base_moe_mlp_dim
    Fs = cfg.shared_experts * F
    moe = [linear(prefix + "gate.weight", ("mlp", "router"), (D,), (E,))]
    if cfg.routed_bias:
        moe.append(same(prefix + "gate.e_score_correction_bias", ("mlp", "router_bias"), (E,)))
    if cfg.shared_experts:
        s = prefix + "shared_experts."
        moe += [linear(s + "gate_proj.weight", ("mlp", "shared", "gate"), (D,), (Fs,)),
                linear(s + "up_proj.weight", ("mlp", "shared", "up"), (D,), (Fs,)),
                linear(s + "down_proj.weight", ("mlp", "shared", "down"), (Fs,), (D,))]
    one_expert = [linear(prefix + "experts.{j}.gate_proj.weight", ("mlp", "gate"), (D,), (F,)),
                  linear(prefix + "experts.{j}.up_proj.weight", ("mlp", "up"), (D,), (F,)),
                  linear(prefix + "experts.{j}.down_proj.weight", ("mlp", "down"), (F,), (D,))]
    return [dataclasses.replace(t, mlp="moe") for t in moe] + [of_expert(t, j) for j in range(E) for t in one_expert]


def deepseek_moe_config(cfg) -> dict:
    """DeepSeekMoE's config.json keys (DeepseekV3Config, Glm4MoeConfig): no groups is one group."""
    grouped = cfg.n_routing_groups > 0
    return {"n_routed_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.base_moe_mlp_dim, "n_shared_experts": cfg.shared_experts,
            "first_k_dense_replace": cfg.first_num_dense_layers, "norm_topk_prob": bool(cfg.norm_topk_prob),
            "routed_scaling_factor": cfg.routed_scaling_factor, "n_group": cfg.n_routing_groups if grouped else 1,
            "topk_group": cfg.topk_routing_group if grouped else 1}


def deepseek_moe_overrides(hf: dict) -> dict:
    """DeepSeekMoE's config.json keys → maxlite's (sigmoid routing with the choice bias). Groups that
    are all kept (topk_group = n_group) route as no groups. The published models train the bias
    without a gradient and no auxiliary loss transformers computes: both 0 here (a fine-tune sets
    routed_bias_update_rate to keep balancing)."""
    groups, top = hf.get("n_group") or 1, hf.get("topk_group") or 1
    grouped = 1 < groups and top < groups
    return {"num_experts": hf["n_routed_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
            "base_moe_mlp_dim": hf["moe_intermediate_size"], "shared_experts": hf.get("n_shared_experts") or 0,
            "first_num_dense_layers": hf.get("first_k_dense_replace", 0), "interleave_moe_layer_step": 1,
            "norm_topk_prob": bool(hf.get("norm_topk_prob", True)), "routed_score_func": "sigmoid",
            "routed_bias": True, "routed_scaling_factor": float(hf.get("routed_scaling_factor") or 1.0),
            "n_routing_groups": groups if grouped else -1, "topk_routing_group": top if grouped else -1,
            "load_balance_loss_weight": 0.0}


def dense_layout(hf: dict, L: int) -> tuple[int, int]:
    """Qwen3-MoE's dense layers (mlp_only_layers, decoder_sparse_step) → (first_num_dense_layers,
    interleave_moe_layer_step); a layout maxlite cannot express is refused."""
    only = sorted(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step", 1) or 1
    if only and (only != list(range(len(only))) or step != 1):
        raise ValueError(f"config.json: mlp_only_layers={only} with decoder_sparse_step={step}: maxlite's dense "
                         f"layers come first (first_num_dense_layers) or every n-th layer, not both")
    if L % step or len(only) >= L:
        raise ValueError(f"config.json: decoder_sparse_step={step} over {L} layers has no maxlite equivalent")
    return len(only), step
