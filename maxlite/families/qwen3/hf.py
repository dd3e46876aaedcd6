"""maxlite qwen3 params ↔ Hugging Face `Qwen3ForCausalLM`: Qwen2's adapter (maxlite/families/qwen2/hf.py)
maps both Qwen generations, by decoder_block (Qwen3 adds q/k norms and may have q/k/v/o biases)."""

from __future__ import annotations

from maxlite.families.qwen2.hf import (  # noqa: F401 (this family's adapter interface)
    check_supported, config_overrides, hf_config, ignore, import_maps, tensor_maps)
