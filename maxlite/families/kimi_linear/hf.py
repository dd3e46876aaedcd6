"""Kimi Linear (`model_type: kimi_linear`): KimiLinearForCausalLM both ways.

transformers builds it from DeepSeek-V3's modules and its own delta attention; where maxlite has each:
- `linear_attention` layers: Kimi delta attention (the `kda` mixer kind, maxlite/models/kda.py):
    self_attn.{q,k,v}_proj [H·Dh, D]                 ↔ attn.q, k, v [D, H, Dh]
    self_attn.{q,k,v}_conv1d.weight [H·Dh, 1, W]      ↔ attn.conv_q, conv_k, conv_v [W, H, Dh]
    self_attn.f_a_proj [Dh, D], f_b_proj [H·Dh, Dh]   ↔ attn.f_a [D, Dh], f_b [Dh, H, Dh]
    self_attn.dt_bias [H·Dh], A_log [1, 1, H, 1]      ↔ attn.dt_bias [H, Dh], A_log [H]
    self_attn.b_proj [H, D]                           ↔ attn.b [D, H]
    self_attn.g_a_proj [Dh, D], g_b_proj [H·Dh, Dh]   ↔ attn.g_a [D, Dh], g_b [Dh, H, Dh]
    self_attn.o_norm.weight [Dh], o_proj [D, H·Dh]     ↔ attn.norm_scale, attn.o [H, Dh, D]
  Their dims are the gated delta-net keys (gdn_num_key_heads = gdn_num_value_heads = linear_num_heads,
  gdn_key_head_dim = gdn_value_head_dim = linear_head_dim, gdn_conv_kernel_dim).
- `full_attention` layers: DeepSeek's latent attention (attention_type: mla, DeepSeek's tensor names,
  maxlite/families/deepseek/hf.py) without RoPE: the shared key's R dims are used unrotated (the
  family's `positions: none`), so no RoPE permutation either.
- MLP, all under block_sparse_moe.: dense in the leading `mlp_layer_types: dense` layers
  ({gate,up,down}_proj), DeepSeekMoE after them (gate.weight, gate.e_score_correction_bias,
  shared_experts.*, experts.{j}.w1/w3/w2 = gate/up/down): sigmoid scores + the bias for the choice,
  groups scored by their best two, renormalised (`moe_renormalize`) × routed_scaling_factor.
The tensor names are Moonshot's, as the published checkpoint has them and as transformers saves
them (its loader renames them to its modules: forget_gate.*, one conv1d, mlp.*, fused experts).
config.json as transformers 5 writes it (num_experts, num_experts_per_token, num_shared_experts,
moe_renormalize, num_expert_group, model_max_length) or as Moonshot publishes it (linear_attn_config,
first_k_dense_replace, n_shared_experts, …): both import.
"""

from __future__ import annotations

import dataclasses

from maxlite.bridge import hf_llama, hf_moe
from maxlite.bridge.hf_convert import TensorMap, config_tail, linear, of_expert, same
from maxlite.families.deepseek.hf import attention_maps
from maxlite.families.kimi_linear import FAMILY
from maxlite.models.layout import check_layer_types, hf_layer_types

KDA = "kda"


def check_supported(cfg) -> None:
    if cfg.decoder_block != FAMILY.name:
        raise ValueError(f"decoder_block={cfg.decoder_block} is not kimi_linear")
    if cfg.attention_type != "mla":
        raise ValueError("Kimi Linear's full-attention layers are latent attention: set attention_type=mla")
    if cfg.use_bias or cfg.sliding_window or cfg.mtp_num_layers:
        raise ValueError("KimiLinearForCausalLM has no attention biases, sliding windows or multi-token-prediction "
                         "layers: set use_bias=false, sliding_window=0, mtp_num_layers=0")
    if not cfg.num_experts or cfg.interleave_moe_layer_step != 1 or not cfg.shared_experts:
        raise ValueError("Kimi Linear has MoE in every layer after the first dense ones, with shared experts: set "
                         "num_experts > 0, interleave_moe_layer_step=1 and shared_experts > 0")
    if cfg.routed_score_func != "sigmoid" or not cfg.routed_bias:
        raise ValueError("Kimi Linear routes by sigmoid scores with a choice bias: set routed_score_func=sigmoid, "
                         "routed_bias=true")


def _conv(name: str, which: str, H: int, E: int, W: int) -> TensorMap:
    """{q,k,v}_conv1d.weight [H·Dh, 1, W] ↔ conv_{q,k,v} [W, H, Dh]."""
    return TensorMap(name, (("attn", f"conv_{which}"),), (H * E, 1, W), ((W, H, E),),
                     lambda w: w.reshape(W, H * E).T[:, None, :], lambda t: (t[:, 0, :].T.reshape(W, H, E),))


