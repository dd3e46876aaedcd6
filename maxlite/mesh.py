"""The device mesh, THE logical-axis rules table, and jax.distributed start-up from the environment."""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from maxlite.config import MESH_AXES, ConfigError

BATCH_AXES = ("data", "fsdp", "expert")  # the batch dimension is split over all three
LENGTH_AXIS = "context"  # the sequence dimension is split over it (long context)

# Every logical name used by the models appears exactly once (NNX resolves rules by dict lookup:
# a duplicate silently takes the last one, a missing name fails late). Parameters shard their
# `embed` dim over fsdp and context (ZeRO-3 style: a context axis never multiplies the weights'
# memory) and their head/mlp/vocab dims over tensor (Megatron style); activations shard batch over
# data×fsdp×expert, the sequence over context and the same head/mlp/vocab dims over tensor. The
# expert axis splits the experts (`exp`); for everything else it is data parallelism: the batch is
# split over it, the other weights are not (a MoE model's weights are mostly its experts', which
# are split over expert × fsdp × tensor; `embed_no_exp` is an expert's embed dimension).
RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # with pipeline stages the rows outside the pipeline (the output head, the loss) are split over
    # `stage` too: each stage computes the head for 1/P of its batch shard's rows (a local slice of
    # the pipeline's output, which every stage holds). Inside the pipeline, and for the embedding
    # that feeds it, a stage's rows are split over BATCH_AXES only (maxlite/models/pipeline.py).
    ("activation_batch", (*BATCH_AXES, "stage")),
    ("activation_stage", "stage"),  # the pipeline's buffer between stages
    ("activation_length", LENGTH_AXIS),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    ("embed", ("fsdp", LENGTH_AXIS)),
    ("embed_no_exp", ("fsdp", LENGTH_AXIS)),
    ("exp", "expert"),
    ("vocab", "tensor"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("position", None),
    ("layers", "stage"),  # a scanned stack's layer dim: consecutive layers per pipeline stage (maxlite/models/pipeline.py)
)


# Decoding (maxlite/generate.py): the same rules, but a few prompts are not split over the batch axes.
DECODE_RULES = tuple((name, None if name == "activation_batch" else axes) for name, axes in RULES)

def initialize_distributed() -> None:
    """Start jax.distributed when the environment describes several processes; must run first.

    Explicit (MAXLITE_COORDINATOR + MAXLITE_NUM_PROCESSES + MAXLITE_PROCESS_ID, used by the Ray
    workers and local multi-process runs) wins; otherwise Slurm with several tasks and TPU pods are
    detected by JAX itself. A single process does nothing.
    """
    if jax.distributed.is_initialized():
        return
    env = os.environ
    if "MAXLITE_COORDINATOR" in env and int(env.get("MAXLITE_NUM_PROCESSES", "1")) > 1:
        jax.distributed.initialize(
            coordinator_address=env["MAXLITE_COORDINATOR"],
            num_processes=int(env["MAXLITE_NUM_PROCESSES"]),
            process_id=int(env["MAXLITE_PROCESS_ID"]),
            local_device_ids=None,
        )
    elif int(env.get("SLURM_NTASKS", "1")) > 1:
        coordinator = env.get("MAXLITE_COORDINATOR")  # launcher-chosen; else JAX derives one
        jax.distributed.initialize(coordinator_address=coordinator) if coordinator else \
            jax.distributed.initialize()
    elif env.get("TPU_WORKER_HOSTNAMES", "").count(",") >= 1:
        jax.distributed.initialize()
    if jax.process_count() > 1 and jax.devices()[0].platform == "cpu":
        _connect_gloo_quietly()


def _connect_gloo_quietly() -> None:
    """Open the CPU (gloo) collectives between processes and across all devices now, with stdout
    silenced: gloo prints `[Gloo] Rank N is connected to ...` from C++ for every new group, once per
    local device, into the user's log. Groups of a subset of devices (e.g. data × fsdp meshes)
    still connect, and print, when first used."""
    import sys

    from jax.experimental import multihost_utils

    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    try:
        multihost_utils.sync_global_devices("maxlite: connect")  # one device per process
        mesh = Mesh(np.asarray(jax.devices()), ("all",))
        ones = jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("all")), np.ones(jax.local_device_count(), np.float32))
        jax.block_until_ready(jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, P()))(ones))
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def num_slices_of(devices) -> int:
    return len({getattr(d, "slice_index", 0) for d in devices})


def make_mesh(cfg, devices=None) -> Mesh:
    """Mesh over MESH_AXES (data, stage, fsdp, context, expert, tensor): ici axes within a slice, dcn axes
    across slices."""
    devices = list(jax.devices() if devices is None else devices)
    ici, dcn = cfg.parallelism("ici"), cfg.parallelism("dcn")
    if cfg.num_slices > 1:
        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
    else:
        try:
            grid = mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True)
        except (ValueError, NotImplementedError):  # CPU / unknown topology: plain order
            grid = np.asarray(devices).reshape(ici)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows over data×fsdp; with context parallelism the tokens of each row over `context` too (the
    [B, T] arrays of the lm objective, the only one config allows with context > 1)."""
    if mesh.shape[LENGTH_AXIS] > 1:
        return NamedSharding(mesh, P(BATCH_AXES, LENGTH_AXIS))
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


@functools.lru_cache(maxsize=None)
def readers(sharding: NamedSharding) -> tuple[int, int]:
    """(index, count) of this process among the data's readers: the batch's rows live in groups of
    processes whose devices hold the same rows (a sequence split across processes over context ×
    tensor: every process of the group holds some of its columns), and every process of a group
    reads the group's whole rows. Groups are numbered by their first row; without such sharing a
    group is one process. The data sources take this pair where they took (process_index,
    process_count)."""
    n = sharding.mesh.size  # a nominal shape every axis divides: only which rows, not how many
    rows: dict[int, set] = {}
    for device, index in sharding.devices_indices_map((n,) * max(1, len(sharding.spec))).items():
        rows.setdefault(device.process_index, set()).add(index[0].indices(n)[:2])
    groups = sorted({frozenset(r) for r in rows.values()}, key=min)
    if sum(map(len, groups)) != len(set().union(*groups)):  # a physical device order config.resolve cannot see
        raise ConfigError("the mesh gives processes overlapping but different rows of the batch; "
                          "make the devices that share a sequence whole processes or part of one")
    return groups.index(frozenset(rows[jax.process_index()])), len(groups)


def global_batch(local: dict, sharding: NamedSharding) -> dict:
    """This process's rows of a batch (its reader's, `readers`) → global arrays split like
    `sharding`: the global batch has one such block of rows per reader, and each device takes its
    columns from its process's rows. Entries named `host_…` (GRPO's records, which its reward
    functions read) stay host data: only the sampler's driver uses them, never a compiled step."""
    count = readers(sharding)[1]
    return {k: v if k.startswith("host_") else jax.make_array_from_process_local_data(
                sharding, v, (v.shape[0] * count, *v.shape[1:]))
            for k, v in local.items()}
