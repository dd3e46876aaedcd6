"""HF ↔ maxlite for the Qwen3-VL / Qwen3.5 vision tower: one declarative table of tensors, read
both ways. `from_hf` gives the nested dict of `nnx.state(QwenVisionTower)` (so `nnx.update` loads
it) and refuses a checkpoint with a vision tensor the table does not name, or without one it does;
`to_hf` is its exact inverse.

HF's patch embedding is a Conv3d [D, C_in, tp, p, p] whose stride equals its kernel: on a pixel row
(HF's pixel_values, laid out channel, then frame, then pixel row, then pixel column) it is the
matmul by its weight flattened to [D, C] and transposed. Linear weights are [out, in] in HF and
[in, out] here; the fused qkv's output dim is (q|k|v, head, head dim).
"""

from __future__ import annotations

import numpy as np

from maxlite.models.vision.qwen_vit import QwenVisionSpec

# Where the tower's tensors sit in each HF class's state dict (transformers 5.25; checkpoints on the
# Hub store the same names: no conversion mapping renames them).
PREFIXES = {"Qwen3VLForConditionalGeneration": "model.visual.", "Qwen3VLModel": "visual.",
            "Qwen3_5ForConditionalGeneration": "model.visual.", "Qwen3_5Model": "visual."}


def _transpose(w: np.ndarray, spec) -> np.ndarray:  # HF's [out, in] ↔ our [in, out]
    return w.T


def _qkv(w: np.ndarray, spec) -> np.ndarray:  # [3D, D] → [D, 3, A, H]
    return w.reshape(3, spec.num_heads, spec.head_dim, spec.hidden_size).transpose(3, 0, 1, 2)


def _qkv_back(w_D3AH: np.ndarray, spec) -> np.ndarray:
    return w_D3AH.transpose(1, 2, 3, 0).reshape(3 * spec.hidden_size, spec.hidden_size)


def _heads(b: np.ndarray, spec) -> np.ndarray:  # [3D] → [3, A, H]
    return b.reshape(3, spec.num_heads, spec.head_dim)


def _heads_back(b: np.ndarray, spec) -> np.ndarray:
    return b.reshape(-1)


def _out(w_DI: np.ndarray, spec) -> np.ndarray:  # [D, A·H] → [A, H, D]
    return w_DI.T.reshape(spec.num_heads, spec.head_dim, spec.hidden_size)


def _out_back(w_AHD: np.ndarray, spec) -> np.ndarray:
    return w_AHD.reshape(spec.hidden_size, spec.hidden_size).T


def _patch(w: np.ndarray, spec) -> np.ndarray:  # Conv3d [D, C_in, tp, p, p] → [C, D]
    return w.reshape(spec.hidden_size, spec.patch_dim).T


def _patch_back(w_CD: np.ndarray, spec) -> np.ndarray:
    return w_CD.T.reshape(spec.hidden_size, spec.in_channels, spec.temporal_patch_size,
                          spec.patch_size, spec.patch_size)


def _same(x: np.ndarray, spec) -> np.ndarray:
    return x


LINEAR, QKV, HEADS, OUT, PATCH, SAME = ((_transpose, _transpose), (_qkv, _qkv_back), (_heads, _heads_back),
                                        (_out, _out_back), (_patch, _patch_back), (_same, _same))


def _norm(hf: str, ours: tuple) -> list:
    return [(f"{hf}.weight", (*ours, "scale"), SAME), (f"{hf}.bias", (*ours, "bias"), SAME)]


def _merger(hf: str, ours: tuple) -> list:
    return [*_norm(f"{hf}.norm", (*ours, "norm")),
            (f"{hf}.linear_fc1.weight", (*ours, "fc1"), LINEAR), (f"{hf}.linear_fc1.bias", (*ours, "fc1_bias"), SAME),
            (f"{hf}.linear_fc2.weight", (*ours, "fc2"), LINEAR), (f"{hf}.linear_fc2.bias", (*ours, "fc2_bias"), SAME)]


def tensor_map(spec: QwenVisionSpec) -> list[tuple[str, tuple, tuple]]:
    """(HF name without prefix, our state path, (to ours, to HF)) for every tensor of the tower."""
    rows = [("patch_embed.proj.weight", ("patch",), PATCH), ("patch_embed.proj.bias", ("patch_bias",), SAME),
            ("pos_embed.weight", ("pos_table",), SAME)]
    for i in range(spec.depth):
        hf, ours = f"blocks.{i}", ("blocks", i)
        rows += [*_norm(f"{hf}.norm1", (*ours, "norm1")), *_norm(f"{hf}.norm2", (*ours, "norm2")),
                 (f"{hf}.attn.qkv.weight", (*ours, "qkv"), QKV), (f"{hf}.attn.qkv.bias", (*ours, "qkv_bias"), HEADS),
                 (f"{hf}.attn.proj.weight", (*ours, "o"), OUT), (f"{hf}.attn.proj.bias", (*ours, "o_bias"), SAME),
                 (f"{hf}.mlp.linear_fc1.weight", (*ours, "fc1"), LINEAR),
                 (f"{hf}.mlp.linear_fc1.bias", (*ours, "fc1_bias"), SAME),
                 (f"{hf}.mlp.linear_fc2.weight", (*ours, "fc2"), LINEAR),
                 (f"{hf}.mlp.linear_fc2.bias", (*ours, "fc2_bias"), SAME)]
    rows += _merger("merger", ("merger",))
    for k in range(len(spec.deepstack_visual_indexes)):
        rows += _merger(f"deepstack_merger_list.{k}", ("deepstack", k))
    return rows


def from_hf(state: dict[str, np.ndarray], spec: QwenVisionSpec, prefix: str = "model.visual.") -> dict:
    """The tower's tensors of an HF state dict (other names, e.g. the decoder's, are ignored) as the
    nested dict of `nnx.state(tower)`."""
    theirs = {name[len(prefix):] for name in state if name.startswith(prefix)}
    rows = tensor_map(spec)
    named = {hf for hf, _, _ in rows}
    if theirs - named:
        raise ValueError(f"HF vision tensors this Qwen tower does not have: {sorted(theirs - named)[:5]} "
                         f"(is the spec the checkpoint's? prefix {prefix!r})")
    if named - theirs:
        raise ValueError(f"HF state under {prefix!r} lacks {len(named - theirs)} vision tensors, "
                         f"e.g. {sorted(named - theirs)[:3]}")
    out: dict = {}
    for hf, path, (to_ours, _) in rows:
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = to_ours(np.asarray(state[prefix + hf]), spec)
    return out


def to_hf(tower_state, spec: QwenVisionSpec, prefix: str = "model.visual.") -> dict[str, np.ndarray]:
    """HF names → arrays from `nnx.state(tower)` (or from_hf's nested dict): from_hf's inverse."""
    out = {}
    for hf, path, (_, back) in tensor_map(spec):
        node = tower_state
        for key in path:
            node = node[key]
        out[prefix + hf] = back(np.asarray(node[...] if hasattr(node, "get_value") else node), spec)
    return out
