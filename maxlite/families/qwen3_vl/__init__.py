"""Qwen3-VL, dense (`model_type: qwen3_vl`, Qwen3VLForConditionalGeneration): Qwen3's decoder with
multimodal RoPE (each token turned by its time, height and width positions, interleaved:
`mrope_sections`) and the qwen_vit vision encoder (maxlite/models/vision/qwen_vit.py) whose merged
patches take the places of `<|image_pad|>` and whose DeepStack features join the first layers.

The family's data; its Hugging Face adapter is hf.py beside it.
"""

from __future__ import annotations

from maxlite.families import Family

FAMILY = Family(
    "qwen3_vl", "Qwen3-VL (dense): Qwen3's decoder with interleaved multimodal RoPE, a ViT at the image's own "
    "resolution, a 2×2 patch merger and DeepStack",
    norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention", hf_module=__name__ + ".hf",
    nemo_factory="qwen3_8b", llama_names=True, hf_model_types=("qwen3_vl",), qk_norm=True)
