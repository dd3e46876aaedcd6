"""One entry per model family (`decoder_block`): what differs between them, said once.

The transformer, the layers, the FLOP count, the planner, decoding, the torch twin, the HF adapters
and the NeMo/Megatron mapping read these traits instead of testing the family's name. A new family
is a new entry here plus its HF adapter module in maxlite/bridge/.

Pure data: importable without JAX (config validation and the bridge use it).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Family:
    name: str               # the `decoder_block` value
    summary: str
    norm: str               # "rmsnorm" | "layernorm" (pre-norm, before attention and MLP)
    mlp: str                # "swiglu" (silu(gate)·up, down) | "geglu" (tanh-GELU(gate)·up, down) |
                            # "gelu" (up, down, with biases)
    positions: str          # "rope" (rotary, in attention) | "learned" (absolute, added to the embedding)
    biases: str             # what use_bias=true adds: "attention" (q/k/v/o) | "qkv" (q/k/v, no o) |
                            # "all" (every linear and norm)
    hf_module: str          # maxlite.bridge module mapping the weights to and from Hugging Face
    nemo_factory: str       # the closest NeMo 2.0 recipe factory when the preset has none of its own
    norm_offset: float = 0.0    # RMSNorm multiplies by (offset + scale): Gemma's (1 + w), w stored from 0
    qk_norm: bool = False       # RMSNorm over each head's q and k (head_dim) before RoPE
    post_norms: bool = False    # a norm after attention and after the MLP too, before each residual add
    embed_scale: bool = False   # input embeddings multiplied by √emb_dim
    # the attention kind of layer i is layer_pattern[i % len(layer_pattern)]: "local" layers attend
    # within `sliding_window` (when it is > 0), "global" layers to the whole causal context
    layer_pattern: tuple[str, ...] = ("local",)
    # the MLP is a mixture of experts (maxlite/models/moe.py): `num_experts` routed experts of the
    # family's gated MLP, top `num_experts_per_tok` per token, in the layers `layer_mlps` names
    moe: bool = False

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices in the MLP (the FLOP count's m)."""
        return 2 if self.mlp == "gelu" else 3

    @property
    def gated(self) -> bool:
        """A gated MLP (gate, up, down)."""
        return self.mlp in ("swiglu", "geglu")

    @property
    def rope(self) -> bool:
        return self.positions == "rope"

    @property
    def bias_leaves(self) -> tuple[str, ...]:
        """The attention biases use_bias=true creates."""
        return ("q_bias", "k_bias", "v_bias") if self.biases == "qkv" else (
            "q_bias", "k_bias", "v_bias", "o_bias")


FAMILIES = {f.name: f for f in (
    Family("llama2", "Llama 2/3/3.1/3.2 and Mistral (sliding_window): pre-RMSNorm, RoPE, GQA, SwiGLU",
           norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention", hf_module="maxlite.bridge.hf_llama",
           nemo_factory="llama3_8b"),
    Family("gpt3", "GPT-3 / GPT-2: pre-LayerNorm, learned positions, biases, GELU",
           norm="layernorm", mlp="gelu", positions="learned", biases="all", hf_module="maxlite.bridge.hf_gpt2",
           nemo_factory="gpt3_175b"),
    Family("qwen2", "Qwen2 / Qwen2.5: Llama's block with q/k/v biases (no o bias)",
           norm="rmsnorm", mlp="swiglu", positions="rope", biases="qkv", hf_module="maxlite.bridge.hf_qwen",
           nemo_factory="qwen25_7b"),
    Family("qwen3", "Qwen3 (dense): Llama's block with per-head RMSNorm on q and k before RoPE",
           norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention", hf_module="maxlite.bridge.hf_qwen",
           nemo_factory="qwen3_8b", qk_norm=True),
    Family("mixtral", "Mixtral: Mistral's block (sliding_window optional) with a mixture of SwiGLU experts",
           norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention", hf_module="maxlite.bridge.hf_moe",
           nemo_factory="mixtral_8x7b", moe=True),
    Family("qwen3_moe", "Qwen3-MoE: Qwen3's block (q/k norms) with a mixture of SwiGLU experts",
           norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention", hf_module="maxlite.bridge.hf_moe",
           nemo_factory="qwen3_30b_a3b", qk_norm=True, moe=True),
    Family("gemma3", "Gemma 3 (text): 5 sliding-window layers to 1 global, (1 + w) RMSNorm before and after "
           "attention and MLP, q/k norms, GeGLU, √d-scaled tied embeddings",
           norm="rmsnorm", mlp="geglu", positions="rope", biases="attention", hf_module="maxlite.bridge.hf_gemma3",
           nemo_factory="gemma3_1b", norm_offset=1.0, qk_norm=True, post_norms=True, embed_scale=True,
           layer_pattern=("local",) * 5 + ("global",)),
)}


