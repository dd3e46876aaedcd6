"""MiniMax-M2 (`model_type: minimax_m2`): MiniMaxM2ForCausalLM both ways, on existing kinds only.

The layer, against Qwen3-MoE's: Llama's pre-RMSNorms and grouped-query attention without biases;
q and k RMS-normed over the whole projection ([N·H] and [K·H] scales, OLMo 3's `qk_norm_heads`, not
per head) before RoPE; RoPE on the first `partial_rotary_factor` of each head's dimensions (split
halves, GLM-4.5's; the published config.json states `rotary_dim`); experts in every layer, no dense
layer and no shared expert, routed as DeepSeek-V3 without groups: sigmoid scores in float32, top k by
score + a choice-only bias (`e_score_correction_bias`, maxlite's routed_bias), the chosen sigmoid
scores renormalised (norm_topk_prob) and not scaled. Tensor names are Llama's for attention and
Mixtral's for the experts, as the checkpoints store them (transformers 5 fuses them in memory):

  block_sparse_moe.gate.weight [E, D]                 ↔ mlp.router [D, E]
  block_sparse_moe.e_score_correction_bias [E]        ↔ mlp.router_bias
  block_sparse_moe.experts.{j}.w1 / w3 / w2 .weight   ↔ mlp.gate / up / down [j]

transformers' layer ignores config.json's `scoring_func`, `use_routing_bias`, `use_qk_norm`,
`qk_norm_type` and `routed_scaling_factor`: a config.json stating other values than the layer above
computes is refused in one line. The published checkpoints carry multi-token-prediction modules
(`num_mtp_modules`), which transformers does not build: tensors past the last decoder layer
(model.layers.{L}+) are left out in one line, and an export writes none.
"""

from __future__ import annotations

import dataclasses

from maxlite.bridge import hf_llama, hf_moe
from maxlite.bridge.hf_convert import TensorMap, config_tail, linear, of_expert, same
from maxlite.families.minimax_m2 import FAMILY

ARCHITECTURE = "MiniMaxM2ForCausalLM"


def check_supported(cfg) -> None:
    if cfg.decoder_block != FAMILY.name:
        raise ValueError(f"decoder_block={cfg.decoder_block} is not minimax_m2")
    if cfg.use_bias or cfg.sliding_window or cfg.layer_types:
        raise ValueError(f"{ARCHITECTURE} has no attention biases and attends to the whole context in every "
                         f"layer: set use_bias=false, sliding_window=0")
    if (cfg.routed_score_func != "sigmoid" or not cfg.routed_bias or not cfg.norm_topk_prob
            or cfg.routed_scaling_factor != 1 or cfg.shared_experts or cfg.n_routing_groups > 0
            or cfg.first_num_dense_layers or cfg.interleave_moe_layer_step != 1):
        raise ValueError(f"{ARCHITECTURE} routes every layer by sigmoid with a choice bias, weights renormalised "
                         f"and unscaled, no groups, no shared expert: set routed_score_func=sigmoid, "
                         f"routed_bias=true, norm_topk_prob=true, routed_scaling_factor=1, shared_experts=0, "
                         f"n_routing_groups=-1, first_num_dense_layers=0, interleave_moe_layer_step=1")
    hf_llama.check_plain_attention(cfg, ARCHITECTURE)


def tensor_maps(cfg) -> list[TensorMap]:
    check_supported(cfg)
    D, E, F = cfg.base_emb_dim, cfg.num_experts, cfg.base_moe_mlp_dim
    p = "model.layers.{i}.block_sparse_moe."
    router = [linear(p + "gate.weight", ("mlp", "router"), (D,), (E,)),
              same(p + "e_score_correction_bias", ("mlp", "router_bias"), (E,))]
    one_expert = [linear(p + "experts.{j}.w1.weight", ("mlp", "gate"), (D,), (F,)),
                  linear(p + "experts.{j}.w3.weight", ("mlp", "up"), (D,), (F,)),
                  linear(p + "experts.{j}.w2.weight", ("mlp", "down"), (F,), (D,))]
    return (hf_moe.dense_first(hf_llama.decoder_maps(cfg)) + [dataclasses.replace(t, mlp="moe") for t in router]
            + [of_expert(t, j) for j in range(E) for t in one_expert])


def import_maps(cfg, names: set[str]) -> list[TensorMap]:
    return tensor_maps(cfg)


def skipped(cfg, names: set[str]) -> set[str]:
    """The multi-token-prediction modules past the last decoder layer: left out, said in one line."""
    return hf_llama.layers_past_the_last(cfg, names, "MiniMax-M2's multi-token-prediction modules")


ignore = hf_llama.ignore


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    check_supported(cfg)
    common = hf_llama.common_config(cfg, ARCHITECTURE, "minimax_m2", dtype, bos_id, eos_id)
    return {**common, "hidden_act": "silu", "intermediate_size": cfg.base_moe_mlp_dim,
            "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "router_aux_loss_coef": cfg.load_balance_loss_weight, "output_router_logits": False,
            "router_jitter_noise": 0.0, **config_tail(dtype, bos_id, eos_id)}


# what transformers' layer computes, where the published config.json states it (transformers reads none)
COMPUTED = {"scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True, "qk_norm_type": "per_layer",
            "routed_scaling_factor": 1.0, "router_jitter_noise": 0.0, "attention_bias": False}


def config_overrides(hf: dict) -> dict:
    if hf.get("model_type") != "minimax_m2":
        raise ValueError(f"config.json model_type={hf.get('model_type')!r} is not minimax_m2")
    hf_llama.check_mlp(hf, "silu")
    other = {k: hf[k] for k, v in COMPUTED.items() if hf.get(k, v) not in (v, None)}
    if other:
        raise ValueError(f"config.json: {other} is not the layer transformers' {ARCHITECTURE} computes "
                         f"(that is {COMPUTED})")
    if hf.get("sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or ()):
        raise ValueError(f"config.json: sliding-window layers are not {ARCHITECTURE}'s (it attends to the whole "
                         f"context in every layer)")
    H = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    rotary = {"partial_rotary_factor": hf["rotary_dim"] / H} if hf.get("rotary_dim") else {}  # the published form
    return {**hf_llama.common_overrides({**rotary, **hf}, FAMILY.name), "use_bias": False,
            "num_experts": hf["num_local_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
            "base_moe_mlp_dim": hf["intermediate_size"], "shared_experts": 0, "first_num_dense_layers": 0,
            "interleave_moe_layer_step": 1, "norm_topk_prob": True, "routed_score_func": "sigmoid",
            "routed_bias": True, "routed_scaling_factor": 1.0, "n_routing_groups": -1, "topk_routing_group": -1,
            "load_balance_loss_weight": float(hf.get("router_aux_loss_coef", 0.0))}
