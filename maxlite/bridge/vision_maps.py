"""A vision tower's tensors as the bridge's TensorMaps: each encoder kind's own table (HF name, our
path, both conversions: maxlite/models/vision/qwen_vit_hf.py, siglip_hf.py, gemma4_vit_hf.py) under
the model's `vision` part, with the shapes both sides hold (from the tower's abstract parameters:
nothing is built)."""

from __future__ import annotations

import functools

import numpy as np

from maxlite.bridge.hf_convert import TensorMap


@functools.lru_cache(maxsize=8)
def _shapes(spec) -> dict[tuple, tuple[int, ...]]:
    """Our path → shape of every parameter of the tower of `spec` (abstract: no memory)."""
    import jax.numpy as jnp
    from flax import nnx

    from maxlite.models.vision.gemma4_vit import Gemma4VisionSpec, Gemma4VisionTower
    from maxlite.models.vision.qwen_vit import QwenVisionSpec, QwenVisionTower
    from maxlite.models.vision.siglip import SiglipTower

    tower_cls = QwenVisionTower if isinstance(spec, QwenVisionSpec) else \
        Gemma4VisionTower if isinstance(spec, Gemma4VisionSpec) else SiglipTower
    with nnx.use_eager_sharding(False):
        tower = nnx.eval_shape(lambda: tower_cls(spec, rngs=nnx.Rngs(0), dtype=jnp.float32,
                                                 weight_dtype=jnp.float32))
    flat = nnx.to_flat_state(nnx.state(tower, nnx.Param))
    return {tuple(path): tuple(v.get_value().shape) for path, v in flat}


def qwen_vit_maps(cfg, prefix: str) -> list[TensorMap]:
    """The qwen_vit tower of `cfg` ↔ HF's tensors under `prefix` (Qwen3-VL: model.visual.)."""
    from maxlite.models.vision.qwen_vit_hf import tensor_map
    from maxlite.models.vision.towers import qwen_spec

    spec = qwen_spec(cfg)
    shapes = _shapes(spec)
    maps = []
    for name, path, (to_ours, to_hf) in tensor_map(spec):
        ours = shapes[tuple(path)]
        theirs = to_hf(np.zeros(ours, np.float32), spec).shape
        maps.append(TensorMap(prefix + name, (("vision", *path),), tuple(theirs), (ours,),
                              functools.partial(to_hf, spec=spec),
                              lambda t, f=to_ours: (f(t, spec),), layer=False))
    return maps


def siglip_maps(cfg, prefix) -> list[TensorMap]:
    """The siglip tower and Gemma 3's projector of `cfg` ↔ HF's tensors under `prefix`
    (siglip_hf.Prefixes: the tower's and the projector's); layer k of the scanned stack [L, ...] is
    HF's `encoder.layers.{k}.`."""
    from maxlite.models.vision import siglip_hf
    from maxlite.models.vision.towers import siglip_spec

    return _entry_maps(siglip_spec(cfg), siglip_hf.ENTRIES, prefix)


def gemma4_vit_maps(cfg) -> list[TensorMap]:
    """The gemma4_vit tower and Gemma 4's multimodal embedder of `cfg` ↔ HF's tensors
    (`model.vision_tower.`, `model.embed_vision.`)."""
    from maxlite.models.vision import gemma4_vit_hf
    from maxlite.models.vision.towers import gemma4_spec

    spec = gemma4_spec(cfg)
    return _entry_maps(spec, gemma4_vit_hf.entries(spec), gemma4_vit_hf.PREFIXES)


def _entry_maps(spec, entries, prefix) -> list[TensorMap]:
    """A table of siglip_hf.Entry rows as TensorMaps under the model's `vision` part."""
    from maxlite.models.vision.siglip_hf import hf_names_of

    shapes = _shapes(spec)
    maps = []
    for entry in entries:
        stacked = entry.path[0] == "layers"
        ours = shapes[entry.path][1:] if stacked else shapes[entry.path]
        theirs = entry.to_hf(np.zeros(ours, np.float32), spec).shape
        for k, name in enumerate(hf_names_of(entry, spec, prefix)):
            maps.append(TensorMap(name, (("vision", *entry.path),), tuple(theirs), (ours,),
                                  functools.partial(entry.to_hf, spec=spec),
                                  lambda t, f=entry.to_ours: (f(t, spec),), layer=False,
                                  stacked=(k, spec.depth) if stacked else None))
    return maps