def family(cfg) -> Family:
    """The family of a config (its `decoder_block`; config validation keeps it one of FAMILIES)."""
    return FAMILIES[cfg.decoder_block]


def layer_windows(cfg) -> tuple[int, ...]:
    """Each layer's sliding window (0: global): the family's pattern with the config's window."""
    pattern = family(cfg).layer_pattern
    return tuple(cfg.sliding_window if pattern[i % len(pattern)] == "local" else 0
                 for i in range(cfg.base_num_decoder_layers))


def layer_mlps(cfg) -> tuple[str, ...]:
    """Each layer's MLP, "dense" or "moe": a MoE family's first `first_num_dense_layers` layers are
    dense, and of the layers after them every `interleave_moe_layer_step`-th is MoE (the others
    dense); a family without experts is dense throughout."""
    L = cfg.base_num_decoder_layers
    if not family(cfg).moe:
        return ("dense",) * L
    first, step = cfg.first_num_dense_layers, cfg.interleave_moe_layer_step
    return tuple("dense" if i < first or (i - first + 1) % step else "moe" for i in range(L))


@dataclasses.dataclass(frozen=True)
class Stack:
    """Layers stored (and scanned) together: `count` units of consecutive layers of kinds `unit`."""
    name: str                   # the parameter tree's key: "layers" or "dense_layers"
    count: int
    unit: tuple[str, ...]       # the MLP of each layer of a unit ("dense" | "moe")
    first: int                  # the index of its first layer


def layer_stacks(cfg) -> tuple[Stack, ...]:
    """How a scanned model stores its layers: the dense layers before the first MoE layer in
    `dense_layers` (a MoE model with first_num_dense_layers > 0), the rest in `layers`: one layer
    per unit, or with interleave_moe_layer_step = s > 1, units of s layers (s - 1 dense, 1 MoE)."""
    mlps, L = layer_mlps(cfg), cfg.base_num_decoder_layers
    first = cfg.first_num_dense_layers if family(cfg).moe else 0
    unit = mlps[first:first + (cfg.interleave_moe_layer_step if family(cfg).moe else 1)]
    stacks = (Stack("dense_layers", first, ("dense",), 0),) if first else ()
    return stacks + (Stack("layers", (L - first) // len(unit), unit, first),)


def layer_place(cfg, i: int) -> tuple[tuple, int | None]:
    """Where layer i's parameters live: (the path of its block in the parameter tree, its index on
    the stacked axis, None when unrolled). `("layers",), 3` is the 4th unit of `layers`; a unit of
    several layers adds ("blocks", position)."""
    if not cfg.scan_layers:
        return ("layers", i), None
    for stack in layer_stacks(cfg):
        j = i - stack.first
        if 0 <= j < stack.count * len(stack.unit):
            size = len(stack.unit)
            return ((stack.name,) if size == 1 else (stack.name, "blocks", j % size)), j // size
    raise IndexError(f"layer {i} of {cfg.base_num_decoder_layers}")
