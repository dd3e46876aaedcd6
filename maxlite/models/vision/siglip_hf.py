"""Gemma 3's vision tower and projector ↔ Hugging Face tensors (maxlite/models/vision/siglip.py).

One table says where each of our parameters lives in HF's state dict and how its layout differs
(torch Linear weights are [out, in]; our projections are [in, heads, head dim]); `from_hf` and
`to_hf` both read it, so they are inverses by construction and every HF name is named once.
The layer stack's params are [L, ...]: layer i reads HF's `encoder.layers.{i}.…`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from maxlite.models.vision.siglip import SiglipSpec


class Prefixes(NamedTuple):
    vision: str
    projector: str


# transformers 5's Gemma3ForConditionalGeneration.state_dict(): the tower is the SiglipVisionModel
# itself, its `vision_model.` level removed on load (conversion_mapping.py: PrefixChange).
IN_MEMORY = Prefixes("model.vision_tower.", "model.multi_modal_projector.")
# Google's Gemma 3 checkpoint files (transformers 4's layout), which transformers 5 still loads.
HUB = Prefixes("vision_tower.vision_model.", "multi_modal_projector.")
# What transformers 5.25's save_pretrained writes: `model.` dropped, `vision_model.` not restored.
SAVED_5 = Prefixes("vision_tower.", "multi_modal_projector.")


class Entry(NamedTuple):
    path: tuple[str, ...]  # in nnx.state(tower)
    name: str  # after the prefix; `{i}` for the layer index of a stacked param
    projector: bool  # under Prefixes.projector, else Prefixes.vision
    to_ours: Callable[[np.ndarray, SiglipSpec], np.ndarray]  # one HF tensor → ours (one layer's)
    to_hf: Callable[[np.ndarray, SiglipSpec], np.ndarray]


def _same(x, spec):
    return x


def _t(x, spec):
    return x.T


def _heads_in(w, spec):  # Linear [N·H, D] → [D, N, H]
    return w.T.reshape(spec.hidden_size, spec.num_heads, spec.head_dim)


def _heads_in_hf(w, spec):
    return w.reshape(spec.hidden_size, -1).T


def _heads_bias(b, spec):  # [N·H] → [N, H]
    return b.reshape(spec.num_heads, spec.head_dim)


def _flat(b, spec):
    return b.reshape(-1)


def _heads_out(w, spec):  # out_proj [D, N·H] → [N, H, D]
    return w.T.reshape(spec.num_heads, spec.head_dim, spec.hidden_size)


def _heads_out_hf(w, spec):
    return w.reshape(-1, spec.hidden_size).T


def _patch(w, spec):  # conv [D, C, P, P] → [C·P·P, D]
    return w.reshape(spec.hidden_size, -1).T


def _patch_hf(w, spec):
    return w.T.reshape(spec.hidden_size, spec.num_channels, spec.patch_size, spec.patch_size)


_LAYER = "encoder.layers.{i}."
ENTRIES = (
    Entry(("patch",), "embeddings.patch_embedding.weight", False, _patch, _patch_hf),
    Entry(("patch_bias",), "embeddings.patch_embedding.bias", False, _same, _same),
    Entry(("positions",), "embeddings.position_embedding.weight", False, _same, _same),
    Entry(("layers", "ln1", "scale"), _LAYER + "layer_norm1.weight", False, _same, _same),
    Entry(("layers", "ln1", "bias"), _LAYER + "layer_norm1.bias", False, _same, _same),
    *(Entry(("layers", p), _LAYER + f"self_attn.{p}_proj.weight", False, _heads_in, _heads_in_hf) for p in "qkv"),
    *(Entry(("layers", f"{p}_bias"), _LAYER + f"self_attn.{p}_proj.bias", False, _heads_bias, _flat) for p in "qkv"),
    Entry(("layers", "o"), _LAYER + "self_attn.out_proj.weight", False, _heads_out, _heads_out_hf),
    Entry(("layers", "o_bias"), _LAYER + "self_attn.out_proj.bias", False, _same, _same),
    Entry(("layers", "ln2", "scale"), _LAYER + "layer_norm2.weight", False, _same, _same),
    Entry(("layers", "ln2", "bias"), _LAYER + "layer_norm2.bias", False, _same, _same),
    Entry(("layers", "up"), _LAYER + "mlp.fc1.weight", False, _t, _t),
    Entry(("layers", "up_bias"), _LAYER + "mlp.fc1.bias", False, _same, _same),
    Entry(("layers", "down"), _LAYER + "mlp.fc2.weight", False, _t, _t),
    Entry(("layers", "down_bias"), _LAYER + "mlp.fc2.bias", False, _same, _same),
    Entry(("post_norm", "scale"), "post_layernorm.weight", False, _same, _same),
    Entry(("post_norm", "bias"), "post_layernorm.bias", False, _same, _same),
    Entry(("mm_norm", "scale"), "mm_soft_emb_norm.weight", True, _same, _same),
    Entry(("mm_projection",), "mm_input_projection_weight", True, _same, _same),  # stored [D, E], no transpose
)


def hf_names_of(entry: Entry, spec: SiglipSpec, prefix: Prefixes) -> list[str]:
    """The HF names of one entry: one per layer for a stacked param."""
    base = (prefix.projector if entry.projector else prefix.vision) + entry.name
    return [base.format(i=i) for i in range(spec.depth)] if "{i}" in base else [base]


def hf_names(spec: SiglipSpec, prefix: Prefixes = IN_MEMORY) -> list[str]:
    """Every HF tensor name the tower reads (its pooling head, which Gemma 3 never runs, excluded)."""
    return [n for e in ENTRIES for n in hf_names_of(e, spec, prefix)]


def from_hf(state: dict[str, np.ndarray], spec: SiglipSpec, prefix: Prefixes = IN_MEMORY) -> dict:
    """HF tensors (a whole model's state may be given: only the tower's names are read) → the
    nested dict of nnx.state(SiglipTower(spec)), ready for nnx.update."""
    missing = [n for n in hf_names(spec, prefix) if n not in state]
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} vision tensors, e.g. {missing[0]!r} "
                         f"(its names under another prefix? this reads {prefix.vision!r}, {prefix.projector!r})")
    out: dict = {}
    for e in ENTRIES:
        values = [e.to_ours(np.asarray(state[n]), spec) for n in hf_names_of(e, spec, prefix)]
        node = out
        for key in e.path[:-1]:
            node = node.setdefault(key, {})
        node[e.path[-1]] = np.stack(values) if e.path[0] == "layers" else values[0]
    return out


def to_hf(params: dict, spec: SiglipSpec, prefix: Prefixes = IN_MEMORY) -> dict[str, np.ndarray]:
    """The inverse of from_hf: the tower's nested params (arrays: nnx.state(tower).to_pure_dict()) →
    HF tensors."""
    out = {}
    for e in ENTRIES:
        value = params
        for key in e.path:
            value = value[key]
        value = np.asarray(value)
        names = hf_names_of(e, spec, prefix)
        layers = value if e.path[0] == "layers" else [value]
        out.update({n: e.to_hf(v, spec) for n, v in zip(names, layers)})
    return out
