"""Gemma 4's vision tower and multimodal embedder ↔ Hugging Face tensors (maxlite/models/vision/gemma4_vit.py).

The table has siglip_hf's shape (one Entry per parameter: our path, HF's name under the tower's or
the embedder's prefix, both conversions; `{i}` for the layer of a stacked param) and its functions
read it. transformers 5.25 holds and saves the same names (`model.vision_tower.`, `model.embed_vision.`).
Every linear of the tower is a Gemma4ClippableLinear (`….linear.weight`); with `use_clipped_linears`
its four scalar bounds (`….q_proj.input_min`, …) are ours by the same names (`q_input_min`, …).
"""

from __future__ import annotations

from maxlite.models.vision.gemma4_vit import BOUNDS, LINEARS, Gemma4VisionSpec
from maxlite.models.vision.siglip_hf import Entry, Prefixes

PREFIXES = Prefixes("model.vision_tower.", "model.embed_vision.")


def _same(x, spec):
    return x


def _one(x, spec):
    return x.reshape(1)


def _scalar(x, spec):
    return x.reshape(())


def _t(x, spec):
    return x.T


def _heads_in(heads: str):
    def to_ours(w, spec: Gemma4VisionSpec):  # Linear [n·H, D] → [D, n, H]
        n = spec.num_heads if heads == "q" else spec.num_kv_heads
        return w.T.reshape(spec.hidden_size, n, spec.head_dim)
    return to_ours


def _heads_in_hf(w, spec):
    return w.reshape(spec.hidden_size, -1).T


def _heads_out(w, spec):  # o_proj [D, N·H] → [N, H, D]
    return w.T.reshape(spec.num_heads, spec.head_dim, spec.hidden_size)


def _heads_out_hf(w, spec):
    return w.reshape(-1, spec.hidden_size).T


_LAYER = "encoder.layers.{i}."
ENTRIES = (
    Entry(("patch",), "patch_embedder.input_proj.weight", False, _t, _t),
    Entry(("positions",), "patch_embedder.position_embedding_table", False, _same, _same),
    *(Entry(("layers", p), _LAYER + f"self_attn.{p}_proj.linear.weight", False, _heads_in(p), _heads_in_hf)
      for p in "qkv"),
    Entry(("layers", "o"), _LAYER + "self_attn.o_proj.linear.weight", False, _heads_out, _heads_out_hf),
    *(Entry(("layers", f"{p}_norm", "scale"), _LAYER + f"self_attn.{p}_norm.weight", False, _same, _same)
      for p in "qk"),
    *(Entry(("layers", ours, "scale"), _LAYER + f"{theirs}.weight", False, _same, _same) for ours, theirs in (
        ("attn_norm", "input_layernorm"), ("attn_post_norm", "post_attention_layernorm"),
        ("mlp_norm", "pre_feedforward_layernorm"), ("mlp_post_norm", "post_feedforward_layernorm"))),
    *(Entry(("layers", p), _LAYER + f"mlp.{p}_proj.linear.weight", False, _t, _t) for p in ("gate", "up", "down")),
    Entry(("mm_projection",), "embedding_projection.weight", True, _t, _t),
)
STANDARDIZE = (Entry(("std_bias",), "std_bias", False, _same, _same),
               Entry(("std_scale",), "std_scale", False, _same, _same))


def _clip_entries() -> tuple[Entry, ...]:
    """Each linear's four scalar bounds (HF `….q_proj.input_min` ↔ our `q_input_min`, held as [1])."""
    where = {"q": "self_attn", "k": "self_attn", "v": "self_attn", "o": "self_attn"}
    return tuple(Entry(("layers", f"{name}_{bound}"), _LAYER + f"{where.get(name, 'mlp')}.{name}_proj.{bound}", False,
                       _one, _scalar) for name in LINEARS for bound in BOUNDS)


def entries(spec: Gemma4VisionSpec) -> tuple[Entry, ...]:
    """The tower's table: the standardisation's bias and scale, and the linears' bounds, only where
    the tower stores them."""
    return ENTRIES + (STANDARDIZE if spec.standardize else ()) + (_clip_entries() if spec.clipped else ())
