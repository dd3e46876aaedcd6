"""Gemma 3, text (`model_type: gemma3_text`), and with its SigLIP tower (`model_type: gemma3`,
Gemma3ForConditionalGeneration: vision_encoder siglip, maxlite/models/vision/siglip.py).

The family's data; its Hugging Face adapter is hf.py beside it.
"""

from __future__ import annotations

from maxlite.families import Family

FAMILY = Family(
    "gemma3", "Gemma 3 (text): 5 sliding-window layers to 1 global, (1 + w) RMSNorm before and after "
    "attention and MLP, q/k norms, GeGLU, √d-scaled tied embeddings",
    norm="rmsnorm", mlp="geglu", positions="rope", biases="attention", hf_module=__name__ + ".hf",
    nemo_factory="gemma3_1b", llama_names=True, hf_model_types=("gemma3_text", "gemma3"), norm_offset=1.0,
    qk_norm=True, post_norms=True, embed_scale=True, layer_pattern=("local",) * 5 + ("global",))
