"""DeepSeek-V2/V3 (`model_type: deepseek_v2`, `deepseek_v3`; also Kimi K2 and Moonlight, which are
DeepSeek-V3's architecture): DeepseekV2ForCausalLM / DeepseekV3ForCausalLM both ways.

The layer: pre-RMSNorms, multi-head latent attention (`attention_type: mla`, maxlite/models/mla.py),
a SwiGLU MLP in the first `first_k_dense_replace` layers and DeepSeekMoE after them (routed experts
+ `n_shared_experts` shared ones as one MLP; maxlite/models/moe.py). V2 routes by softmax (greedy,
or group-limited by each group's best score), its top-k weights unnormalised; V3 by sigmoid with a
per-expert bias for the choice only (`e_score_correction_bias` ↔ routed_bias), in groups scored by
their two best, normalised; both multiply the weights by `routed_scaling_factor`.

Tensors (torch nn.Linear [out, in] ↔ maxlite [in, out], as elsewhere):
  self_attn.q_proj [N·(P+R), D]                     ↔ attn.q [D, N, P+R]        (q_lora_rank = 0)
  self_attn.q_a_proj [Q, D], q_a_layernorm [Q], q_b_proj [N·(P+R), Q] ↔ attn.q_a, q_norm, q_b
  self_attn.kv_a_proj_with_mqa [C+R, D]             ↔ attn.kv_a [D, C+R]
  self_attn.kv_a_layernorm [C]                      ↔ attn.kv_norm
  self_attn.kv_b_proj [N·(P+V), C]                  ↔ attn.kv_b [C, N, P+V]
  self_attn.o_proj [D, N·V]                         ↔ attn.o [N, V, D]
  mlp.gate.weight [E, D] (+ e_score_correction_bias [E]) ↔ mlp.router [D, E] (+ router_bias)
  mlp.experts.{j}.{gate,up,down}_proj, mlp.shared_experts.{gate,up,down}_proj ↔ mlp.gate/up/down[j],
  mlp.shared.gate/up/down; dense layers Llama's mlp.{gate,up,down}_proj.
RoPE: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), … (V2 always, V3 with rope_interleave);
maxlite rotates split halves. A dot product does not see a permutation applied to both of its
sides, so the RoPE rows of the query and of the shared key (the last R of each query head, the last
R of kv_a) are permuted once at import (evens first, then odds) and back at export.

Published DeepSeek-V3 checkpoints store FP8 weights with one float32 scale per 128 × 128 block
(`weight_scale_inv`): an import dequantizes them (maxlite/families/deepseek_fp8.py). Their
multi-token-prediction layer is stored as layer num_hidden_layers (`num_nextn_predict_layers`).
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

from maxlite.bridge import hf_llama
from maxlite.bridge.hf_convert import TensorMap, linear, of_expert, same
from maxlite.families.deepseek import FAMILY


ARCHITECTURES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def _version(cfg) -> str:
    """V3's routing (sigmoid, bias) exports as DeepseekV3ForCausalLM, V2's (softmax) as V2."""
    return "deepseek_v3" if cfg.routed_score_func == "sigmoid" else "deepseek_v2"


def check_supported(cfg) -> None:
    if cfg.decoder_block != FAMILY.name:
        raise ValueError(f"decoder_block={cfg.decoder_block} is not deepseek")
    if cfg.attention_type != "mla":
        raise ValueError("DeepSeek-V2/V3 attend with multi-head latent attention: set attention_type=mla")
    if cfg.use_bias or cfg.sliding_window or cfg.layer_types or cfg.local_rope_max_timescale:
        raise ValueError("DeepSeek-V2/V3 have no attention biases, sliding windows or per-layer RoPE: set "
                         "use_bias=false, sliding_window=0, layer_types=[]")
    if cfg.mtp_num_layers and _version(cfg) == "deepseek_v2":
        raise ValueError("DeepSeek-V2 checkpoints have no multi-token-prediction layers: set mtp_num_layers=0 to "
                         "export (or export V3's routing: routed_score_func=sigmoid)")
    if cfg.interleave_moe_layer_step != 1 or not cfg.shared_experts:
        raise ValueError("DeepSeek-V2/V3 have MoE in every layer after the first dense ones and shared experts: set "
                         "interleave_moe_layer_step=1 and shared_experts > 0")
    if _version(cfg) == "deepseek_v2" and (cfg.routed_bias or cfg.norm_topk_prob):
        raise ValueError("DeepSeek-V2 (softmax routing) has no routed_bias and does not renormalise its top-k "
                         "weights: set routed_bias=false, norm_topk_prob=false (or routed_score_func=sigmoid: V3)")
    if _version(cfg) == "deepseek_v3" and (not cfg.routed_bias or not cfg.norm_topk_prob):
        raise ValueError("DeepSeek-V3 (sigmoid routing) has the routed_bias and renormalised top-k weights: set "
                         "routed_bias=true, norm_topk_prob=true")


# ---- the RoPE permutation: DeepSeek's interleaved pairs ↔ maxlite's split halves ----

def _perm(R: int) -> np.ndarray:
    return np.concatenate([np.arange(0, R, 2), np.arange(1, R, 2)])


def _rope_last(w: np.ndarray, R: int, inverse: bool) -> np.ndarray:
    """w with its last axis' final R entries permuted (interleaved → halves, or back)."""
    perm = _perm(R)
    out = np.array(w)
    tail = w[..., -R:]
    if inverse:
        out[..., -R:][..., perm] = tail
    else:
        out[..., -R:] = tail[..., perm]
    return out


