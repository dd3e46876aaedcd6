"""One entry per model family (`decoder_block`): what differs between them, said once.

The transformer, the layers, the FLOP count, the planner, decoding, the torch twin, the HF adapters
and the NeMo/Megatron mapping read these traits instead of testing the family's name. A new family
is a new entry here plus its HF adapter module in maxlite/bridge/. Which mixer and feed-forward kind each
layer has is maxlite/models/kinds.py's.

Pure data: importable without JAX (config validation and the bridge use it).
"""

from __future__ import annotations

import collections.abc
import dataclasses


SWIGLU_ALPHA = 1.702  # the sigmoid gain of the "clamped_swiglu" MLP (gpt-oss's)


@dataclasses.dataclass(frozen=True)
class Family:
    name: str               # the `decoder_block` value
    summary: str
    norm: str               # "rmsnorm" | "layernorm" (pre-norm, before attention and MLP)
    mlp: str                # "swiglu" (silu(gate)·up, down) | "geglu" (tanh-GELU(gate)·up, down) |
                            # "gelu" (up, down, with biases) | "clamped_swiglu" (gpt-oss's:
                            # (up + 1)·gate·σ(1.702·gate), clamped at mlp_activations_limit)
    positions: str          # "rope" (rotary, in attention) | "learned" (absolute, added to the embedding)
    biases: str             # what use_bias=true adds: "attention" (q/k/v/o) | "qkv" (q/k/v, no o) |
                            # "all" (every linear and norm)
    hf_module: str          # the module mapping the weights to and from Hugging Face (maxlite.bridge.hf_*, or
                            # the family's own module in maxlite/families/)
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
    # states `layer_types` (maxlite/models/kinds.py): "local" layers attend within `sliding_window`
    # (when it is > 0), "global" layers to the whole causal context; a variant of another mixer kind
    # ("linear": a gated delta-net layer) makes the layer that kind
    layer_pattern: tuple[str, ...] = ("local",)
    # the MLP is a mixture of experts (maxlite/models/moe.py): `num_experts` routed experts of the
    # family's gated MLP, top `num_experts_per_tok` per token, in the layers `kinds.layer_mlps` names
    moe: bool = False
    # full-attention layers gate their output by sigmoid of a second query projection (q_gate), per
    # head and dimension, before the output projection (Qwen3.5, Qwen3-Next)
    attn_output_gate: bool = False
    # "module:function(cfg, kinds) → kinds": the family rewrites the pattern's layer kinds (Gemma 4's
    # wide global layers and key/value-sharing layers are mixer kinds of their own)
    layer_kinds: str = ""
    layer_scalar: bool = False  # each layer's output multiplied by a stored scalar (Gemma 4's layer_scalar)

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices in the MLP (the FLOP count's m)."""
        return 2 if self.mlp == "gelu" else 3

    @property
    def gated(self) -> bool:
        """A gated MLP (gate, up, down)."""
        return self.mlp in ("swiglu", "geglu", "clamped_swiglu")

    @property
    def rope(self) -> bool:
        return self.positions == "rope"

    @property
    def bias_leaves(self) -> tuple[str, ...]:
        """The attention biases use_bias=true creates."""
        return ("q_bias", "k_bias", "v_bias") if self.biases == "qkv" else (
            "q_bias", "k_bias", "v_bias", "o_bias")


BUILT_IN = {f.name: f for f in (
    Family("llama2", "Llama 2/3/3.1/3.2 and Mistral (sliding_window): pre-RMSNorm, RoPE, GQA, SwiGLU",
           norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention", hf_module="maxlite.bridge.hf_llama",
           nemo_factory="llama3_8b", llama_names=True, hf_model_types=("llama", "mistral")),
    Family("gpt3", "GPT-3 / GPT-2: pre-LayerNorm, learned positions, biases, GELU",
           norm="layernorm", mlp="gelu", positions="learned", biases="all", hf_module="maxlite.bridge.hf_gpt2",
           nemo_factory="gpt3_175b", hf_model_types=("gpt2",)),
    Family("qwen2", "Qwen2 / Qwen2.5: Llama's block with q/k/v biases (no o bias)",
           norm="rmsnorm", mlp="swiglu", positions="rope", biases="qkv", hf_module="maxlite.bridge.hf_qwen",
           nemo_factory="qwen25_7b", llama_names=True, hf_model_types=("qwen2",)),
    Family("qwen3", "Qwen3 (dense): Llama's block with per-head RMSNorm on q and k before RoPE",
           norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention", hf_module="maxlite.bridge.hf_qwen",
           nemo_factory="qwen3_8b", llama_names=True, hf_model_types=("qwen3",), qk_norm=True),
    Family("mixtral", "Mixtral: Mistral's block (sliding_window optional) with a mixture of SwiGLU experts",
           norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention", hf_module="maxlite.bridge.hf_moe",
           nemo_factory="mixtral_8x7b", hf_model_types=("mixtral",), moe=True),
    Family("qwen3_moe", "Qwen3-MoE: Qwen3's block (q/k norms) with a mixture of SwiGLU experts",
           norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention", hf_module="maxlite.bridge.hf_moe",
           nemo_factory="qwen3_30b_a3b", hf_model_types=("qwen3_moe",), qk_norm=True, moe=True),
    Family("gemma3", "Gemma 3 (text): 5 sliding-window layers to 1 global, (1 + w) RMSNorm before and after "
           "attention and MLP, q/k norms, GeGLU, √d-scaled tied embeddings",
           norm="rmsnorm", mlp="geglu", positions="rope", biases="attention", hf_module="maxlite.bridge.hf_gemma3",
           nemo_factory="gemma3_1b", llama_names=True, hf_model_types=("gemma3_text", "gemma3"), norm_offset=1.0, qk_norm=True, post_norms=True, embed_scale=True,
           layer_pattern=("local",) * 5 + ("global",)),
)}


class _Registry(collections.abc.Mapping):
    """The families by name: the built-in ones above, and one per module of the maxlite.families
    package (each defines FAMILY: its data, beside its own HF adapter), found when first read."""

    def __init__(self, built_in: dict):
        self._built_in, self._all = built_in, None

    def _load(self) -> dict:
        if self._all is None:
            import importlib
            import pkgutil

            from maxlite import families as package
            found = {}
            for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
                fam = importlib.import_module(f"{package.__name__}.{info.name}").FAMILY
                found[fam.name] = fam
            self._all = {**self._built_in, **found}
        return self._all

    def __getitem__(self, name: str) -> Family:
        return self._load()[name]

    def __iter__(self):
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())


FAMILIES = _Registry(BUILT_IN)


def family(cfg) -> Family:
    """The family of a config (its `decoder_block`; config validation keeps it one of FAMILIES)."""
    return FAMILIES[cfg.decoder_block]


def has_qk_norm(cfg) -> bool:
    """q and k RMS-normed before RoPE: the family's own norms, or the recipe's use_qk_norm (per head)."""
    return family(cfg).qk_norm or cfg.use_qk_norm
