"""A vision tower's tensors as the bridge's TensorMaps: each encoder kind's own table (HF name, our
path, both conversions: maxlite/models/vision/qwen_vit_hf.py) under the model's `vision` part, with
the shapes both sides hold (from the tower's abstract parameters: nothing is built)."""

from __future__ import annotations

import functools

import numpy as np

from maxlite.bridge.hf_convert import TensorMap


@functools.lru_cache(maxsize=8)
def _shapes(spec) -> dict[tuple, tuple[int, ...]]:
    """Our path → shape of every parameter of the tower of `spec` (abstract: no memory)."""
    import jax.numpy as jnp
    from flax import nnx

    from maxlite.models.vision.qwen_vit import QwenVisionTower

    with nnx.use_eager_sharding(False):
        tower = nnx.eval_shape(lambda: QwenVisionTower(spec, rngs=nnx.Rngs(0), dtype=jnp.float32,
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
