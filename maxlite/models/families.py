"""One entry per model family (`decoder_block`): what differs between them, said once.

The transformer, the layers, the FLOP count, the planner, the torch twin, the HF adapters and the
NeMo/Megatron mapping read these traits instead of testing the family's name. A new family is a
new entry here plus its HF adapter module in maxlite/bridge/.

Pure data: importable without JAX (config validation and the bridge use it).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Family:
    name: str               # the `decoder_block` value
    summary: str
    norm: str               # "rmsnorm" | "layernorm" (pre-norm, before attention and MLP)
    mlp: str                # "swiglu" (gate, up, down) | "gelu" (up, down, with biases)
    positions: str          # "rope" (rotary, in attention) | "learned" (absolute, added to the embedding)
    biases: str             # what use_bias=true adds: "attention" (q/k/v/o) | "all" (every linear and norm)
    hf_module: str          # maxlite.bridge module mapping the weights to and from Hugging Face
    nemo_factory: str       # the closest NeMo 2.0 recipe factory when the preset has none of its own

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices in the MLP (the FLOP count's m)."""
        return 3 if self.mlp == "swiglu" else 2

    @property
    def rope(self) -> bool:
        return self.positions == "rope"


FAMILIES = {f.name: f for f in (
    Family("llama2", "Llama 2/3/3.1/3.2 and Mistral: pre-RMSNorm, RoPE, GQA, SwiGLU",
           norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention", hf_module="maxlite.bridge.hf_llama",
           nemo_factory="llama3_8b"),
    Family("gpt3", "GPT-3 / GPT-2: pre-LayerNorm, learned positions, biases, GELU",
           norm="layernorm", mlp="gelu", positions="learned", biases="all", hf_module="maxlite.bridge.hf_gpt2",
           nemo_factory="gpt3_175b"),
)}


def family(cfg) -> Family:
    """The family of a config (its `decoder_block`; config validation keeps it one of FAMILIES)."""
    return FAMILIES[cfg.decoder_block]
