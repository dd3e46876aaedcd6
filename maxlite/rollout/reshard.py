"""Where the rollouts run, and the weights' way there.

Colocated (trainer_devices_fraction = sampler_devices_fraction = 1, the default): the rollout engine
samples with the trainer's own parameters on the trainer's mesh, alternating with the updates.

Separate (MaxText's split): the first `trainer_devices_fraction` of the devices train, the last
`sampler_devices_fraction` generate, on a mesh of their own shape — `rollout_data_parallelism`
replicas × `rollout_tensor_parallelism` shards (e.g. trainer fsdp 4 → rollout data 2 × tensor 2).
Each step the trainer's parameters are resharded onto it by `jax.device_put` (XLA moves each shard
device to device: no host copy, no checkpoint) and the seconds it took are logged
(`weight_push_seconds`). The shardings on the rollout mesh come from the same logical axes as the
trainer's (maxlite/state.py param_shardings), so a model file knows nothing of either mesh.

`push_estimate_seconds` is the planner's figure for a push between slices: every parameter byte
crosses the data-centre network once, each sending chip at its share of it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

from maxlite.config import ConfigError
from maxlite.config_checks_alignment import colocated
from maxlite.schema import MESH_AXES, parallelism_key


class Placement(NamedTuple):
    trainer: list  # the trainer's devices
    sampler: list  # the rollout engine's (the same list when colocated)

    @property
    def colocated(self) -> bool:
        return self.trainer == self.sampler


def split_devices(cfg, devices) -> Placement:
    """The trainer's and the sampler's devices (MaxText: the first and the last share); one line for
    shares that overlap or that leave a side with no device."""
    devices = list(devices)
    t, s = cfg.trainer_devices_fraction, cfg.sampler_devices_fraction
    if colocated(cfg):
        return Placement(devices, devices)
    n_t, n_s = int(len(devices) * t), int(len(devices) * s)
    if n_t < 1 or n_s < 1:
        raise ConfigError(f"trainer_devices_fraction={t}, sampler_devices_fraction={s} of {len(devices)} devices "
                          f"leave {n_t} to train and {n_s} to sample: each needs at least one")
    if n_t + n_s > len(devices):
        raise ConfigError(f"trainer_devices_fraction={t} + sampler_devices_fraction={s} overlap: "
                          "separate placement needs their sum ≤ 1 (both 1: colocated)")
    return Placement(devices[:n_t], devices[len(devices) - n_s:])


def rollout_config(cfg, num_devices: int):
    """`cfg` with the rollout mesh's shape: data × tensor over `num_devices`, every other axis 1."""
    tensor, data = cfg.rollout_tensor_parallelism, cfg.rollout_data_parallelism
    if num_devices % tensor:
        raise ConfigError(f"rollout_tensor_parallelism={tensor} does not divide the sampler's {num_devices} devices")
    data = num_devices // tensor if data == -1 else data
    if data * tensor != num_devices:
        raise ConfigError(f"rollout_data_parallelism={data} × rollout_tensor_parallelism={tensor} ≠ the sampler's "
                          f"{num_devices} devices")
    shape = {parallelism_key("ici", a): 1 for a in MESH_AXES} | {parallelism_key("dcn", a): 1 for a in MESH_AXES}
    shape.update({parallelism_key("ici", "data"): data, parallelism_key("ici", "tensor"): tensor})
    return dataclasses.replace(cfg, **shape)


def rollout_mesh(cfg, devices):
    from maxlite import mesh as mesh_lib

    return mesh_lib.make_mesh(rollout_config(cfg, len(devices)), devices)


class WeightPush:
    """Parameters from the trainer's mesh onto the rollout mesh: `push(params) -> (params there,
    seconds)`."""

    def __init__(self, params_like, mesh):
        from maxlite.state import param_shardings

        self.mesh = mesh
        self.shardings = param_shardings(params_like, mesh)

    def __call__(self, params):
        import jax

        started = time.perf_counter()
        moved = jax.block_until_ready(jax.device_put(params, self.shardings))
        return moved, time.perf_counter() - started


def push_estimate_seconds(param_bytes: float, chip, sender_chips: int, across_slices: bool = True) -> float:
    """Seconds to push `param_bytes` of weights from `sender_chips` chips to another group: over the
    data-centre network (another slice: each chip's share of it) or inside a slice (one ring's ICI
    bandwidth per chip). A lower bound: no overlap with anything else, no protocol cost."""
    per_chip_gbps = chip.dcn_gbps if across_slices else chip.ring_gbps
    return param_bytes / (sender_chips * per_chip_gbps * 1e9)
