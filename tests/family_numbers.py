"""Run by tests/test_family_table.py in a subprocess with XLA's default code generation (the table's
parameter bytes are XLA's output, and the tests' cheaper compile, tests/xla_flags.py, computes some
functions in other last bits): prints one JSON object, the XLA_FLAGS this process started with and
each case's numbers (argv[1]: a JSON object of case → the command line of its config, a shrunk preset)."""

import hashlib
import json
import os
import sys

import jax
import numpy as np
from flax import nnx

from maxlite import mesh as mesh_lib
from maxlite.data.synthetic import make_synthetic_iterator
from tests.helpers import build


def numbers(preset: list[str], scan: bool) -> dict:
    """The parameter tree's hash, its initial bytes' hash and the first two losses on a fixed batch."""
    argv = preset + ["dtype=float32", f"scan_layers={str(scan).lower()}",
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


if __name__ == "__main__":
    cases = json.loads(sys.argv[1])  # {"llama2/scan": ["base.yml", "model_name=tiny", ...], ...}
    got = {key: numbers(model, key.endswith("/scan")) for key, model in cases.items()}
    print(json.dumps({"xla_flags": os.environ.get("XLA_FLAGS", ""), "cases": got}))
