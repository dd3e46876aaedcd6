"""One package per model family. `NAME/__init__.py` holds its data: `FAMILY`, a `Family` (traits,
layer pattern), and imports nothing of the bridge, so loading a recipe reads every family without
the HF bridge; `NAME/hf.py` holds its Hugging Face adapter (tensor names, config.json keys both
ways, its checks), imported only when a conversion asks (`Family.hf_module`). maxlite.models.families
is the registry; the bridge, the NeMo mapping and PEFT read it. docs/families.md says how to add one.

`Family` is defined here, not beside the registry: the registry imports every family package, and
each family package needs `Family`, so the class sits in the one module both import.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Family:
    name: str               # the `decoder_block` value
    summary: str
    norm: str               # "rmsnorm" | "layernorm" (pre-norm, before attention and MLP)
    mlp: str                # "swiglu" (silu(gate)·up, down) | "geglu" (tanh-GELU(gate)·up, down) |
                            # "gelu" (up, down, with biases) | "clamped_swiglu" (gpt-oss's:
                            # (up + 1)·gate·σ(1.702·gate), clamped at mlp_activations_limit) |
                            # "relu2" (up, relu(·)², down, no biases: Nemotron-H's) | "limited_swiglu"
                            # (DeepSeek-V4's: silu(gate)·up, both clamped at mlp_activations_limit)
    positions: str          # "rope" (rotary, in attention) | "learned" (absolute, added to the embedding) |
                            # "none" (no positions: the recurrent layers order the tokens; Nemotron-H, Kimi Linear)
    biases: str             # what use_bias=true adds: "attention" (q/k/v/o) | "qkv" (q/k/v, no o) |
                            # "all" (every linear and norm)
    hf_module: str          # the module mapping the weights to and from Hugging Face: the family's own
                            # maxlite/families/NAME/hf.py (`__name__ + ".hf"`), imported only by a conversion
    nemo_factory: str       # the closest NeMo 2.0 recipe factory when the preset has none of its own
    hf_model_types: tuple[str, ...] = ()  # the HF config.json `model_type`s that import as this family
    # its HF layers are named model.layers.{i}.{self_attn,mlp}.*_proj, as Llama's: PEFT adapters map
    llama_names: bool = False
    norm_offset: float = 0.0    # RMSNorm multiplies by (offset + scale): Gemma's (1 + w), w stored from 0
    qk_norm: bool = False       # RMSNorm over q and k before RoPE: each head's (head_dim) ...
    qk_norm_heads: bool = False  # ... or over the whole projection, every head at once (OLMo 2/3)
    pre_norms: bool = True      # a norm before attention and before the MLP (off: post-norms only, OLMo 2/3)
    post_norms: bool = False    # a norm after attention and after the MLP too, before each residual add
    embed_scale: bool = False   # input embeddings multiplied by √emb_dim
    # the attention variant of layer i is layer_pattern[i % len(layer_pattern)] unless the recipe
    # states `layer_types` (maxlite/models/layout.py): "local" layers attend within `sliding_window`
    # (when it is > 0), "global" layers to the whole causal context; a variant of another mixer kind
    # ("linear": a gated delta-net layer) makes the layer that kind
    layer_pattern: tuple[str, ...] = ("local",)
    # the MLP is a mixture of experts (maxlite/models/moe.py): `num_experts` routed experts of the
    # family's gated MLP, top `num_experts_per_tok` per token, in the layers `layout.layer_mlps` names
    moe: bool = False
    # full-attention layers gate their output by sigmoid of a second query projection (q_gate), per
    # head and dimension, before the output projection (Qwen3.5, Qwen3-Next)
    attn_output_gate: bool = False
    # "module:function(cfg, kinds) → kinds": the family rewrites the pattern's layer kinds (Gemma 4's
    # wide global layers and key/value-sharing layers are mixer kinds of their own)
    layer_kinds: str = ""
    layer_scalar: bool = False  # each layer's output multiplied by a stored scalar (Gemma 4's layer_scalar)
    # the global layers turn no RoPE (NoPE) and take no q/k norm; their queries are tempered by position
    # instead (`temperature_tuning`: Llama 4's), the local (chunked) layers are the RoPE layers
    global_nope: bool = False
    # use_qk_norm is a q/k RMS norm per head without a learned scale, after RoPE, on RoPE layers only
    # (Llama 4's "L2 norm"; no tensors)
    qk_l2_norm: bool = False

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices in the MLP (the FLOP count's m)."""
        return 2 if self.mlp in ("gelu", "relu2") else 3

    @property
    def gated(self) -> bool:
        """A gated MLP (gate, up, down)."""
        return self.mlp in ("swiglu", "geglu", "clamped_swiglu", "limited_swiglu")

    @property
    def rope(self) -> bool:
        return self.positions == "rope"

    @property
    def bias_leaves(self) -> tuple[str, ...]:
        """The attention biases use_bias=true creates."""
        return ("q_bias", "k_bias", "v_bias") if self.biases == "qkv" else (
            "q_bias", "k_bias", "v_bias", "o_bias")
