"""gpt-oss (OpenAI, `model_type: gpt_oss`): GptOssForCausalLM both ways.

The layer: pre-RMSNorms, grouped-query attention with q/k/v/o biases and attention sinks (a learned
logit per query head in every softmax's denominator), sliding-window (128) and global layers in
turn (layer 0 local), YaRN RoPE; every layer a mixture of experts whose router has a bias in its
logits (top k of the logits, their softmax as weights) and whose experts have biases and gpt-oss's
clamped SwiGLU, (up + 1)·g·σ(1.702·g) with the gate clamped above and up on both sides at
`swiglu_limit` (maxlite.models.layers.clamped_swiglu).

Tensors are Llama's for attention and norms, plus (checkpoint layout as transformers writes it):

  self_attn.sinks [N]                         ↔ attn.sinks
  mlp.router.weight [E, D], .bias [E]         ↔ mlp.router [D, E], mlp.router_logit_bias
  mlp.experts.gate_up_proj [E, D, 2F]         ↔ mlp.gate, mlp.up [E, D, F], interleaved: gate the
                                                even columns, up the odd ones
  mlp.experts.gate_up_proj_bias [E, 2F]       ↔ mlp.gate_bias, mlp.up_bias (interleaved alike)
  mlp.experts.down_proj [E, F, D], _bias [E, D] ↔ mlp.down, mlp.down_bias

The published checkpoints store the experts' two matrices as MXFP4 (`*_blocks` and `*_scales`,
[E, out, in/32, 16] and [E, out, in/32]); an import dequantizes them to
what transformers' own dequantization gives (maxlite.bridge.mxfp4); an export writes float32, bfloat16
or (`--dtype mxfp4`) the experts' matrices as MXFP4 again, the rest in bfloat16.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from maxlite.bridge import hf_llama
from maxlite.bridge.hf_convert import TensorMap, config_tail, linear, same
from maxlite.families.gpt_oss import FAMILY
from maxlite.models.families import SWIGLU_ALPHA
from maxlite.models.layout import hf_layer_types


# what the layer is: the keys a gpt_oss recipe must have (presets set them; an import writes them)
LAYER_KEYS = {"attention_sink": True, "router_logit_bias": True, "mlp_bias": True, "norm_topk_prob": True,
              "routed_score_func": "softmax", "routed_bias": False, "shared_experts": 0,
              "first_num_dense_layers": 0, "interleave_moe_layer_step": 1}


def check_supported(cfg) -> None:
    if cfg.decoder_block != FAMILY.name:
        raise ValueError(f"decoder_block={cfg.decoder_block} is not gpt_oss")
    wrong = [f"{k}={v}" for k, v in LAYER_KEYS.items() if getattr(cfg, k) != v]
    if wrong:
        raise ValueError(f"GptOssForCausalLM's layer needs {', '.join(wrong)} (this recipe differs)")
    if cfg.query_pre_attn_scalar not in (0, cfg.head_dim) or cfg.local_rope_max_timescale:
        raise ValueError("GptOssForCausalLM has one RoPE and scales scores by 1/sqrt(head_dim): set "
                         "query_pre_attn_scalar=0 and local_rope_max_timescale=0")


def _interleave(a, b):
    """[..., F] and [..., F] → [..., 2F], a in the even columns (gpt-oss's gate_up layout)."""
    return np.stack([a, b], axis=-1).reshape(*a.shape[:-1], 2 * a.shape[-1])


def _pair(hf: str, paths, shape) -> TensorMap:
    """One interleaved HF tensor [..., 2F] ↔ two leaves [..., F] (gate, up)."""
    hf_shape = (*shape[:-1], 2 * shape[-1])
    return TensorMap(hf, paths, hf_shape, (shape, shape), _interleave, lambda t: (t[..., ::2], t[..., 1::2]),
                     mlp="moe")


def tensor_maps(cfg) -> list[TensorMap]:
    check_supported(cfg)
    D, N, E, F = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.num_experts, cfg.base_moe_mlp_dim
    layer = "model.layers.{i}."
    moe = lambda t: dataclasses.replace(t, mlp="moe")  # noqa: E731
    # Llama's tensors without its dense MLP (every gpt-oss layer is MoE)
    maps = [t for t in hf_llama.decoder_maps(cfg) if not (t.layer and t.paths[0][0] == "mlp")]
    x = layer + "mlp.experts."
    return maps + [
        same(layer + "self_attn.sinks", ("attn", "sinks"), (N,)),
        moe(linear(layer + "mlp.router.weight", ("mlp", "router"), (D,), (E,))),
        moe(same(layer + "mlp.router.bias", ("mlp", "router_logit_bias"), (E,))),
        _pair(x + "gate_up_proj", (("mlp", "gate"), ("mlp", "up")), (E, D, F)),
        _pair(x + "gate_up_proj_bias", (("mlp", "gate_bias"), ("mlp", "up_bias")), (E, F)),
        moe(same(x + "down_proj", ("mlp", "down"), (E, F, D))),
        moe(same(x + "down_proj_bias", ("mlp", "down_bias"), (E, D))),
    ]


def import_maps(cfg, names: set[str]) -> list[TensorMap]:
    return tensor_maps(cfg)


def tensor_source(source):
    """The checkpoint's tensors as the maps name them: MXFP4 experts dequantized on read."""
    from maxlite.bridge import mxfp4

    return mxfp4.dequantizing(source)


ignore = hf_llama.ignore
MXFP4_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # what `--dtype mxfp4` quantizes
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    check_supported(cfg)
    return {**hf_llama.common_config(cfg, "GptOssForCausalLM", "gpt_oss", dtype, bos_id, eos_id),
            "hidden_act": "silu", "intermediate_size": cfg.base_moe_mlp_dim, "attention_bias": bool(cfg.use_bias),
            "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "sliding_window": cfg.sliding_window or None, "layer_types": hf_layer_types(cfg),
            "swiglu_alpha": SWIGLU_ALPHA, "swiglu_limit": cfg.mlp_activations_limit,
            "router_aux_loss_coef": cfg.load_balance_loss_weight, "output_router_logits": False,
            **config_tail(dtype, bos_id, eos_id)}


def config_overrides(hf: dict) -> dict:
    if hf.get("model_type") != "gpt_oss":
        raise ValueError(f"config.json model_type={hf.get('model_type')!r} is not gpt_oss")
    alpha = float(hf.get("swiglu_alpha", SWIGLU_ALPHA))
    if alpha != SWIGLU_ALPHA:
        raise ValueError(f"config.json: swiglu_alpha={alpha} is not gpt-oss's {SWIGLU_ALPHA} (the one maxlite models)")
    L = hf["num_hidden_layers"]
    windows = hf_llama.windows_of({"sliding_window": 128, **hf}, L)
    return {**hf_llama.common_overrides(hf, FAMILY.name), **LAYER_KEYS,
            "use_bias": bool(hf.get("attention_bias", True)), "sliding_window": max(windows),
            **hf_llama.pattern_keys(FAMILY.name, windows),
            "num_experts": hf["num_local_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
            "base_moe_mlp_dim": hf["intermediate_size"], "mlp_activations_limit": float(hf.get("swiglu_limit", 7.0)),
            "load_balance_loss_weight": float(hf.get("router_aux_loss_coef", 0.0))}
