"""gpt-oss (OpenAI, `model_type: gpt_oss`): GptOssForCausalLM both ways.

The family's data; its Hugging Face adapter is hf.py beside it.
"""

from __future__ import annotations

from maxlite.families import Family

FAMILY = Family(
    "gpt_oss", "gpt-oss: attention sinks, q/k/v/o biases, sliding-window and global layers in turn, YaRN, "
    "experts with biases and a clamped SwiGLU, a biased router",
    norm="rmsnorm", mlp="clamped_swiglu", positions="rope", biases="attention", hf_module=__name__ + ".hf",
    nemo_factory="gpt_oss_20b", hf_model_types=("gpt_oss",), llama_names=True, layer_pattern=("local", "global"),
    moe=True)
