"""Llama 4 (`model_type: llama4_text`): Llama4ForCausalLM both ways.

The layer, against Llama 3's: layers of two kinds, three chunked-attention layers (each token attends
to the earlier tokens of its own chunk of `attention_chunk_size` positions: maxlite's `chunked` variant
with chunk_attn_window_size) to one global layer (HF `no_rope_layers` 0: no RoPE, its queries tempered
by position with `attn_temperature_tuning`: maxlite's temperature_tuning keys); on the RoPE layers an
RMS norm without a learned scale over each head of q and k after RoPE (`use_qk_norm`, Scout's; Maverick
has none); the feed-forward dense (`intermediate_size_mlp` wide) or, every `interleave_moe_layer_step`-th
layer, a mixture of experts: the router's top-1 logit through a sigmoid multiplies the token going INTO
its expert (`routed_weight_on_input`), plus one shared expert every token goes through.

RoPE turns interleaved pairs (x[2i], x[2i+1]: HF's complex form) where maxlite turns split halves
(x[i], x[i + H/2]), so q_proj and k_proj rows are permuted within each head on import (pair i's
even member to i, its odd one to i + H/2) and back on export; scores are the same in every layer (the
NoPE layers' too: q and k permuted alike, and the scaleless norm sees the same numbers). Tensors:

  self_attn.q_proj / k_proj .weight          ↔ attn.q / attn.k, rows permuted per head (above)
  feed_forward.gate_proj / up_proj / down_proj ↔ mlp.gate / up / down (dense layers)
  feed_forward.router.weight [E, D]          ↔ mlp.router [D, E]
  feed_forward.experts.gate_up_proj [E, D, 2F] ↔ mlp.gate, mlp.up [E, D, F] (gate the first half)
  feed_forward.experts.down_proj [E, F, D]   ↔ mlp.down
  feed_forward.shared_expert.*_proj.weight   ↔ mlp.shared.gate / up / down

The published Scout and Maverick are Llama4ForConditionalGeneration (`model_type: llama4`): the text
model's config.json is its `text_config`, its tensors are under `language_model.model.` and
`language_model.lm_head.`; an import reads that text model and leaves the vision tower and projector
behind, said in one line (maxlite has no Llama 4 vision encoder); an export writes Llama4ForCausalLM.

transformers' temperature tuning counts positions from the first token of the batch row (with left
padding, from the padding); maxlite's from each document's first token (the same on an unpadded row).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from maxlite.bridge import hf_llama
from maxlite.bridge.hf_convert import TensorMap, config_tail, linear, same
from maxlite.families.llama4 import FAMILY
from maxlite.models.layout import hf_layer_types, layer_kinds

ARCHITECTURE = "Llama4ForCausalLM"
# what the layer is: the keys a llama4 recipe must have (presets set them; an import writes them)
LAYER_KEYS = {"routed_score_func": "sigmoid", "norm_topk_prob": False, "routed_bias": False,
              "routed_scaling_factor": 1.0, "shared_experts": 1, "shared_expert_gate": False, "n_routing_groups": -1,
              "topk_routing_group": -1, "first_num_dense_layers": 0, "routed_weight_on_input": True,
              "num_experts_per_tok": 1, "use_bias": False, "sliding_window": 0, "partial_rotary_factor": 1.0,
              "router_logit_bias": False, "mlp_bias": False}


def check_supported(cfg) -> None:
    if cfg.decoder_block != FAMILY.name:
        raise ValueError(f"decoder_block={cfg.decoder_block} is not llama4")
    wrong = [f"{k}={v}" for k, v in LAYER_KEYS.items() if getattr(cfg, k) != v]
    if wrong:
        raise ValueError(f"{ARCHITECTURE}'s layer needs {', '.join(wrong)} (this recipe differs)")
    if cfg.chunk_attn_window_size < 1:
        raise ValueError(f"{ARCHITECTURE}'s RoPE layers are chunked: set chunk_attn_window_size > 0 (8192)")
    hf_llama.check_plain_attention(cfg, ARCHITECTURE, qk_norm=True)


def _halves(w_DNH):
    """maxlite's split-halves head layout [..., H] → HF's interleaved pairs (kernel [D, n, H] → [D, n·H])."""
    D, n, H = w_DNH.shape
    return w_DNH.reshape(D, n, 2, H // 2).transpose(0, 1, 3, 2).reshape(D, n * H)


def _rotary(hf: str, path, D: int, n: int, H: int) -> TensorMap:
    """q_proj / k_proj [n·H, D] (interleaved pairs) ↔ a kernel [D, n, H] (split halves)."""
    def from_hf(t):
        return (t.T.reshape(D, n, H // 2, 2).transpose(0, 1, 3, 2).reshape(D, n, H),)
    return TensorMap(hf, (path,), (n * H, D), ((D, n, H),), lambda w: _halves(w).T, from_hf)


def tensor_maps(cfg) -> list[TensorMap]:
    check_supported(cfg)
    D, N, K, H = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim
    E, F = cfg.num_experts, cfg.base_moe_mlp_dim
    a, f = "model.layers.{i}.self_attn.", "model.layers.{i}.feed_forward."
    maps = []
    for t in hf_llama.decoder_maps(cfg):
        if t.hf == a + "q_proj.weight":
            t = _rotary(t.hf, ("attn", "q"), D, N, H)
        elif t.hf == a + "k_proj.weight":
            t = _rotary(t.hf, ("attn", "k"), D, K, H)
        elif t.layer and t.paths[0][0] == "mlp":  # the dense layers' MLP, under feed_forward
            t = dataclasses.replace(t, hf=t.hf.replace(".mlp.", ".feed_forward."), mlp="dense")
        maps.append(t)
    moe = [linear(f + "router.weight", ("mlp", "router"), (D,), (E,)),
           TensorMap(f + "experts.gate_up_proj", (("mlp", "gate"), ("mlp", "up")), (E, D, 2 * F),
                     ((E, D, F), (E, D, F)), lambda g, u: np.concatenate([g, u], axis=-1),
                     lambda t: (t[..., :F], t[..., F:])),
           same(f + "experts.down_proj", ("mlp", "down"), (E, F, D)),
           *(linear(f + f"shared_expert.{name}_proj.weight", ("mlp", "shared", name), *shapes)
             for name, shapes in (("gate", ((D,), (F,))), ("up", ((D,), (F,))), ("down", ((F,), (D,)))))]
    return maps + [dataclasses.replace(t, mlp="moe") for t in moe]


# the text model inside the published multimodal checkpoint (Llama4ForConditionalGeneration), as saved
MULTIMODAL = (("model.", "language_model.model."), ("lm_head.", "language_model.lm_head."))
VISION = ("vision_model.", "multi_modal_projector.")


def import_maps(cfg, names: set[str]) -> list[TensorMap]:
    """Llama4ForCausalLM's names, or the text model's inside the published multimodal checkpoint."""
    maps = tensor_maps(cfg)
    if "language_model.model.embed_tokens.weight" in names:
        maps = [dataclasses.replace(t, hf=next((ours + t.hf[len(theirs):] for theirs, ours in MULTIMODAL
                                                if t.hf.startswith(theirs)), t.hf)) for t in maps]
    return maps


def skipped(cfg, names: set[str]) -> set[str]:
    """A multimodal checkpoint's vision tower and projector: left out (the text model is imported), said."""
    return hf_llama.left_out(names, VISION, "the vision tower and projector", "maxlite imports Llama 4's text model")


