"""GLM-5 (`model_type: glm_moe_dsa`): GlmMoeDsaForCausalLM both ways.

DeepSeek-V3.2's tensors and config (maxlite/families/deepseek_v32/hf.py, through DeepSeek-V3's), with
one difference: GLM-5's indexer rotates interleaved pairs of its first qk_rope_head_dim dims
(transformers' `apply_rotary_pos_emb_interleave`), where maxlite's (and DeepSeek-V3.2's) rotates split
halves. A score is a dot product of an indexer query and key, which does not see one permutation
applied to both: the rotated dims of each head of `wq_b`, of `wk` and of the key's LayerNorm (its
scale and bias; the norm's mean and variance do not see the order) are permuted once at import (evens
first, then odds) and back at export, as DeepSeek's latent attention rows are. config.json's
`indexer_types` must be all "full" (every layer its own indexer, GLM-5's own pattern); "shared" layers
(the previous full layer's top-k reused) are refused in one line. A published checkpoint's
multi-token-prediction layer is left out, said in one line.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from maxlite.bridge import hf_llama
from maxlite.bridge.hf_convert import TensorMap
from maxlite.families.deepseek import hf as deepseek
from maxlite.families.deepseek_v32 import hf as v32
from maxlite.families.glm_moe_dsa import FAMILY

ARCHITECTURE = "GlmMoeDsaForCausalLM"


def _as_v32(cfg):
    """The same model as DeepSeek-V3.2's adapter sees it (its checks and maps, one place)."""
    return dataclasses.replace(cfg, decoder_block=v32.FAMILY.name)


def check_supported(cfg) -> None:
    if cfg.decoder_block != FAMILY.name:
        raise ValueError(f"decoder_block={cfg.decoder_block} is not glm_moe_dsa")
    v32.check_supported(_as_v32(cfg))


def _rope_first(w: np.ndarray, R: int, inverse: bool) -> np.ndarray:
    """w with its last axis' first R entries permuted (interleaved pairs → split halves, or back)."""
    perm = np.concatenate([np.arange(0, R, 2), np.arange(1, R, 2)])
    out = np.array(w)
    if inverse:
        out[..., perm] = w[..., :R]
    else:
        out[..., :R] = w[..., :R][..., perm]
    return out


def _interleaved(t: TensorMap, R: int) -> TensorMap:
    return dataclasses.replace(t, to_hf=lambda *leaves: t.to_hf(*(_rope_first(w, R, True) for w in leaves)),
                               from_hf=lambda x: tuple(_rope_first(w, R, False) for w in t.from_hf(x)))


def indexer_maps(cfg) -> list[TensorMap]:
    """DeepSeek-V3.2's indexer tensors, the rotated dims of its queries, key and key norm permuted."""
    R = cfg.qk_rope_head_dim
    return [t if t.paths[0][-1] == "index_w" else _interleaved(t, R) for t in v32.indexer_maps(cfg)]


def tensor_maps(cfg) -> list[TensorMap]:
    check_supported(cfg)
    return deepseek.tensor_maps(v32._as_v3(cfg)) + indexer_maps(cfg)


def import_maps(cfg, names: set[str]) -> list[TensorMap]:
    return tensor_maps(cfg)


def ignore(name: str) -> bool:
    return deepseek.ignore(name)


def skipped(cfg, names: set[str]) -> set[str]:
    """The published checkpoint's multi-token-prediction layer (layer num_hidden_layers, which
    GlmMoeDsaForCausalLM does not hold either): left out, said in one line."""
    return hf_llama.layers_past_the_last(cfg, names, "GLM-5's multi-token-prediction layer")


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    check_supported(cfg)
    out = v32.hf_config(_as_v32(cfg), dtype, bos_id, eos_id)
    return {**out, "architectures": [ARCHITECTURE], "model_type": FAMILY.hf_model_types[0],
            "indexer_types": ["full"] * cfg.base_num_decoder_layers}


def config_overrides(hf: dict) -> dict:
    if hf.get("model_type") not in FAMILY.hf_model_types:
        raise ValueError(f"config.json model_type={hf.get('model_type')!r} is not glm_moe_dsa")
    types = hf.get("indexer_types") or ["full"] * hf["num_hidden_layers"]
    if set(types) != {"full"}:
        shared = [i for i, t in enumerate(types) if t != "full"]
        raise ValueError(f"config.json: indexer_types has layers {shared} reusing an earlier layer's top-k "
                         f"(\"shared\"): maxlite's GLM-5 runs its own indexer in every layer (\"full\")")
    as_v32 = {k: v for k, v in hf.items() if k != "indexer_types"}
    return {**v32.config_overrides({**as_v32, "model_type": v32.FAMILY.hf_model_types[0]}),
            "decoder_block": FAMILY.name}
