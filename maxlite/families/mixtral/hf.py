"""maxlite mixtral / qwen3_moe params ↔ Hugging Face `MixtralForCausalLM` / `Qwen3MoeForCausalLM`.

Attention, norms and embeddings are Llama's tensors (hf_llama.decoder_maps reads the traits: Qwen3's
q/k norms). The MLP of a MoE layer, as the checkpoints store it (transformers 5 fuses the experts
in memory and converts on load and save; the files keep one tensor per expert):

  Mixtral    block_sparse_moe.gate.weight [E, D]  ↔ mlp.router [D, E]
             block_sparse_moe.experts.{j}.w1 / w3 / w2 .weight  ↔ mlp.gate / up / down [j]
  Qwen3-MoE  mlp.gate.weight [E, D]  ↔ mlp.router [D, E]
             mlp.experts.{j}.gate_proj / up_proj / down_proj .weight  ↔ mlp.gate / up / down [j]

Qwen3-MoE's dense layers (`mlp_only_layers`, `decoder_sparse_step`) keep Llama's MLP names; maxlite
expresses the ones whose dense layers come first (first_num_dense_layers) or recur every
interleave_moe_layer_step-th layer from the first; other layouts are refused. Routing is the same
function on both sides: softmax in float32, top k, weights renormalised (Mixtral always, Qwen3-MoE
with norm_topk_prob); router_aux_loss_coef is load_balance_loss_weight.

The DeepSeekMoE tables other families share are maxlite/bridge/hf_moe.py's.
"""

from __future__ import annotations

import dataclasses

from maxlite.bridge import hf_llama, hf_moe
from maxlite.bridge.hf_convert import TensorMap, linear, of_expert
from maxlite.families.qwen2 import hf as qwen2_hf

ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}  # by decoder_block
# the MoE MLP's tensor names in a layer: (router, experts' prefix, gate, up, down)
NAMES = {"mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts.{j}.", "w1", "w3", "w2"),
         "qwen3_moe": ("mlp.gate", "mlp.experts.{j}.", "gate_proj", "up_proj", "down_proj")}


def check_supported(cfg) -> None:
    if cfg.decoder_block not in ARCHITECTURES:
        raise ValueError(f"decoder_block={cfg.decoder_block} is not a Hugging Face mixture of experts "
                         f"({', '.join(ARCHITECTURES)})")
    if (cfg.shared_experts or cfg.routed_bias or cfg.routed_score_func != "softmax" or cfg.n_routing_groups > 0
            or cfg.routed_scaling_factor != 1):
        raise ValueError("shared_experts, routed_bias, routed_score_func=sigmoid, n_routing_groups and "
                         "routed_scaling_factor != 1 have no Mixtral or Qwen3-MoE equivalent")
    if cfg.decoder_block == "mixtral" and (cfg.first_num_dense_layers or cfg.interleave_moe_layer_step != 1
                                           or not cfg.norm_topk_prob):
        raise ValueError("Mixtral has experts in every layer and renormalised top-k weights: set "
                         "first_num_dense_layers=0, interleave_moe_layer_step=1, norm_topk_prob=true")
    if cfg.decoder_block == "qwen3_moe" and cfg.first_num_dense_layers and cfg.interleave_moe_layer_step != 1:
        raise ValueError("Qwen3-MoE counts decoder_sparse_step from layer 0: first_num_dense_layers and "
                         "interleave_moe_layer_step > 1 together have no equivalent")
    hf_llama.check_plain_attention(cfg, ARCHITECTURES[cfg.decoder_block])


def tensor_maps(cfg) -> list[TensorMap]:
    check_supported(cfg)
    D, E, F = cfg.base_emb_dim, cfg.num_experts, cfg.base_moe_mlp_dim
    router, experts, gate, up, down = NAMES[cfg.decoder_block]
    layer = "model.layers.{i}."
    maps = hf_moe.dense_first(hf_llama.decoder_maps(cfg))
    maps.append(dataclasses.replace(linear(layer + router + ".weight", ("mlp", "router"), (D,), (E,)), mlp="moe"))
    one_expert = [linear(layer + experts + gate + ".weight", ("mlp", "gate"), (D,), (F,)),
                  linear(layer + experts + up + ".weight", ("mlp", "up"), (D,), (F,)),
                  linear(layer + experts + down + ".weight", ("mlp", "down"), (F,), (D,))]
    return maps + [of_expert(t, j) for j in range(E) for t in one_expert]


def import_maps(cfg, names: set[str]) -> list[TensorMap]:
    return tensor_maps(cfg)


ignore = hf_llama.ignore


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    check_supported(cfg)
    window = cfg.sliding_window
    common = {**hf_llama.common_config(cfg, ARCHITECTURES[cfg.decoder_block], cfg.decoder_block, dtype, bos_id,
                                       eos_id),
              "hidden_act": "silu", "num_experts_per_tok": cfg.num_experts_per_tok,
              "router_aux_loss_coef": cfg.load_balance_loss_weight, "output_router_logits": False}
    if cfg.decoder_block == "mixtral":
        return {**common, "intermediate_size": cfg.base_moe_mlp_dim, "num_local_experts": cfg.num_experts,
                "sliding_window": window or None, "router_jitter_noise": 0.0}
    # transformers 5 writes num_local_experts, 4.x num_experts
    return {**common, "moe_intermediate_size": cfg.base_moe_mlp_dim, "num_experts": cfg.num_experts,
            "num_local_experts": cfg.num_experts,
            "norm_topk_prob": bool(cfg.norm_topk_prob), "decoder_sparse_step": cfg.interleave_moe_layer_step,
            "mlp_only_layers": list(range(cfg.first_num_dense_layers)), "attention_bias": bool(cfg.use_bias),
            **qwen2_hf.window_config(cfg)}


def config_overrides(hf: dict) -> dict:
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"config.json model_type={model_type!r} is not mixtral or qwen3_moe")
    hf_llama.check_mlp(hf, "silu")
    L = hf["num_hidden_layers"]
    windows = hf_llama.windows_of(hf, L)
    if len(set(windows)) > 1:
        raise ValueError(f"config.json: sliding windows on some layers only ({windows}): maxlite windows "
                         f"every layer or none")
    out = {**hf_llama.common_overrides(hf, model_type), "sliding_window": windows[0],
           "num_experts_per_tok": hf["num_experts_per_tok"],
           "load_balance_loss_weight": float(hf.get("router_aux_loss_coef", 0.0)),
           "routed_score_func": "softmax", "shared_experts": 0, "routed_bias": False}
    if model_type == "mixtral":
        if hf.get("router_jitter_noise"):
            raise ValueError("config.json: router_jitter_noise > 0 is not modelled by maxlite (set it to 0)")
        return {**out, "use_bias": False, "num_experts": hf["num_local_experts"],
                "base_moe_mlp_dim": hf["intermediate_size"], "norm_topk_prob": True,
                "first_num_dense_layers": 0, "interleave_moe_layer_step": 1}
    first, step = hf_moe.dense_layout(hf, L)
    return {**out, "use_bias": bool(hf.get("attention_bias", False)),
            "num_experts": hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"],
            "base_moe_mlp_dim": hf["moe_intermediate_size"], "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
            "first_num_dense_layers": first, "interleave_moe_layer_step": step}
