"""DeepSeek-V4 (`model_type: deepseek_v4`): DeepseekV4ForCausalLM both ways.

Tensors (torch nn.Linear [out, in] ↔ maxlite [in, out], as elsewhere; N streams, D width, E experts,
F expert width, k experts per token):
  model.embed_tokens, model.norm, lm_head                  ↔ embedding, final_norm, unembedding
  model.hc_head.{hc_fn [N, N·D], hc_base, hc_scale}        ↔ hc_head.{fn [N·D, N], base, scale}
  layers.{i}.{attn_hc, ffn_hc}.{fn [(2+N)·N, N·D], base, scale} ↔ {attn_hc, mlp_hc}.{fn, base, scale}
  layers.{i}.{input, post_attention}_layernorm             ↔ attn_norm, mlp_norm
  layers.{i}.self_attn.*                                   ↔ attn.* (attention_maps below)
  layers.{i}.mlp.gate.weight [E, D]                        ↔ mlp.router [D, E]
  layers.{i}.mlp.gate.e_score_correction_bias [E]          ↔ mlp.router_bias (top-k routed layers)
  layers.{i}.mlp.gate.tid2eid [V, k] (int64)               ↔ mlp.tid2eid (float32 whole numbers; hash layers)
  layers.{i}.mlp.experts.gate_up_proj [E, 2F, D], down_proj [E, D, F] ↔ mlp.gate, mlp.up [E, D, F], mlp.down
  layers.{i}.mlp.shared_experts.{gate,up,down}_proj       ↔ mlp.shared.{gate, up, down}
DeepSeek's own release names the same tensors without the `model.` prefix (`embed.weight`,
`layers.{i}.…`, `norm.weight`, `hc_head_fn`/`_base`/`_scale`: transformers' conversion mapping for
deepseek_v4 reads them); an import reads either (`import_maps`), its multi-token-prediction layers
(`mtp.*`) left out in one line; an export writes transformers' names. RoPE rotates interleaved pairs
of each head's last qk_rope_head_dim channels, as maxlite's V4 layers do: no rows are permuted.
config.json's `rope_parameters` holds two sets, `main` (the sliding layers' base, unscaled) and
`compress` (the compressed layers' base, with YaRN at attention factor 1).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from maxlite.bridge import hf_llama
from maxlite.bridge.hf_convert import TensorMap, linear, of_expert, same
from maxlite.families.deepseek_v4 import FAMILY, default_layer_types
from maxlite.models.layout import hf_layer_types

ARCHITECTURE = "DeepseekV4ForCausalLM"


def check_supported(cfg) -> None:
    if cfg.decoder_block != FAMILY.name:
        raise ValueError(f"decoder_block={cfg.decoder_block} is not deepseek_v4")
    if not cfg.hc_mult or not cfg.q_lora_rank or not cfg.o_groups or cfg.base_num_kv_heads != 1:
        raise ValueError("DeepSeek-V4 has hyper-connections, a query latent, a grouped output projection and one "
                         "shared key=value head: set hc_mult, q_lora_rank, o_groups > 0 and base_num_kv_heads=1")
    if cfg.mtp_num_layers or cfg.first_num_dense_layers or cfg.interleave_moe_layer_step != 1 or not cfg.shared_experts:
        raise ValueError("DeepseekV4ForCausalLM has MoE with shared experts in every layer and no multi-token-"
                         "prediction layers: set first_num_dense_layers=0, interleave_moe_layer_step=1, "
                         "shared_experts > 0, mtp_num_layers=0")
    if cfg.routed_score_func == "softmax" or not cfg.routed_bias or not cfg.norm_topk_prob or cfg.n_routing_groups > 0:
        raise ValueError("DeepSeek-V4 routes by √softplus (or sigmoid) scores with a choice bias, renormalised, "
                         "without groups: set routed_score_func=sqrtsoftplus, routed_bias=true, norm_topk_prob=true")
    if cfg.rope_scaling_factor > 0 and cfg.rope_scaling_type != "yarn":
        raise ValueError(f"rope_scaling_type={cfg.rope_scaling_type}: DeepSeek-V4 scales its compressed layers' RoPE "
                         f"with YaRN only (or not at all): set rope_scaling_type=yarn")
    if cfg.use_bias or cfg.mlp_bias or cfg.shared_expert_gate or cfg.router_logit_bias:
        raise ValueError("DeepseekV4ForCausalLM has no biases and no shared-expert gate")


def _grouped(hf: str, path: tuple, G: int, width: int, L: int) -> TensorMap:
    """The grouped output projection's first half: torch [G·L, width] (DeepseekV4GroupedLinear, each
    group's L rows) ↔ maxlite [G, width, L]."""
    return TensorMap(hf, (path,), (G * L, width), ((G, width, L),),
                     lambda w: w.transpose(0, 2, 1).reshape(G * L, width),
                     lambda t: (t.reshape(G, L, width).transpose(0, 2, 1),))