def kda_maps(cfg, prefix: str = "model.layers.{i}.self_attn.") -> list[TensorMap]:
    D, H, E, W = cfg.base_emb_dim, cfg.gdn_num_value_heads, cfg.gdn_key_head_dim, cfg.gdn_conv_kernel_dim
    a = prefix
    maps = [*(linear(a + f"{n}_proj.weight", ("attn", n), (D,), (H, E)) for n in "qkv"),
            *(_conv(a + f"{n}_conv1d.weight", n, H, E, W) for n in "qkv"),
            linear(a + "f_a_proj.weight", ("attn", "f_a"), (D,), (E,)),
            linear(a + "f_b_proj.weight", ("attn", "f_b"), (E,), (H, E)),
            same(a + "dt_bias", ("attn", "dt_bias"), (H, E), (H * E,)),
            same(a + "A_log", ("attn", "A_log"), (H,), (1, 1, H, 1)),
            linear(a + "b_proj.weight", ("attn", "b"), (D,), (H,)),
            linear(a + "g_a_proj.weight", ("attn", "g_a"), (D,), (E,)),
            linear(a + "g_b_proj.weight", ("attn", "g_b"), (E,), (H, E)),
            same(a + "o_norm.weight", ("attn", "norm_scale"), (E,)),
            linear(a + "o_proj.weight", ("attn", "o"), (H, E), (D,))]
    return [dataclasses.replace(t, mixer=KDA) for t in maps]


def tensor_maps(cfg) -> list[TensorMap]:
    check_supported(cfg)
    D, V, F, Fm = cfg.base_emb_dim, cfg.vocab_size, cfg.base_mlp_dim, cfg.base_moe_mlp_dim
    layer, m = "model.layers.{i}.", "model.layers.{i}.block_sparse_moe."
    maps = [same("model.embed_tokens.weight", ("embedding",), (V, D), layer=False),
            same("model.norm.weight", ("final_norm", "scale"), (D,), layer=False),
            same(layer + "input_layernorm.weight", ("attn_norm", "scale"), (D,)),
            same(layer + "post_attention_layernorm.weight", ("mlp_norm", "scale"), (D,))]
    if not cfg.logits_via_embedding:
        maps.append(linear("lm_head.weight", ("unembedding",), (D,), (V,), layer=False))
    dense = [linear(m + "gate_proj.weight", ("mlp", "gate"), (D,), (F,)),
             linear(m + "up_proj.weight", ("mlp", "up"), (D,), (F,)),
             linear(m + "down_proj.weight", ("mlp", "down"), (F,), (D,))]
    routed_and_shared = [t for t in hf_moe.deepseek_moe_maps(cfg, m) if t.expert is None]  # router, shared experts
    one_expert = [linear(m + "experts.{j}.w1.weight", ("mlp", "gate"), (D,), (Fm,)),
                  linear(m + "experts.{j}.w3.weight", ("mlp", "up"), (D,), (Fm,)),
                  linear(m + "experts.{j}.w2.weight", ("mlp", "down"), (Fm,), (D,))]
    return (maps + [dataclasses.replace(t, mixer="mla") for t in attention_maps(cfg, interleaved=False)]
            + kda_maps(cfg) + [dataclasses.replace(t, mlp="dense") for t in dense] + routed_and_shared
            + [dataclasses.replace(of_expert(t, j), mlp="moe") for j in range(cfg.num_experts) for t in one_expert])


def import_maps(cfg, names: set[str]) -> list[TensorMap]:
    return tensor_maps(cfg)


ignore = hf_llama.ignore


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    check_supported(cfg)
    L, first = cfg.base_num_decoder_layers, cfg.first_num_dense_layers
    moe = hf_moe.deepseek_moe_config(cfg)
    return {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
            "hidden_size": cfg.base_emb_dim, "intermediate_size": cfg.base_mlp_dim, "num_hidden_layers": L,
            "num_attention_heads": cfg.base_num_query_heads, "num_key_value_heads": cfg.base_num_query_heads,
            "vocab_size": cfg.vocab_size, "model_max_length": hf_llama.max_positions(cfg),
            "rms_norm_eps": cfg.normalization_layer_epsilon, "tie_word_embeddings": bool(cfg.logits_via_embedding),
            "initializer_range": cfg.init_scale, "hidden_act": "silu", "attention_bias": False,
            "attention_dropout": 0.0, "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim, "layer_types": hf_layer_types(cfg),
            "mlp_layer_types": ["dense"] * first + ["sparse"] * (L - first),
            "linear_num_heads": cfg.gdn_num_value_heads, "linear_head_dim": cfg.gdn_key_head_dim,
            "linear_conv_kernel_dim": cfg.gdn_conv_kernel_dim,
            "num_experts": moe["n_routed_experts"], "num_experts_per_token": moe["num_experts_per_tok"],
            "moe_intermediate_size": moe["moe_intermediate_size"], "num_shared_experts": moe["n_shared_experts"],
            "moe_renormalize": moe["norm_topk_prob"], "routed_scaling_factor": moe["routed_scaling_factor"],
            "num_expert_group": moe["n_group"], "topk_group": moe["topk_group"],
            # stated: KimiLinearConfig's own default pad id (163839) is outside a smaller vocabulary
            "pad_token_id": None, **config_tail(dtype, bos_id, eos_id)}


def _first(hf: dict, *names, default=None):
    return next((hf[n] for n in names if hf.get(n) is not None), default)


