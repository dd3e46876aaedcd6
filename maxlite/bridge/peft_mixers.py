"""PEFT adapter tensors for the families whose layers are not Llama's (latent attention, the gated
delta-net), read off the family's own weight maps: its HF names, fused projections and
permutations are written once, there.

PEFT's lora_A [r, in] is A [in..., r] flattened and transposed (no map touches a projection's
input side but to flatten it); lora_B [out, r] is B [r, out...] put through the base weight's map
as if it were the first r input rows of the kernel — each map is linear and acts on the output
side row by row (a reshape, DeepSeek's RoPE permutation, Qwen3-Next's grouping by key head,
Qwen3.5's query/gate interleave), so those first r columns of its HF tensor are B's. Kernels the
HF projection spans but the adapter does not (Qwen3.5's attention gate under q_proj) get zeros.
"""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np

from maxlite.bridge import hf_convert
from maxlite.bridge.hf_convert import TensorMap
from maxlite.models import lora
from maxlite.models.families import family

FAMILIES = ("deepseek", "qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v4")


def tensor_maps(cfg) -> list[TensorMap]:
    """lora_A and lora_B maps of every targeted projection in the layers (not the multi-token-prediction
    depths, which the HF model does not run). PEFT names a projection by its module in the class; a
    family whose stored tensor names are not its modules' (DeepSeek-V4: `attn.wq_a` is the module
    `self_attn.q_a_proj`) says which module each is (its adapter's `module_name`)."""
    arch = importlib.import_module(family(cfg).hf_module)
    module = getattr(arch, "module_name", lambda hf: hf[:-len(".weight")])
    base = [(module(t.hf), t) for t in arch.tensor_maps(cfg) if t.layer]
    maps = []
    for target in cfg.lora_targets:
        found = [(name, t) for name, t in base if name.endswith(f".{target}") and len(t.hf_shape) == 2]
        if not found:
            raise ValueError(f"lora_targets: {cfg.decoder_block}'s Hugging Face layers have no {target} "
                             f"(export it merged with `hf export`)")
        for name, t in found:
            maps += _adapter(t, name, *lora.ADAPTERS[target], cfg.lora_rank)
    return maps


def _adapter(t: TensorMap, module: str, adapter: str, kernels: tuple[str, ...], r: int) -> list[TensorMap]:
    n_in = 2 if adapter == "o" else 1  # only the output projections take [heads, head_dim] in
    block, in_shape = t.paths[0][:-1], t.ml_shapes[0][:n_in]
    rows = int(np.prod(in_shape))
    if r > rows:
        raise ValueError(f"lora_rank={r} is wider than {t.hf}'s {rows} inputs")
    name = "base_model.model." + module
    lora_a = dataclasses.replace(hf_convert.linear(f"{name}.lora_A.weight", (*block, f"{adapter}_lora_a"), in_shape,
                                                   (r,)), mlp=t.mlp, mixer=t.mixer)
    adapted = [i for i, p in enumerate(t.paths) if p[-1] in kernels]
    outs = [s[n_in:] for s in t.ml_shapes]

    def to_hf(*bs):
        full = [np.zeros((rows, *out), np.float32) for out in outs]
        for i, b in zip(adapted, bs):
            full[i][:r] = b
        return t.to_hf(*(f.reshape(s) for f, s in zip(full, t.ml_shapes)))[:, :r]

    def from_hf(x):
        padded = np.zeros((x.shape[0], rows), x.dtype)
        padded[:, :r] = x
        leaves = t.from_hf(padded)
        return tuple(leaves[i].reshape(rows, *outs[i])[:r] for i in adapted)
    lora_b = TensorMap(f"{name}.lora_B.weight", tuple((*block, f"{t.paths[i][-1]}_lora_b") for i in adapted),
                       (t.hf_shape[0], r), tuple((r, *outs[i]) for i in adapted), to_hf, from_hf, mlp=t.mlp,
                       mixer=t.mixer)
    return [lora_a, lora_b]
