"""DeepSeek-V3.2 (`model_type: deepseek_v32`): DeepseekV32ForCausalLM both ways.

DeepSeek-V3's tensors and config (maxlite/families/deepseek/hf.py: its latent attention with the
interleaved RoPE rows permuted, its experts and routing), and in every layer the sparse attention's
indexer (maxlite/models/dsa.py; torch nn.Linear [out, in] ↔ maxlite [in, out]):
  self_attn.indexer.wq_b [I·J, Q]         ↔ attn.index_q [Q, I, J]
  self_attn.indexer.wk [J, D]             ↔ attn.index_k [D, J]
  self_attn.indexer.k_norm.{weight, bias} ↔ attn.index_norm.{scale, bias} (a LayerNorm)
  self_attn.indexer.weights_proj [I, D]   ↔ attn.index_w [D, I]
The indexer rotates split halves (transformers' `apply_rotary_pos_emb`), as maxlite does: its rows
are not permuted. config.json's index_topk, index_n_heads and index_head_dim are the keys of the same
names; its `layer_types` (every layer `indexed_attention`) is the family's pattern. A published
checkpoint's multi-token-prediction layer is left out (transformers' class has none), said in one line.
"""

from __future__ import annotations

import dataclasses

from maxlite.bridge import hf_llama
from maxlite.bridge.hf_convert import TensorMap, linear, same
from maxlite.families.deepseek import hf as deepseek
from maxlite.families.deepseek_v32 import FAMILY

ARCHITECTURE = "DeepseekV32ForCausalLM"
INDEX_KEYS = ("index_topk", "index_n_heads", "index_head_dim")


def _as_v3(cfg):
    """The same model as DeepSeek-V3's adapter sees it (its checks and maps, one place)."""
    return dataclasses.replace(cfg, decoder_block=deepseek.FAMILY.name)


def check_supported(cfg) -> None:
    if cfg.decoder_block != FAMILY.name:
        raise ValueError(f"decoder_block={cfg.decoder_block} is not deepseek_v32")
    deepseek.check_supported(_as_v3(cfg))
    if cfg.routed_score_func != "sigmoid":
        raise ValueError("DeepSeek-V3.2 routes by sigmoid with a choice bias (V3's): set routed_score_func=sigmoid")
    if cfg.mtp_num_layers:
        raise ValueError("DeepseekV32ForCausalLM holds no multi-token-prediction layers: set mtp_num_layers=0")


def indexer_maps(cfg, prefix: str = "model.layers.{i}.self_attn.indexer.") -> list[TensorMap]:
    D, Q, I, J = cfg.base_emb_dim, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim
    return [linear(prefix + "wq_b.weight", ("attn", "index_q"), (Q,), (I, J)),
            linear(prefix + "wk.weight", ("attn", "index_k"), (D,), (J,)),
            same(prefix + "k_norm.weight", ("attn", "index_norm", "scale"), (J,)),
            same(prefix + "k_norm.bias", ("attn", "index_norm", "bias"), (J,)),
            linear(prefix + "weights_proj.weight", ("attn", "index_w"), (D,), (I,))]


def tensor_maps(cfg) -> list[TensorMap]:
    check_supported(cfg)
    return deepseek.tensor_maps(_as_v3(cfg)) + indexer_maps(cfg)


def import_maps(cfg, names: set[str]) -> list[TensorMap]:
    return tensor_maps(cfg)


def ignore(name: str) -> bool:
    return deepseek.ignore(name)


def skipped(cfg, names: set[str]) -> set[str]:
    """The published checkpoint's multi-token-prediction layer (layer num_hidden_layers, which
    DeepseekV32ForCausalLM does not hold either): left out, said in one line."""
    return hf_llama.layers_past_the_last(cfg, names, "DeepSeek-V3.2's multi-token-prediction layer")


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    check_supported(cfg)
    out = deepseek.hf_config(_as_v3(cfg), dtype, bos_id, eos_id)
    for v3_only in ("rope_interleave", "num_nextn_predict_layers"):  # V3.2 always interleaves; has no MTP
        out.pop(v3_only, None)
    return {**out, "architectures": [ARCHITECTURE], "model_type": FAMILY.hf_model_types[0],
            **{key: getattr(cfg, key) for key in INDEX_KEYS},
            "layer_types": ["indexed_attention"] * cfg.base_num_decoder_layers}


def config_overrides(hf: dict) -> dict:
    if hf.get("model_type") not in FAMILY.hf_model_types:
        raise ValueError(f"config.json model_type={hf.get('model_type')!r} is not deepseek_v32")
    types = hf.get("layer_types") or ["indexed_attention"] * hf["num_hidden_layers"]
    if set(types) != {"indexed_attention"}:
        raise ValueError(f"config.json: layer_types {sorted(set(types))}: maxlite's DeepSeek-V3.2 has sparse "
                         f"attention (indexed_attention) in every layer")
    if not hf.get("q_lora_rank"):
        raise ValueError("config.json: q_lora_rank is 0: the indexer reads the query latent (DeepSeek-V3.2 has one)")
    as_v3 = {k: v for k, v in hf.items() if k not in (*INDEX_KEYS, "layer_types")}
    out = deepseek.config_overrides({**as_v3, "model_type": "deepseek_v3", "rope_interleave": True})
    return {**out, "decoder_block": FAMILY.name, **{key: int(hf[key]) for key in INDEX_KEYS}}
