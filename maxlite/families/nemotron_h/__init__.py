"""Nemotron-H (NVIDIA, `model_type: nemotron_h`, NemotronHForCausalLM): a hybrid of Mamba-2 layers,
a few attention layers without positions, and squared-ReLU MLPs, each a block of its own
(`layers_block_type`): a layer is a mixer with no feed-forward, or an MLP with no mixer (the `none`
kinds, maxlite/models/no_branch.py), each behind one RMSNorm.

The family's data; its Hugging Face adapter is hf.py beside it.
"""

from __future__ import annotations

from maxlite.families import Family

FAMILY = Family(
    "nemotron_h", "Nemotron-H: Mamba-2, attention (no positions) and squared-ReLU MLP layers, each its own block",
    norm="rmsnorm", mlp="relu2", positions="none", biases="attention", hf_module=__name__ + ".hf",
    nemo_factory="llama3_8b", hf_model_types=("nemotron_h",), layer_pattern=("mamba",),
    layer_kinds=__name__ + ".blocks:layer_kinds")