def attention_maps(cfg, prefix: str = "model.layers.{i}.attn.") -> list[TensorMap]:
    """Every layer's attention; the compressor in the compressed layers, the indexer in the sparse ones."""
    D, N, H, Q = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.head_dim, cfg.q_lora_rank
    G, L, I, J = cfg.o_groups, cfg.o_lora_rank, cfg.index_n_heads, cfg.index_head_dim
    a = prefix
    maps = [linear(a + "wq_a.weight", ("attn", "q_a"), (D,), (Q,)),
            same(a + "q_norm.weight", ("attn", "q_a_norm", "scale"), (Q,)),
            linear(a + "wq_b.weight", ("attn", "q_b"), (Q,), (N, H)),
            linear(a + "wkv.weight", ("attn", "kv"), (D,), (H,)),
            same(a + "norm.weight", ("attn", "kv_norm", "scale"), (H,)),
            _grouped(a + "wo_a.weight", ("attn", "o_a"), G, N * H // G, L),
            linear(a + "wo_b.weight", ("attn", "o_b"), (G * L,), (D,)),
            same(a + "attn_sink", ("attn", "sinks"), (N,))]
    compressed = []
    for mixer, rate, width in (("v4_hca", cfg.compress_rate_hca, H), ("v4_csa", cfg.compress_rate_csa, 2 * H)):
        c = a + "compressor."
        compressed += [dataclasses.replace(t, mixer=mixer) for t in (
            linear(c + "wkv.weight", ("attn", "compressor", "kv"), (D,), (width,)),
            linear(c + "wgate.weight", ("attn", "compressor", "gate"), (D,), (width,)),
            same(c + "ape", ("attn", "compressor", "position_bias"), (rate, width)),
            same(c + "norm.weight", ("attn", "compressor", "kv_norm", "scale"), (H,)))]
    x, m = a + "indexer.", cfg.compress_rate_csa
    compressed += [dataclasses.replace(t, mixer="v4_csa") for t in (
        linear(x + "compressor.wkv.weight", ("attn", "indexer", "kv"), (D,), (2 * J,)),
        linear(x + "compressor.wgate.weight", ("attn", "indexer", "gate"), (D,), (2 * J,)),
        same(x + "compressor.ape", ("attn", "indexer", "position_bias"), (m, 2 * J)),
        same(x + "compressor.norm.weight", ("attn", "indexer", "kv_norm", "scale"), (J,)),
        linear(x + "wq_b.weight", ("attn", "indexer", "q_b"), (Q,), (I, J)),
        linear(x + "weights_proj.weight", ("attn", "indexer", "weights_proj"), (D,), (I,)))]
    return maps + compressed


def _hyper(cfg, hf: str, path: tuple, rows: int, names: tuple[str, str, str], scales: int,
           layer: bool = True) -> list[TensorMap]:
    N, D = cfg.hc_mult, cfg.base_emb_dim
    return [linear(hf + names[0], (*path, "fn"), (N * D,), (rows,), layer=layer),
            same(hf + names[1], (*path, "base"), (rows,), layer=layer),
            same(hf + names[2], (*path, "scale"), (scales,), layer=layer)]


def _moe(cfg, ffn: str) -> list[TensorMap]:
    D, E, F, V, k = cfg.base_emb_dim, cfg.num_experts, cfg.base_moe_mlp_dim, cfg.vocab_size, cfg.num_experts_per_tok
    Fs = cfg.shared_experts * F
    m = "model.layers.{i}.ffn."
    maps = [linear(m + "gate.weight", ("mlp", "router"), (D,), (E,)),
            linear(m + "shared_experts.w1.weight", ("mlp", "shared", "gate"), (D,), (Fs,)),
            linear(m + "shared_experts.w3.weight", ("mlp", "shared", "up"), (D,), (Fs,)),
            linear(m + "shared_experts.w2.weight", ("mlp", "shared", "down"), (Fs,), (D,))]
    if ffn == "hash_moe":
        maps.append(TensorMap(m + "gate.tid2eid", (("mlp", "tid2eid"),), (V, k), ((V, k),),
                              lambda w: np.rint(w).astype(np.int64), lambda t: (t.astype(np.float32),)))
    else:
        maps.append(same(m + "gate.bias", ("mlp", "router_bias"), (E,)))
    one_expert = [linear(m + "experts.{j}.w1.weight", ("mlp", "gate"), (D,), (F,)),
                  linear(m + "experts.{j}.w3.weight", ("mlp", "up"), (D,), (F,)),
                  linear(m + "experts.{j}.w2.weight", ("mlp", "down"), (F,), (D,))]
    return ([dataclasses.replace(t, mlp=ffn) for t in maps]
            + [dataclasses.replace(of_expert(t, j), mlp=ffn) for j in range(E) for t in one_expert])


def tensor_maps(cfg) -> list[TensorMap]:
    check_supported(cfg)
    D, V, N = cfg.base_emb_dim, cfg.vocab_size, cfg.hc_mult
    layer = "model.layers.{i}."
    maps = [same("model.embed_tokens.weight", ("embedding",), (V, D), layer=False),
            same("model.norm.weight", ("final_norm", "scale"), (D,), layer=False),
            linear("head.weight", ("unembedding",), (D,), (V,), layer=False),
            *_hyper(cfg, "model.hc_head.", ("hc_head",), N, ("hc_fn", "hc_base", "hc_scale"), 1, layer=False),
            same(layer + "attn_norm.weight", ("attn_norm", "scale"), (D,)),
            same(layer + "ffn_norm.weight", ("mlp_norm", "scale"), (D,)),
            *_hyper(cfg, layer, ("attn_hc",), (2 + N) * N, ("hc_attn_fn", "hc_attn_base", "hc_attn_scale"), 3),
            *_hyper(cfg, layer, ("mlp_hc",), (2 + N) * N, ("hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale"), 3)]
    return maps + attention_maps(cfg) + _moe(cfg, "moe") + _moe(cfg, "hash_moe")


# transformers' saved names → DeepSeek's released ones (the prefix and the output head's hyper-connection)
RELEASED = (("model.embed_tokens.", "embed."), ("model.norm.", "norm."), ("model.layers.", "layers."),
            ("model.hc_head.hc_", "hc_head_"))
MTP = "mtp."


def released(name: str) -> str:
    """A tensor's name in DeepSeek's own release."""
    for theirs, ours in RELEASED:
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return name


# transformers' module names of the projections LoRA adapts (its conversion mapping renames the saved
# `attn.wq_a` to the module `self_attn.q_a_proj`, …): what a PEFT adapter names
MODULES = {".attn.wq_a.weight": ".self_attn.q_a_proj", ".attn.wq_b.weight": ".self_attn.q_b_proj",
           ".attn.wkv.weight": ".self_attn.kv_proj", ".attn.wo_b.weight": ".self_attn.o_b_proj"}


def module_name(hf: str) -> str:
    """The module a stored tensor belongs to in DeepseekV4ForCausalLM (the adapted projections'; others
    as stored)."""
    for stored, module in MODULES.items():
        if hf.endswith(stored):
            return hf[:-len(stored)] + module
    return hf[:-len(".weight")]


def peft_targets(cfg) -> str:
    """adapter_config.json's target_modules: the attention's own projections, not the compressors' and
    the indexer's modules of the same names (`self_attn.compressor.kv_proj`, `…indexer.q_b_proj`)."""
    return rf"model\.layers\.\d+\.self_attn\.(?:{'|'.join(sorted(cfg.lora_targets))})"


def import_maps(cfg, names: set[str]) -> list[TensorMap]:
    """transformers' names, or DeepSeek's release (it has `embed.weight` where transformers saves
    `model.embed_tokens.weight`)."""
    maps = tensor_maps(cfg)
    if "embed.weight" in names and "model.embed_tokens.weight" not in names:
        maps = [dataclasses.replace(t, hf=released(t.hf)) for t in maps]
    return maps


def skipped(cfg, names: set[str]) -> set[str]:
    """The release's multi-token-prediction layers (`mtp.*`; transformers' class has none): left out, said."""
    return hf_llama.left_out(names, (MTP,), "the multi-token-prediction layers", "DeepseekV4ForCausalLM has none")


ignore = hf_llama.ignore


def _compress_rope(cfg) -> dict:
    """config.json's `rope_parameters.compress`: the compressed layers' base, with YaRN at attention
    factor 1 (DeepseekV4Config's) where the recipe scales it."""
    rope = {"rope_type": "default"}
    if cfg.rope_scaling_factor > 0:
        rope = {"rope_type": "yarn", "factor": cfg.rope_scaling_factor,
                "original_max_position_embeddings": cfg.rope_original_max_position,
                "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow,
                **({} if cfg.rope_truncate else {"truncate": False})}
    rope.update(rope_theta=float(cfg.compress_rope_max_timescale),
                partial_rotary_factor=cfg.qk_rope_head_dim / cfg.head_dim)
    return {**rope, "attention_factor": 1.0} if cfg.rope_scaling_factor > 0 else rope


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    check_supported(cfg)
    common = hf_llama.common_config(cfg, ARCHITECTURE, FAMILY.hf_model_types[0], dtype, bos_id, eos_id)
    for other in ("rope_scaling", "intermediate_size", "partial_rotary_factor"):
        common.pop(other, None)
    L = cfg.base_num_decoder_layers
    partial = cfg.qk_rope_head_dim / cfg.head_dim
    return {**common, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "moe_intermediate_size": cfg.base_moe_mlp_dim, "q_lora_rank": cfg.q_lora_rank,
            "num_experts_per_tok": cfg.num_experts_per_tok, "n_routed_experts": cfg.num_experts,
            "n_shared_experts": cfg.shared_experts, "scoring_func": cfg.routed_score_func,
            "norm_topk_prob": True, "routed_scaling_factor": cfg.routed_scaling_factor,
            "rope_theta": float(cfg.rope_max_timescale), "compress_rope_theta": float(cfg.compress_rope_max_timescale),
            "partial_rotary_factor": partial,
            "rope_parameters": {"main": {"rope_type": "default", "rope_theta": float(cfg.rope_max_timescale),
                                         "partial_rotary_factor": partial},
                                "compress": _compress_rope(cfg)},
            "layer_types": hf_layer_types(cfg),
            "mlp_layer_types": ["hash_moe" if i < cfg.num_hash_layers else "moe" for i in range(L)],
            "compress_rates": {"compressed_sparse_attention": cfg.compress_rate_csa,
                               "heavily_compressed_attention": cfg.compress_rate_hca},
            "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
            "swiglu_limit": cfg.mlp_activations_limit, "sliding_window": cfg.sliding_window,
            "o_groups": cfg.o_groups, "o_lora_rank": cfg.o_lora_rank, "index_n_heads": cfg.index_n_heads,
            "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk, "num_nextn_predict_layers": 0}


def config_overrides(hf: dict) -> dict:
    if hf.get("model_type") not in FAMILY.hf_model_types:
        raise ValueError(f"config.json model_type={hf.get('model_type')!r} is not deepseek_v4")
    hf_llama.check_mlp(hf, "silu")
    L = hf["num_hidden_layers"]
    head_dim = hf.get("head_dim") or 512
    partial = hf.get("partial_rotary_factor") or 64 / 512
    types = hf.get("layer_types") or default_layer_types(L)
    mlp_types = hf.get("mlp_layer_types") or ["hash_moe"] * min(L, 3) + ["moe"] * max(0, L - 3)
    hashed = sum(1 for t in mlp_types if t == "hash_moe")
    if mlp_types != ["hash_moe"] * hashed + ["moe"] * (L - hashed):
        raise ValueError(f"config.json: mlp_layer_types {mlp_types}: maxlite's DeepSeek-V4 has its hash-routed layers "
                         f"first, then top-k routed ones")
    rope = hf.get("rope_parameters") or {}
    compress = rope.get("compress") if isinstance(rope.get("compress"), dict) else {}
    rates = hf.get("compress_rates") or {}
    scaled = hf_llama.rope_keys(compress, hf.get("compress_rope_theta", 160000.0), hf) if compress else {}
    if scaled:
        scaled.pop("partial_rotary_factor", None)
        scaled["compress_rope_max_timescale"] = int(scaled.pop("rope_max_timescale"))
        scaled.pop("rope_attention_factor", None)  # V4's compressed RoPE is unscaled in magnitude (factor 1)
    main = rope.get("main") if isinstance(rope.get("main"), dict) else {}
    score = hf.get("scoring_func", "sqrtsoftplus")
    if score not in ("sqrtsoftplus", "sigmoid"):
        raise ValueError(f"config.json: scoring_func={score!r}: maxlite's DeepSeek-V4 routes by sqrtsoftplus or sigmoid")
    return {"decoder_block": FAMILY.name, "base_emb_dim": hf["hidden_size"], "base_num_decoder_layers": L,
            "base_num_query_heads": hf["num_attention_heads"], "base_num_kv_heads": 1, "head_dim": head_dim,
            "qk_rope_head_dim": int(head_dim * partial), "q_lora_rank": hf["q_lora_rank"],
            "base_mlp_dim": hf["moe_intermediate_size"], "vocab_size": hf["vocab_size"],
            "max_position_embeddings": hf.get("max_position_embeddings", 1048576),
            "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
            "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
            "rope_max_timescale": int(main.get("rope_theta", hf.get("rope_theta", 10000))),
            "compress_rope_max_timescale": int(hf.get("compress_rope_theta", 160000)),
            "rope_scaling_factor": 0.0, **scaled,
            "layer_types": list(types), "sliding_window": hf.get("sliding_window", 128),
            "compress_rate_csa": rates.get("compressed_sparse_attention", 4),
            "compress_rate_hca": rates.get("heavily_compressed_attention", 128),
            "index_n_heads": hf["index_n_heads"], "index_head_dim": hf["index_head_dim"], "index_topk": hf["index_topk"],
            "o_groups": hf["o_groups"], "o_lora_rank": hf["o_lora_rank"],
            "hc_mult": hf["hc_mult"], "hc_sinkhorn_iters": hf["hc_sinkhorn_iters"], "hc_eps": float(hf["hc_eps"]),
            "num_experts": hf["n_routed_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
            "base_moe_mlp_dim": hf["moe_intermediate_size"], "shared_experts": hf.get("n_shared_experts") or 0,
            "first_num_dense_layers": 0, "interleave_moe_layer_step": 1, "num_hash_layers": hashed,
            "routed_score_func": score, "routed_bias": True, "norm_topk_prob": True,
            "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
            "mlp_activations_limit": float(hf.get("swiglu_limit") or 0.0), "load_balance_loss_weight": 0.0,
            "mtp_num_layers": 0}