def _refuse_unmodelled(hf: dict, linear_cfg: dict) -> None:
    """What Moonshot's later configs (and its remote code) can state beyond Kimi-Linear-48B's layer."""
    if hf.get("attention_bias"):
        raise ValueError("config.json: attention_bias=true is not modelled by maxlite (maxlite has no MLA biases)")
    if hf.get("mla_use_nope") is False:
        raise ValueError("config.json: mla_use_nope=false (RoPE in the latent attention layers) is not modelled by "
                         "maxlite's Kimi Linear, whose latent attention has no positions")
    if hf.get("mla_use_output_gate"):
        raise ValueError("config.json: mla_use_output_gate=true (a gated latent attention) is not modelled by maxlite")
    if linear_cfg.get("use_full_rank_gate") or linear_cfg.get("gate_lower_bound") is not None:
        raise ValueError("config.json: linear_attn_config's use_full_rank_gate / gate_lower_bound (another KDA "
                         "forget gate) are not modelled by maxlite (the low-rank gate of Kimi-Linear-48B is)")
    if hf.get("moe_router_activation_func", "sigmoid") != "sigmoid" or (hf.get("moe_layer_freq") or 1) != 1:
        raise ValueError("config.json: Kimi Linear's MoE is modelled with sigmoid routing in every layer after the "
                         "dense ones (moe_router_activation_func=sigmoid, moe_layer_freq=1)")
    if hf.get("num_nextn_predict_layers"):
        raise ValueError("config.json: num_nextn_predict_layers > 0: Kimi Linear's multi-token prediction is not "
                         "modelled by maxlite")


def config_overrides(hf: dict) -> dict:
    if hf.get("model_type") != "kimi_linear":
        raise ValueError(f"config.json model_type={hf.get('model_type')!r} is not kimi_linear")
    hf_llama.check_mlp(hf, "silu")
    L, linear_cfg = hf["num_hidden_layers"], hf.get("linear_attn_config") or {}
    _refuse_unmodelled(hf, linear_cfg)
    types = hf.get("layer_types")
    if not types and "full_attn_layers" in linear_cfg:  # Moonshot's config: 1-indexed layer lists
        types = ["full_attention" if i + 1 in linear_cfg["full_attn_layers"] else "linear_attention" for i in range(L)]
    types = types or ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(L)]
    problem = check_layer_types(types, L)
    if problem:
        raise ValueError(f"config.json: {problem}")
    mlp_types = hf.get("mlp_layer_types") or [
        "dense" if i < hf.get("first_k_dense_replace", 1) else "sparse" for i in range(L)]
    first = next((i for i, t in enumerate(mlp_types) if t != "dense"), L)
    if any(t != "sparse" for t in mlp_types[first:]) or first >= L:
        raise ValueError(f"config.json: mlp_layer_types={mlp_types}: maxlite's Kimi Linear has dense layers first "
                         f"(first_num_dense_layers), then MoE in every layer")
    heads = _first(hf, "linear_num_heads", default=linear_cfg.get("num_heads", 32))
    width = _first(hf, "linear_head_dim", default=linear_cfg.get("head_dim", 128))
    moe = hf_moe.deepseek_moe_overrides({
        "n_routed_experts": _first(hf, "num_experts", "num_local_experts", "n_routed_experts"),
        "num_experts_per_tok": _first(hf, "num_experts_per_token", "num_experts_per_tok"),
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "n_shared_experts": _first(hf, "num_shared_experts", "n_shared_experts", default=1),
        "first_k_dense_replace": first, "norm_topk_prob": _first(hf, "moe_renormalize", "norm_topk_prob", default=True),
        "routed_scaling_factor": hf.get("routed_scaling_factor"), "n_group": _first(hf, "num_expert_group", "n_group"),
        "topk_group": hf.get("topk_group")})
    N = hf["num_attention_heads"]
    common = hf_llama.common_overrides({**hf, "max_position_embeddings": _first(
        hf, "model_max_length", "max_position_embeddings", default=1048576)}, FAMILY.name)
    for rope_key in [k for k in common if k.startswith("rope_")]:  # no positions: RoPE keys stay defaults
        common.pop(rope_key)
    out = {**common, **moe, "attention_type": "mla", "use_bias": False,
           "base_num_kv_heads": N, "head_dim": hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
           "q_lora_rank": hf.get("q_lora_rank") or 0, "kv_lora_rank": hf["kv_lora_rank"],
           "qk_nope_head_dim": hf["qk_nope_head_dim"], "qk_rope_head_dim": hf["qk_rope_head_dim"],
           "v_head_dim": hf["v_head_dim"], "gdn_num_key_heads": heads, "gdn_num_value_heads": heads,
           "gdn_key_head_dim": width, "gdn_value_head_dim": width,
           "gdn_conv_kernel_dim": _first(hf, "linear_conv_kernel_dim",
                                         default=linear_cfg.get("short_conv_kernel_size", 4))}
    pattern = [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(L)]
    if list(types) != pattern:  # a checkpoint's own pattern is its pattern
        out["layer_types"] = list(types)
    return out
