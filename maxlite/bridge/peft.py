"""A LoRA run's adapters → a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`).

    python -m maxlite.bridge.hf export-peft RUN/checkpoints adapter/ [--base-model NAME_OR_DIR]

`peft.PeftModel.from_pretrained(base, "adapter/")` on the Hugging Face model the run started from
(the one `hf import` read, or `hf export` of the base checkpoint) computes what the LoRA run computes.
Layout: PEFT's `...{q,k,v,o}_proj.lora_A.weight` is [r, in] and `lora_B.weight` [out, r], the
transposes of maxlite's A [in..., r] and B [r, out...] (models/lora.py); the scale is lora_alpha / r
in both. `hf export` of the same checkpoint writes the adapters merged into the weights instead.
The adapters' module names are those of the class `hf export` writes (read off the family's own
tensor maps): a vision model's decoder layers sit under `model.language_model.` of its multimodal
class (Qwen3-VL, Qwen3.5, Gemma 3 with its tower), a text model's under `model.`.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pathlib
import re

import numpy as np

from maxlite import config as C
from maxlite.bridge import hf_convert
from maxlite.bridge import params as P
from maxlite.bridge import peft_mixers
from maxlite.bridge.safetensors_io import _write_file
from maxlite.models import lora
from maxlite.models.families import FAMILIES, family

ADAPTER_FILE = "adapter_model.safetensors"


def tensor_maps(cfg) -> list[hf_convert.TensorMap]:
    """The adapters' tensors; a family whose layers differ in shape (its adapter's `lora_shapes`:
    mixer kind → the kernels its layers have) gets maps per mixer kind."""
    D, N, K, H, F, r = (cfg.base_emb_dim, cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim,
                        cfg.base_mlp_dim, cfg.lora_rank)
    shapes = {"q": ((D,), (N, H)), "k": ((D,), (K, H)), "v": ((D,), (K, H)), "o": ((N, H), (D,)),
              "gate": ((D,), (F,)), "up": ((D,), (F,)), "down": ((F,), (D,))}
    arch = importlib.import_module(family(cfg).hf_module)
    per_mixer = arch.lora_shapes(cfg) if hasattr(arch, "lora_shapes") else {None: shapes}
    layers = f"base_model.model.{decoder_prefix(arch, cfg)}layers.{{i}}."
    maps = []
    for mixer, kernels in per_mixer.items():
        for target, block, kernel, _ in lora.names(cfg):
            if kernel not in kernels:  # a layer without this projection (Gemma 4's shared k/v)
                continue
            name = f"{layers}{lora.HF_BLOCK[block]}.{target}"
            in_shape, out_shape = kernels[kernel]
            maps += [dataclasses.replace(t, mixer=mixer) for t in (
                hf_convert.linear(f"{name}.lora_A.weight", (block, f"{kernel}_lora_a"), in_shape, (r,)),
                hf_convert.linear(f"{name}.lora_B.weight", (block, f"{kernel}_lora_b"), (r,), out_shape))]
    return maps


def decoder_prefix(arch, cfg) -> str:
    """Where the exported class holds the decoder's layers as modules ("model." or a vision model's
    "model.language_model."), which is where peft attaches adapters: the family's `peft_prefix`
    where the file it saves names them otherwise (Gemma 3 with its tower saves transformers 4's
    `language_model.model.`), else the prefix of its own first per-layer tensor name."""
    if hasattr(arch, "peft_prefix"):
        return arch.peft_prefix(cfg)
    name = next(t.hf for t in arch.tensor_maps(cfg) if t.layer and "layers.{i}." in t.hf)
    return name[:name.index("layers.{i}.")]


def target_modules(cfg) -> list[str] | str:
    """adapter_config.json's target_modules: the projections' names; for a vision model a pattern
    that holds them to the decoder's layers (a tower has its own q_proj / v_proj: SigLIP's), which
    peft matches against the whole module name."""
    arch = importlib.import_module(family(cfg).hf_module)
    if hasattr(arch, "peft_targets"):  # projections whose names other modules of the class share
        return arch.peft_targets(cfg)
    if not cfg.vision_encoder:
        return sorted(cfg.lora_targets)
    prefix = re.escape(decoder_prefix(arch, cfg))
    return rf"{prefix}layers\.\d+\.(?:.*\.)?(?:{'|'.join(sorted(cfg.lora_targets))})"


def export_peft(cfg, params, out_dir: str, base_model: str = "") -> pathlib.Path:
    if cfg.lora_rank == 0:
        raise ValueError("this checkpoint has no LoRA adapters (lora_rank=0): use `hf export`")
    if not family(cfg).llama_names and family(cfg).name not in peft_mixers.FAMILIES:
        named = ", ".join([*(f.name for f in FAMILIES.values() if f.llama_names), *peft_mixers.FAMILIES])
        raise ValueError(f"PEFT export covers {named}, not {cfg.decoder_block}")
    maps = tensor_maps(cfg) if family(cfg).llama_names else peft_mixers.tensor_maps(cfg)
    out = pathlib.Path(C.resolve_path(out_dir))
    out.mkdir(parents=True, exist_ok=True)
    entries = hf_convert.export_entries(cfg, maps, P.to_pure(params), np.float32)
    _write_file(out / ADAPTER_FILE, entries, {"format": "pt"}, None)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha,
              "lora_dropout": cfg.lora_dropout, "target_modules": target_modules(cfg), "bias": "none",
              "base_model_name_or_path": base_model or None, "fan_in_fan_out": False, "inference_mode": True,
              "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None,
              "layers_to_transform": None}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
