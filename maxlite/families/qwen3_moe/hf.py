"""maxlite qwen3_moe params ↔ Hugging Face `Qwen3MoeForCausalLM`: Mixtral's adapter
(maxlite/families/mixtral/hf.py) maps both mixtures, by decoder_block (Qwen3-MoE's expert names, q/k
norms, dense layers)."""

from __future__ import annotations

from maxlite.families.mixtral.hf import (  # noqa: F401 (this family's adapter interface)
    check_supported, config_overrides, hf_config, ignore, import_maps, tensor_maps)
