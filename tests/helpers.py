"""Small in-process training driver for tests: the library pieces the loop wires, on a device subset."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from maxlite import config as C, mesh as mesh_lib, optim, state as state_lib, step as step_lib
from maxlite.data.synthetic import make_synthetic_iterator


def build(argv, num_devices: int):
    cfg = C.resolve(C.load(argv), num_devices)
    mesh = mesh_lib.make_mesh(cfg, jax.devices()[:num_devices])
    tx, schedule = optim.make_optimizer(cfg), optim.learning_rate_schedule(cfg)
    graphdef, abstract, shardings = state_lib.abstract_state(cfg, mesh, tx)
    state = state_lib.create_state(cfg, mesh, tx, shardings)
    batch_sharding = mesh_lib.batch_sharding(mesh)
    step = step_lib.jit_train_step(cfg, graphdef, tx, schedule, shardings, batch_sharding)
    return cfg, mesh, state, step, batch_sharding


def train_losses(argv, num_devices: int, steps: int):
    """Losses of `steps` steps, and the final state (on host)."""
    cfg, mesh, state, step, batch_sharding = build(argv, num_devices)
    data = make_synthetic_iterator(cfg, "train", 0, 1)
    losses = []
    with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        for _ in range(steps):
            batch = {k: jax.device_put(v, batch_sharding) for k, v in next(data).items()}
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state)