ignore = hf_llama.ignore


def _floor_scale(cfg):
    v = cfg.temperature_tuning_floor_scale
    return int(v) if float(v).is_integer() else v


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    check_supported(cfg)
    common = hf_llama.common_config(cfg, ARCHITECTURE, "llama4_text", dtype, bos_id, eos_id)
    kinds = layer_kinds(cfg)
    return {**common, "hidden_act": "silu", "intermediate_size": cfg.base_moe_mlp_dim,
            "intermediate_size_mlp": cfg.base_mlp_dim, "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok, "interleave_moe_layer_step": cfg.interleave_moe_layer_step,
            "moe_layers": [i for i, k in enumerate(kinds) if k.ffn == "moe"],
            "no_rope_layers": [int(k.variant == "chunked") for k in kinds], "layer_types": hf_layer_types(cfg),
            "attention_chunk_size": cfg.chunk_attn_window_size, "use_qk_norm": bool(cfg.use_qk_norm),
            "attn_temperature_tuning": bool(cfg.temperature_tuning), "attn_scale": cfg.temperature_tuning_scale,
            "floor_scale": _floor_scale(cfg), "attention_bias": False,
            "router_aux_loss_coef": cfg.load_balance_loss_weight, "output_router_logits": False,
            "router_jitter_noise": 0.0, **config_tail(dtype, bos_id, eos_id)}


