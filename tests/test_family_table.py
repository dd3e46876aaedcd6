"""Every family's numbers, held across refactors of the decoder layer: one shrunk preset per family
(helpers.shrunk, float32), scanned and unrolled, its parameter tree (paths, shapes, dtypes: what a
saved checkpoint must match to restore), the bytes of its initial parameters, and the losses of its
first two training steps on a fixed synthetic batch.

The table (tests/data/family_table.json) was written before the decoder layer became mixer +
feed-forward kinds. Update it ONLY when a change is meant to alter a family's parameters or numerics,
by running `MAXLITE_WRITE_TABLE=1 pytest tests/test_family_table.py`, and say why in the commit.

Tree and parameter bytes must be identical on every CPU (the initialisation is counter-based random
numbers). The losses are compared to 1e-6 relative: float32 sums reorder between CPUs' kernels (an
AVX2-only CPU and one with AVX-512 differ in the last bits), and a few hundred products of O(1)
terms in float32 (epsilon 1.2e-7) stay well inside that; a changed layer moves them by far more.
"""

import hashlib
import json
import os
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

from helpers import build, shrunk
from maxlite import config as C, mesh as mesh_lib
from maxlite.data.synthetic import make_synthetic_iterator

TABLE = pathlib.Path(__file__).parent / "data" / "family_table.json"
# one preset per family: the smallest of each, shrunk with its traits (MoE layouts included)
PRESETS = {"llama2": "tiny", "gpt3": "gpt3-126m", "qwen2": "qwen2.5-0.5b", "qwen3": "qwen3-0.6b",
           "gemma3": "gemma3-1b", "mixtral": "tiny-moe", "qwen3_moe": "qwen3-30b-a3b"}
CASES = [(fam, scan) for fam in PRESETS for scan in (True, False)]


def _numbers(model_name: str, scan: bool) -> dict:
    argv = shrunk(model_name) + ["dtype=float32", f"scan_layers={str(scan).lower()}",
                                 "per_device_batch_size=2"]
    cfg, mesh, state, step, sharding = build(argv, 1)
    leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(nnx.to_pure_dict(state.params)))
    data, losses = make_synthetic_iterator(cfg, "train", 0, 1), []
    with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        for _ in range(2):
            state, metrics = step(state, {k: jax.device_put(v, sharding) for k, v in next(data).items()})
            losses.append(metrics["loss"])
    tree = [(jax.tree_util.keystr(p), list(np.shape(x)), str(np.asarray(x).dtype)) for p, x in leaves]
    digest = hashlib.sha256()
    for _, x in leaves:
        digest.update(np.ascontiguousarray(np.asarray(x)).tobytes())
    return {"tree": hashlib.sha256(json.dumps(tree).encode()).hexdigest(), "params": digest.hexdigest(),
            "losses": [float(v) for v in losses], "leaves": len(tree)}


@pytest.mark.skipif(os.environ.get("MAXLITE_WRITE_TABLE") != "1", reason="writes the table")
def test_write_table():
    TABLE.write_text(json.dumps({f"{fam}/{'scan' if scan else 'unrolled'}": _numbers(PRESETS[fam], scan)
                                 for fam, scan in CASES}, indent=1) + "\n")


@pytest.mark.parametrize("fam, scan", CASES, ids=[f"{f}-{'scan' if s else 'unrolled'}" for f, s in CASES])
def test_family_numbers_unchanged(fam, scan):
    assert C.load(shrunk(PRESETS[fam])).decoder_block == fam
    expected = json.loads(TABLE.read_text())[f"{fam}/{'scan' if scan else 'unrolled'}"]
    got = _numbers(PRESETS[fam], scan)
    assert (got["tree"], got["leaves"]) == (expected["tree"], expected["leaves"]), "parameter tree changed"
    assert got["params"] == expected["params"], "initial parameters changed"
    np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-6)