def _rope_linear(hf: str, path: tuple, in_shape: tuple, out_shape: tuple, R: int, interleaved: bool) -> TensorMap:
    """A kernel [*in, *out] whose output's last R entries (of each head) are RoPE dims."""
    t = linear(hf, path, in_shape, out_shape)
    if not interleaved:
        return t
    return dataclasses.replace(t, to_hf=lambda w: t.to_hf(_rope_last(w, R, inverse=True)),
                               from_hf=lambda x: (_rope_last(t.from_hf(x)[0], R, inverse=False),))


def attention_maps(cfg, interleaved: bool, prefix: str = "model.layers.{i}.self_attn.") -> list[TensorMap]:
    D, N = cfg.base_emb_dim, cfg.base_num_query_heads
    Q, C, P, R, V = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    a = prefix
    if Q:
        maps = [linear(a + "q_a_proj.weight", ("attn", "q_a"), (D,), (Q,)),
                same(a + "q_a_layernorm.weight", ("attn", "q_norm", "scale"), (Q,)),
                _rope_linear(a + "q_b_proj.weight", ("attn", "q_b"), (Q,), (N, P + R), R, interleaved)]
    else:
        maps = [_rope_linear(a + "q_proj.weight", ("attn", "q"), (D,), (N, P + R), R, interleaved)]
    return maps + [
        _rope_linear(a + "kv_a_proj_with_mqa.weight", ("attn", "kv_a"), (D,), (C + R,), R, interleaved),
        same(a + "kv_a_layernorm.weight", ("attn", "kv_norm", "scale"), (C,)),
        linear(a + "kv_b_proj.weight", ("attn", "kv_b"), (C,), (N, P + V)),
        linear(a + "o_proj.weight", ("attn", "o"), (N, V), (D,))]


def skeleton_maps(cfg, interleaved: bool) -> tuple[list[TensorMap], list[TensorMap]]:
    """(embedding, final norm, head, the layer norms and latent attention; the dense MLP): the names
    DeepSeek's checkpoints and Mistral 4's share; each adds its own experts."""
    D, V, F = cfg.base_emb_dim, cfg.vocab_size, cfg.base_mlp_dim
    layer = "model.layers.{i}."
    m = layer + "mlp."
    maps = [same("model.embed_tokens.weight", ("embedding",), (V, D), layer=False),
            same("model.norm.weight", ("final_norm", "scale"), (D,), layer=False)]
    if not cfg.logits_via_embedding:
        maps.append(linear("lm_head.weight", ("unembedding",), (D,), (V,), layer=False))
    maps += [same(layer + "input_layernorm.weight", ("attn_norm", "scale"), (D,)),
             same(layer + "post_attention_layernorm.weight", ("mlp_norm", "scale"), (D,)),
             *attention_maps(cfg, interleaved)]
    dense = [linear(m + "gate_proj.weight", ("mlp", "gate"), (D,), (F,)),
             linear(m + "up_proj.weight", ("mlp", "up"), (D,), (F,)),
             linear(m + "down_proj.weight", ("mlp", "down"), (F,), (D,))]
    return maps, dense


def tensor_maps(cfg, interleaved: bool = True) -> list[TensorMap]:
    check_supported(cfg)
    D, E, Fm = cfg.base_emb_dim, cfg.num_experts, cfg.base_moe_mlp_dim
    Fs = cfg.shared_experts * Fm
    m = "model.layers.{i}.mlp."
    maps, dense = skeleton_maps(cfg, interleaved)
    moe = [linear(m + "gate.weight", ("mlp", "router"), (D,), (E,)),
           linear(m + "shared_experts.gate_proj.weight", ("mlp", "shared", "gate"), (D,), (Fs,)),
           linear(m + "shared_experts.up_proj.weight", ("mlp", "shared", "up"), (D,), (Fs,)),
           linear(m + "shared_experts.down_proj.weight", ("mlp", "shared", "down"), (Fs,), (D,))]
    if cfg.routed_bias:
        moe.append(same(m + "gate.e_score_correction_bias", ("mlp", "router_bias"), (E,)))
    one_expert = [linear(m + "experts.{j}.gate_proj.weight", ("mlp", "gate"), (D,), (Fm,)),
                  linear(m + "experts.{j}.up_proj.weight", ("mlp", "up"), (D,), (Fm,)),
                  linear(m + "experts.{j}.down_proj.weight", ("mlp", "down"), (Fm,), (D,))]
    maps = (maps + [dataclasses.replace(t, mlp="dense") for t in dense]
            + [dataclasses.replace(t, mlp="moe") for t in moe]
            + [of_expert(t, j) for j in range(E) for t in one_expert])
    return maps + [t for k in range(cfg.mtp_num_layers) for t in mtp_maps(cfg, maps, k)]


def mtp_maps(cfg, maps: list[TensorMap], k: int) -> list[TensorMap]:
    """Multi-token-prediction depth k, stored as DeepSeek-V3 stores it: layer num_hidden_layers + k,
    a decoder layer of the last layer's kinds beside enorm, hnorm, eh_proj [D, 2D] (its input
    [embedding; hidden]) and shared_head.norm, with copies of the embedding and the output head
    (written on export; on import the copy writes the same values over the shared ones)."""
    D, V = cfg.base_emb_dim, cfg.vocab_size
    j = cfg.base_num_decoder_layers + k
    prefix, here = f"model.layers.{j}.", ("mtp", k)
    last = "moe" if cfg.num_experts and cfg.base_num_decoder_layers > cfg.first_num_dense_layers else "dense"
    block = [dataclasses.replace(t, hf=t.hf.format(i=j), paths=tuple((*here, "block", *p) for p in t.paths),
                                 layer=False, mlp=None)
             for t in maps if t.layer and t.mlp in (None, last)]
    return block + [
        same(prefix + "enorm.weight", (*here, "enorm", "scale"), (D,), layer=False),
        same(prefix + "hnorm.weight", (*here, "hnorm", "scale"), (D,), layer=False),
        linear(prefix + "eh_proj.weight", (*here, "eh_proj"), (2 * D,), (D,), layer=False),
        same(prefix + "shared_head.norm.weight", (*here, "norm", "scale"), (D,), layer=False),
        same(prefix + "embed_tokens.weight", ("embedding",), (V, D), layer=False),
        linear(prefix + "shared_head.head.weight", ("unembedding",), (D,), (V,), layer=False)]


def tensor_overrides(hf: dict, names: set[str]) -> dict:
    """What the tensors say beside config.json: the multi-token-prediction layers a checkpoint holds
    (DeepSeek's publish them; transformers saves none, though its config keeps the count)."""
    L, n = hf["num_hidden_layers"], hf.get("num_nextn_predict_layers") or 0
    held = sum(f"model.layers.{L + k}.eh_proj.weight" in names for k in range(n))
    if held < n:
        print(f"maxlite: config.json states num_nextn_predict_layers={n} but the checkpoint holds {held} of those "
              f"layers: imported with mtp_num_layers={held}", file=sys.stderr)
    return {"mtp_num_layers": held} if n else {}


def import_maps(cfg, names: set[str]) -> list[TensorMap]:
    return tensor_maps(cfg)


