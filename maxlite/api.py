"""Conveniences for using maxlite from Python (docs/python.md): a model off any mesh, a forward pass
with default positions and segment ids, a training batch from token ids.

The training path (`maxlite.build.build(cfg)` → `Built.init_state()` → `Built.train_step`) needs
none of this; these are for notebooks, evaluation scripts and the bridge's users.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxlite import config_checks
from maxlite.models.transformer import Transformer


def create_model(cfg, seed: int = 0) -> Transformer:
    """A freshly initialised model on the default device, outside any mesh (no sharding)."""
    config_checks.check_platform(cfg, jax.devices()[0].platform)  # as config.resolve does for the loop
    with nnx.use_eager_sharding(False):  # the params' logical axes need a mesh only when applied
        return Transformer(cfg, rngs=nnx.Rngs(params=seed))


def model_from_params(cfg, params) -> Transformer:
    """A model holding `params` (an nnx.State, e.g. from `maxlite.checkpoints.load_params` or a
    TrainState's `.params`), outside any mesh."""
    from maxlite.state import abstract_params

    config_checks.check_platform(cfg, jax.devices()[0].platform)
    graphdef, _ = abstract_params(cfg)
    return nnx.merge(graphdef, jax.tree.map(jnp.asarray, params))


def default_positions(inputs_BT) -> jax.Array:
    """0, 1, 2, ... along each row: one unpacked sequence per row."""
    B, T = inputs_BT.shape
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


def forward(model: Transformer, inputs_BT, positions_BT=None, segment_ids_BT=None) -> jax.Array:
    """logits_BTV (float32) for token ids [B, T]; positions default to 0..T-1 and segment ids to 1
    (each row one sequence), which is what packed training batches carry explicitly."""
    inputs_BT = jnp.asarray(inputs_BT, jnp.int32)
    if positions_BT is None:
        positions_BT = default_positions(inputs_BT)
    if segment_ids_BT is None:
        segment_ids_BT = jnp.ones(inputs_BT.shape, jnp.int32)
    return _apply(model, inputs_BT, positions_BT, segment_ids_BT)


@nnx.jit  # compiled once per model structure and shape, not op by op
def _apply(model, inputs_BT, positions_BT, segment_ids_BT):
    return model(inputs_BT, positions_BT, segment_ids_BT)


def make_batch(tokens_BS) -> dict[str, np.ndarray]:
    """A training batch (what `Built.train_step` takes) from token ids [B, T + 1]: inputs are the
    first T, targets the last T, every target counted (weights 1), one sequence per row."""
    tokens_BS = np.asarray(tokens_BS, np.int32)
    inputs_BT, targets_BT = tokens_BS[:, :-1], tokens_BS[:, 1:]
    B, T = inputs_BT.shape
    return {"inputs": inputs_BT, "targets": targets_BT,
            "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
            "segment_ids": np.ones((B, T), np.int32), "weights": np.ones((B, T), np.float32)}
