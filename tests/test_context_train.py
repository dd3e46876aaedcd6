"""Training with each sequence split over 4 simulated devices (context=4, load balanced) gives one
device's losses on packed rows with GQA and a sliding window; attention itself: tests/test_context.py."""

import jax
import numpy as np
from flax import nnx

from maxlite import mesh as mesh_lib
from maxlite.data.synthetic import make_synthetic_iterator
from helpers import SMALL, build

T = 64
ARGV = [a for a in SMALL if not a.startswith(("max_target_length=", "per_device_batch_size=", "base_num_kv_heads="))] + [
    f"max_target_length={T}", "base_num_kv_heads=1", "sliding_window=20", "attention=blockwise",
    "attention_block_size=8"]


def _packed(batch: dict) -> dict:
    """The synthetic rows cut into documents (boundaries inside shards and chunks), positions
    restarting at each, and padding (segment 0, weight 0) at the end of row 1."""
    B = batch["inputs"].shape[0]
    seg = np.ones((B, T), np.int32)
    seg[:, 21:50] = 2
    seg[0, 50:] = 3
    seg[1, 57:] = 0
    starts = np.r_[True, seg[0, 1:] != seg[0, :-1]], np.r_[True, seg[1, 1:] != seg[1, :-1]]
    positions = np.stack([np.arange(T) - np.maximum.accumulate(np.where(s, np.arange(T), 0)) for s in starts])
    return {**batch, "segment_ids": seg, "positions": positions.astype(np.int32),
            "weights": (seg > 0).astype(np.float32)}


def _losses(argv, devices: int, steps: int = 3) -> np.ndarray:
    cfg, mesh, state, step, sharding = build(argv, devices)
    data = make_synthetic_iterator(cfg, "train", 0, 1)
    losses = []
    with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        for _ in range(steps):
            state, metrics = step(state, {k: jax.device_put(v, sharding) for k, v in _packed(next(data)).items()})
            losses.append(float(metrics["loss"]))
    return np.array(losses)


def test_training_over_four_context_shards_equals_one_device():
    reference = _losses([*ARGV, "per_device_batch_size=2"], 1)
    split = _losses([*ARGV, "per_device_batch_size=0.5", "ici_context_parallelism=4", "ici_fsdp_parallelism=1",
                     "context_parallel_load_balance=true"], 4)
    np.testing.assert_allclose(split, reference, rtol=1e-4)  # summation order only (6e-6 seen)

