"""Every shipped preset trains: each shrunk to CPU size with its traits kept (helpers.shrunk), in the
default dtypes (bf16 compute, f32 weights), through the unchunked and the chunked loss head."""

import jax
import numpy as np
import pytest
from flax import nnx

from helpers import build, preset_names, shrunk
from maxlite import config as C, mesh as mesh_lib
from maxlite.data.synthetic import make_synthetic_iterator


def _distinct(argvs: dict[str, list[str]]) -> dict[tuple, list[str]]:
    """Presets whose shrunk models are the same model share one run (their names in its id)."""
    groups: dict[tuple, list[str]] = {}
    for name, argv in argvs.items():
        key = tuple(sorted((k, str(v)) for k, v in C.load(argv).to_dict().items()
                           if k not in ("model_name", "run_name")))
        groups.setdefault(key, []).append(name)
    return groups


_GROUPS = list(_distinct({name: shrunk(name) for name in preset_names()}).values())
# every group through the unchunked head; tied heads through the chunked one too
_CASES = [(g, 1) for g in _GROUPS] + [(g, 2) for g in _GROUPS if C.load(shrunk(g[0])).logits_via_embedding]


@pytest.mark.parametrize("names, loss_chunks", _CASES, ids=[f"{'+'.join(g)}-chunks{n}" for g, n in _CASES])
def test_every_preset_trains_two_steps_in_the_default_dtypes(names, loss_chunks):
    """Two steps run, their losses are finite and every parameter moved (the tied head too)."""
    cfg, mesh, state, step, sharding = build(shrunk(names[0]) + [f"num_vocab_tiling={loss_chunks}"], 1)
    assert (cfg.dtype, cfg.weight_dtype) == ("bfloat16", "float32")
    before = jax.device_get(nnx.to_pure_dict(state.params))
    data = make_synthetic_iterator(cfg, "train", 0, 1)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        for _ in range(2):
            state, metrics = step(state, {k: jax.device_put(v, sharding) for k, v in next(data).items()})
            assert np.isfinite(float(metrics["loss"]))
    after = jax.device_get(nnx.to_pure_dict(state.params))
    for path, old in jax.tree_util.tree_leaves_with_path(before):
        new = np.asarray(_at(after, path))
        assert np.all(np.isfinite(new)) and not np.array_equal(new, old), jax.tree_util.keystr(path)


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree
