"""Compile the recipe's real train step for a topology (no TPU, nothing allocated) and read the result.

The step, state, optimizer, mesh and rules are the trainer's own (`maxlite.build.wire`): what is
planned is what would run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import tempfile
import time
from typing import Any

from maxlite import config as C
from maxlite.plan import buffers, estimate as estimate_lib, hlo
from maxlite.plan.topology import Topology, devices as topology_devices

_RECIPE_KEYS = ("model_name", "per_device_batch_size", "max_target_length", "gradient_accumulation_steps",
                "remat_policy", "weight_dtype", "grad_dtype", "dtype", "scan_layers", "attention", "num_vocab_tiling",
                "quantization")
_BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "weights")
# libtpu 0.0.42: "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO
# temporaries (82.77G) exceeds available HBM (31.25G)." (G = GiB); older: "Used 45.3G of 31.2G hbm"
_OOM_USED = re.compile(r"(?:Used|required for [^(]*\() ?([\d.]+)([KMGT])\)? (?:of|exceeds available HBM \()"
                       r" ?([\d.]+)([KMGT])")
_OOM_AVAIL = re.compile(r"available HBM \(([\d.]+)([KMGT])\)")
_UNIT = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


@dataclasses.dataclass
class Plan:
    """Everything the report says about one recipe on one topology (bytes are per device)."""
    topology: str
    num_chips: int
    num_devices: int
    mesh: dict[str, int]
    dcn: dict[str, int]
    ici: dict[str, int]
    overrides: list[str]
    recipe: dict[str, Any]          # the resolved keys the report quotes
    fits: bool
    param_count: int
    param_bytes_total: int          # eval_shape count × dtype size, whole model
    param_bytes: int                # this device's shard
    optimizer_bytes: int
    batch_bytes: int
    state_bytes_total: int          # params + gradients + optimizer, whole model
    peak_bytes: float | None        # compiler's peak (fits) or its "Used" figure (does not fit)
    usable_bytes: float | None      # what the compiler may use (libtpu's HBM limit, from its error)
    temp_bytes: float | None        # temporaries at peak: activations, gradients, gathered weights
    flops_formula: float            # training FLOPs per step, all devices (MaxText formula)
    flops_compiler: float | None    # per device, XLA's count (a scanned layer body counted once)
    bytes_accessed: float | None    # per device, XLA's count (same caveat)
    hbm_bytes: float | None = None  # per device, from the HLO with loops unrolled (hlo.hbm_bytes)
    host_bytes: float = 0.0         # per device, temporaries offloaded to host memory (remat offload policies)
    collectives: dict[str, dict] = dataclasses.field(default_factory=dict)
    custom_calls: dict[str, int] = dataclasses.field(default_factory=dict)  # kernels run per step
    param_shardings: dict[str, str] = dataclasses.field(default_factory=dict)
    data_axis_slices: list[list[int]] = dataclasses.field(default_factory=list)
    error: str = ""
    compile_seconds: float = 0.0
    estimate: dict[str, Any] = dataclasses.field(default_factory=dict)
    # the compiled step's largest allocations (maxlite/plan/buffers.py): {bytes, values, shapes}
    largest_buffers: list[dict] = dataclasses.field(default_factory=list)

    @property
    def over_bytes(self) -> float:
        if self.fits or self.peak_bytes is None or self.usable_bytes is None:
            return 0.0
        return self.peak_bytes - self.usable_bytes


def resolve(args: list[str], topology: Topology, overrides: list[str] = ()) -> C.Config:
    """The recipe (YAML + key=value + planner overrides) resolved for the topology's devices."""
    cfg = C.load([*args, *overrides, f"num_slices={topology.num_slices}"])
    # one JAX device per chip (v4 / v5p are planned in megacore mode; Ironwood has two); one planning process
    return C.resolve(cfg, topology.num_devices, topology.num_slices, 1, "tpu")