# transformers' Llama4TextConfig defaults of the keys a config.json may leave out
DEFAULTS = {"attention_chunk_size": 8192, "intermediate_size_mlp": 16384, "intermediate_size": 8192,
            "num_local_experts": 16}


def _layers(hf: dict) -> tuple[list[str], int]:
    """(each layer's maxlite layer_types name, interleave_moe_layer_step) as config.json states them;
    what maxlite cannot express is refused in one line."""
    L = hf["num_hidden_layers"]
    interval = hf.get("no_rope_layer_interval", 4)
    rope = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(L)]
    if not hf.get("attention_chunk_size", DEFAULTS["attention_chunk_size"]):
        raise ValueError("config.json: attention_chunk_size=null (no chunked layers) is not modelled by maxlite: its "
                         "Llama 4 layers are chunked RoPE layers or global NoPE layers")
    types = hf.get("layer_types") or ["chunked_attention" if r else "full_attention" for r in rope[:L]]
    if [t == "chunked_attention" for t in types] != [bool(r) for r in rope[:L]]:
        raise ValueError(f"config.json: layer_types={types} with no_rope_layers={rope[:L]}: maxlite's Llama 4 layers "
                         f"are chunked with RoPE or global without it")
    step = hf.get("interleave_moe_layer_step", 1)
    moe = hf.get("moe_layers")
    if moe is not None and list(moe) != list(range(step - 1, L, step)):
        raise ValueError(f"config.json: moe_layers={moe} is not every interleave_moe_layer_step={step}-th layer "
                         f"(the only MoE layout maxlite's Llama 4 has)")
    if hf.get("num_experts_per_tok", 1) != 1:  # transformers' default: 1
        raise ValueError(f"config.json: num_experts_per_tok={hf['num_experts_per_tok']}: Llama 4's router weight "
                         f"scales the expert's input, which maxlite models for one expert per token only")
    return types, step


def config_overrides(hf: dict) -> dict:
    if hf.get("model_type") == "llama4":  # the published multimodal checkpoint: its text model
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("config.json: model_type=llama4 without a text_config")
        return config_overrides({"model_type": "llama4_text", **text})
    if hf.get("model_type") != "llama4_text":
        raise ValueError(f"config.json model_type={hf.get('model_type')!r} is not llama4_text or llama4")
    hf_llama.check_mlp(hf, "silu")
    if hf.get("attention_bias"):
        raise ValueError(f"config.json: attention_bias=true is not {ARCHITECTURE}'s layer in maxlite")
    types, step = _layers(hf)
    pattern = [("chunked_attention", "full_attention")[(i + 1) % 4 == 0] for i in range(len(types))]
    out = {**hf_llama.common_overrides(hf, FAMILY.name), **LAYER_KEYS,
           "base_mlp_dim": hf.get("intermediate_size_mlp", DEFAULTS["intermediate_size_mlp"]),
           "base_moe_mlp_dim": hf.get("intermediate_size", DEFAULTS["intermediate_size"]),
           "num_experts": hf.get("num_local_experts", DEFAULTS["num_local_experts"]), "interleave_moe_layer_step": step,
           "use_qk_norm": bool(hf.get("use_qk_norm", True)),
           "chunk_attn_window_size": hf.get("attention_chunk_size", DEFAULTS["attention_chunk_size"]),
           "temperature_tuning": bool(hf.get("attn_temperature_tuning", True)),
           "temperature_tuning_scale": float(hf.get("attn_scale", 0.1)),
           "temperature_tuning_floor_scale": float(hf.get("floor_scale", 8192)),
           "load_balance_loss_weight": float(hf.get("router_aux_loss_coef", 0.0))}
    if types != pattern:  # a checkpoint's own pattern: that is the pattern
        out["layer_types"] = types
    return out