def ignore(name: str) -> bool:
    return hf_llama.ignore(name)


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    check_supported(cfg)
    version = _version(cfg)
    common = hf_llama.common_config(cfg, ARCHITECTURES[version], version, dtype, bos_id, eos_id)
    for gqa_only in ("head_dim", "rope_scaling"):
        common.pop(gqa_only)
    groups = cfg.n_routing_groups if cfg.n_routing_groups > 0 else 1
    out = {**common, "hidden_act": "silu", "attention_bias": False,
           "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
           "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
           "v_head_dim": cfg.v_head_dim, "n_routed_experts": cfg.num_experts,
           "num_experts_per_tok": cfg.num_experts_per_tok, "moe_intermediate_size": cfg.base_moe_mlp_dim,
           "n_shared_experts": cfg.shared_experts, "first_k_dense_replace": cfg.first_num_dense_layers,
           "norm_topk_prob": bool(cfg.norm_topk_prob), "routed_scaling_factor": cfg.routed_scaling_factor,
           "n_group": groups, "topk_group": cfg.topk_routing_group if cfg.n_routing_groups > 0 else 1}
    if version == "deepseek_v3":
        return {**out, "rope_interleave": True, "num_nextn_predict_layers": cfg.mtp_num_layers}
    return {**out, "mlp_bias": False, "moe_layer_freq": 1,
            "topk_method": "group_limited_greedy" if cfg.n_routing_groups > 0 else "greedy"}


def _refuse_unmodelled(hf: dict) -> None:
    if hf.get("index_topk") or hf.get("index_n_heads"):
        raise ValueError(f"config.json: index_topk and index_n_heads are DeepSeek-V3.2's sparse-attention indexer, "
                         f"which model_type deepseek_v32 has (maxlite/families/deepseek_v32), not {hf.get('model_type')}")
    if hf.get("model_type") != "deepseek_v2" and hf.get("rope_interleave") is False:
        raise ValueError("config.json: rope_interleave=false (RoPE on split halves) is not modelled by maxlite's "
                         "DeepSeek import, which converts the interleaved layout DeepSeek publishes")
    if hf.get("attention_bias"):
        raise ValueError("config.json: attention_bias=true is not DeepSeek's MLA (maxlite has no MLA biases)")
    if (hf.get("moe_layer_freq") or 1) != 1:
        raise ValueError(f"config.json: moe_layer_freq={hf['moe_layer_freq']}: maxlite's DeepSeek has MoE in "
                         f"every layer after first_k_dense_replace")
    if hf.get("topk_method", "greedy") not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"config.json: topk_method={hf['topk_method']!r} is not modelled by maxlite")


def config_overrides(hf: dict) -> dict:
    model_type = hf.get("model_type")
    if model_type not in FAMILY.hf_model_types:
        raise ValueError(f"config.json model_type={model_type!r} is not deepseek_v2 or deepseek_v3")
    hf_llama.check_mlp(hf, "silu")
    _refuse_unmodelled(hf)
    v3 = model_type != "deepseek_v2"
    N = hf["num_attention_heads"]
    groups, topk_groups = hf.get("n_group") or 1, hf.get("topk_group") or 1
    if not v3 and hf.get("topk_method", "greedy") == "greedy":
        groups = topk_groups = 1
    out = {**hf_llama.common_overrides(hf, FAMILY.name), "attention_type": "mla", "use_bias": False,
           "base_num_kv_heads": N, "head_dim": hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
           "q_lora_rank": hf.get("q_lora_rank") or 0, "kv_lora_rank": hf["kv_lora_rank"],
           "qk_nope_head_dim": hf["qk_nope_head_dim"], "qk_rope_head_dim": hf["qk_rope_head_dim"],
           "v_head_dim": hf["v_head_dim"],
           "num_experts": hf["n_routed_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
           "base_moe_mlp_dim": hf["moe_intermediate_size"], "shared_experts": hf.get("n_shared_experts") or 0,
           "first_num_dense_layers": hf.get("first_k_dense_replace", 0), "interleave_moe_layer_step": 1,
           "norm_topk_prob": bool(hf.get("norm_topk_prob", v3)) if v3 else False,
           "routed_score_func": "sigmoid" if v3 else "softmax", "routed_bias": v3,
           "load_balance_loss_weight": 0.0 if v3 else float(hf.get("aux_loss_alpha", 0.001))}
    out["routed_scaling_factor"] = float(hf.get("routed_scaling_factor", 1.0))
    if groups > 1 and topk_groups < groups:  # group-limited routing (else every group is open)
        out.update(n_routing_groups=groups, topk_routing_group=topk_groups)
    return out