def _shard_bytes(abstract, shardings) -> int:
    import jax
    import numpy as np

    total = 0
    for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
        total += math.prod(s.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
    return total


def _spec_table(abstract_params, shardings) -> dict[str, str]:
    import jax

    flat_a = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    flat_s = jax.tree.leaves(shardings)
    out = {}
    for (path, a), s in zip(flat_a, flat_s):
        name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        name = name.removesuffix("/value").removesuffix("/.value")
        out[name] = f"{list(a.shape)} {tuple(s.spec)}"
    return out


def _data_axis_slices(mesh) -> list[list[int]]:
    """For each position along `data`, the slice indices of its devices (one each when data spans slices)."""
    import numpy as np

    grid = np.vectorize(lambda d: getattr(d, "slice_index", 0))(mesh.devices)
    return [sorted(set(grid[i].ravel().tolist())) for i in range(grid.shape[0])]


def _oom(message: str) -> tuple[float | None, float | None]:
    used, avail = _OOM_USED.search(message), _OOM_AVAIL.search(message)
    peak = float(used.group(1)) * _UNIT[used.group(2)] if used else None
    usable = (float(used.group(3)) * _UNIT[used.group(4)] if used else
              float(avail.group(1)) * _UNIT[avail.group(2)] if avail else None)
    return peak, usable


def compile_plan(args: list[str], topology: Topology, overrides: list[str] = (), dump_hlo: str = "") -> Plan:
    """Resolve, build the mesh on the topology's devices, lower and compile the train step; with
    `dump_hlo`, XLA's dump of that compilation (the optimized program as text, its buffer assignment)
    is kept in that folder."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from maxlite import mesh as mesh_lib, state as state_lib
    from maxlite.build import wire
    from maxlite.models.flops import param_count, train_flops_per_step
    from maxlite.models.loss import num_chunks

    cfg = resolve(args, topology, overrides)
    requested = C.load([*args, *overrides])  # what the recipe asked for (`attention: autoselected`)
    devs = topology_devices(topology)
    built = wire(cfg, devs)  # the trainer's own wiring: what is planned is what would run
    mesh, abstract, shardings, batch_sharding = built.mesh, built.abstract, built.shardings, built.batch_sharding
    B, T = cfg.global_batch_size, cfg.max_target_length
    shapes = {k: ((B, T), "float32" if k == "weights" else "int32") for k in _BATCH_KEYS}
    if cfg.vision_encoder:  # the image arrays a packed batch holds (and multimodal positions)
        from maxlite.data.image_docs import kind_of
        shapes.update(kind_of(cfg).batch_shapes(B, T))
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=batch_sharding)
             for k, (shape, dtype) in shapes.items()}
    state_in = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, shardings)
    param_total = state_lib.nbytes(abstract.params)
    plan = Plan(
        topology=topology.describe(), num_chips=topology.num_chips, num_devices=len(devs),
        mesh=dict(zip(mesh.axis_names, mesh.devices.shape)),
        dcn=dict(zip(C.MESH_AXES, cfg.parallelism("dcn"))),
        ici=dict(zip(C.MESH_AXES, cfg.parallelism("ici"))), overrides=list(overrides),
        recipe={k: getattr(cfg, k) for k in _RECIPE_KEYS} | {"global_batch_size": cfg.global_batch_size,
                                                             "loss_chunks": num_chunks(cfg, T, cfg.axis_size("context")),
                                                             "attention_requested": requested.attention,
                                                             "pipeline": cfg.pipeline_schedule,
                                                             "mu_dtype": cfg.first_moment_dtype},
        fits=False,
        param_count=param_count(abstract.params),
        param_bytes_total=param_total,
        param_bytes=_shard_bytes(abstract.params, shardings.params),
        optimizer_bytes=_shard_bytes(abstract.opt_state, shardings.opt_state),
        batch_bytes=sum(math.prod(batch_sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in batch.values()),
        state_bytes_total=param_total + state_lib.grad_nbytes(cfg, abstract.params) + state_lib.nbytes(abstract.opt_state),
        peak_bytes=None, usable_bytes=None, temp_bytes=None,
        flops_formula=train_flops_per_step(cfg), flops_compiler=None, bytes_accessed=None,
        param_shardings=_spec_table(abstract.params, shardings.params),
        data_axis_slices=_data_axis_slices(mesh))

    step = built.train_step
    started = time.perf_counter()
    dump = contextlib.nullcontext(dump_hlo) if dump_hlo else tempfile.TemporaryDirectory(prefix="maxlite-plan-")
    try:
        with dump as dump_dir, jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
            try:
                compiled = step.lower(state_in, batch).compile(
                    compiler_options=buffers.compiler_options(dump_dir, text=bool(dump_hlo)))
            finally:  # the buffer assignment is written for a program that runs out of memory too
                plan.largest_buffers = buffers.largest(dump_dir)
    except Exception as e:  # XlaRuntimeError RESOURCE_EXHAUSTED: the program does not fit
        message = str(e)
        plan.compile_seconds = time.perf_counter() - started
        if "RESOURCE_EXHAUSTED" not in message and "exceeds available" not in message:
            from jax.errors import JaxRuntimeError
            if not isinstance(e, JaxRuntimeError):
                raise
            # the compiler itself failed on this layout (seen: libtpu INTERNAL on offloaded layer inputs
            # inside a pipeline's loop): a plan that cannot be compiled, said in one line, not a crash
            plan.error = "the compiler failed: " + " ".join(message.split())[:300]
            return plan
        plan.peak_bytes, plan.usable_bytes = _oom(message)
        plan.error = next((ln.strip() for ln in message.splitlines() if "RESOURCE_EXHAUSTED" in ln),
                          message.splitlines()[0])[:300]
        return plan
    plan.compile_seconds = time.perf_counter() - started
    plan.fits = True
    memory = compiled.memory_analysis()
    plan.peak_bytes = float(memory.peak_memory_in_bytes)
    plan.host_bytes = float(memory.host_temp_size_in_bytes)
    if plan.host_bytes:
        # with offloaded temporaries libtpu's peak is no HBM figure: the pipelined-out 405B plan (fsdp 512,
        # offload_layer_inputs) gave peak = arguments + host temporaries (43.39 GB of which 33.82 GB on the
        # host) for a program whose HBM holds at most arguments + HBM temporaries (29.04 GB); the smaller
        # of the two bounds what HBM holds
        plan.peak_bytes = min(plan.peak_bytes, float(memory.argument_size_in_bytes + memory.temp_size_in_bytes))
    plan.temp_bytes = max(0.0, plan.peak_bytes - memory.argument_size_in_bytes)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    plan.flops_compiler = float(cost.get("flops", 0.0))
    plan.bytes_accessed = float(cost.get("bytes accessed", 0.0))
    text = compiled.as_text()
    plan.collectives = {k: c.to_dict() for k, c in hlo.collectives(text).items()}
    plan.hbm_bytes = hlo.hbm_bytes(text)
    plan.custom_calls = hlo.custom_calls(text)
    plan.estimate = estimate_lib.estimate(plan, cfg, topology.chip, topology.num_slices)
    return plan
