"""TrainState and its sharded creation: eval_shape → shardings → jit(out_shardings); nothing whole on one device."""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxlite import hostmem
from maxlite.config import ConfigError
from maxlite.mesh import RULES
from maxlite.models import Transformer


@struct.dataclass
class TrainState:
    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState


def abstract_params(cfg) -> tuple[nnx.GraphDef, nnx.State]:
    """Shapes and dtypes of the parameters without a mesh (counting, conversion, planning)."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, params


def frozen(path, variable) -> bool:
    """An NNX filter: a parameter tagged to stay as it is (`frozen` metadata: a vision tower under
    vision_train=frozen, maxlite/models/vision/towers.py)."""
    return bool(variable.get_metadata().get("frozen", False))


def split_trainable(params) -> tuple[Any, Any]:
    """(what the optimizer updates, what stays frozen or None): with LoRA (maxlite/models/lora.py)
    the adapters against the frozen base weights; else every parameter but those tagged `frozen`."""
    adapters, base = split_adapters(params)
    if adapters is not None:
        return adapters, base
    still, rest = nnx.split_state(params, frozen, ...)
    return (rest, still) if jax.tree.leaves(still) else (params, None)


def split_adapters(params) -> tuple[Any, Any]:
    """(the LoRA adapters, the base weights), or (None, params) for a model without adapters."""
    from maxlite.models.lora import LoRAParam
    adapters, base = nnx.split_state(params, LoRAParam, ...)
    return (adapters, base) if jax.tree.leaves(adapters) else (None, params)


def join(trainable, frozen):
    return trainable if frozen is None else nnx.merge_state(trainable, frozen)


def init_compiler_options() -> dict | None:
    """XLA:CPU compiles an initialiser (counter-based random bits for every parameter, then the
    optimizer's zeros) at LLVM -O1 instead of its default -O3: the same bytes (every case of
    tests/data/family_table.json, which XLA's defaults wrote) in a third to a half of the compile's CPU
    time, and runs about as fast (gpt3-126m: compile 3.46 → 1.10 CPU-s, run 1.40 → 1.50 s;
    benchmarks/results/init_compile.json). A level the user set in XLA_FLAGS is kept; other platforms
    keep their compiler's defaults."""
    if jax.default_backend() != "cpu" or "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""):
        return None
    return {"xla_backend_optimization_level": 1}


def fresh_adapters(cfg, mesh: Mesh, shardings):
    """The LoRA adapters a fresh run starts with (same key as create_state), sharded; the base
    weights' initialisation is dead code XLA drops."""
    def init(key):
        model = Transformer(cfg, rngs=nnx.Rngs(params=key))
        return split_adapters(nnx.split(model, nnx.Param)[1])[0]
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        return jax.jit(init, out_shardings=shardings, compiler_options=init_compiler_options())(
            jax.random.key(cfg.seed))


def _init_fn(cfg, tx):
    def init(key):
        model = Transformer(cfg, rngs=nnx.Rngs(params=key))
        _, params = nnx.split(model, nnx.Param)
        opt_state = tx.init(split_trainable(params)[0])
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)
    return init


def param_shardings(params, mesh: Mesh):
    """Each parameter's sharding on `mesh`, from its logical axes (the training mesh's, or a rollout
    mesh of another shape: maxlite/rollout/reshard.py)."""
    with nnx.logical_axis_rules(RULES):  # logical names → mesh axes
        specs = nnx.get_partition_spec(params)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def state_shardings(abstract: TrainState, mesh: Mesh, tx) -> TrainState:
    """Params follow their logical axes; optimizer state follows the params; scalars replicate."""
    replicated = NamedSharding(mesh, P())
    params = param_shardings(abstract.params, mesh)
    opt = optax.tree_map_params(
        tx, lambda _, s: s, abstract.opt_state, split_trainable(params)[0],
        transform_non_params=lambda _: replicated, is_leaf=lambda x: isinstance(x, nnx.Variable))
    # optax.partition (opt_type=muon) leaves empty MaskedNode placeholders where the other half's
    # parameters are; tree_map_params puts a sharding there: keep the state's own (leafless) node
    opt = jax.tree.map(lambda a, s: a if isinstance(a, optax.MaskedNode) else s, abstract.opt_state, opt,
                       is_leaf=lambda x: isinstance(x, optax.MaskedNode))
    return TrainState(step=replicated, params=params, opt_state=opt)


def abstract_state(cfg, mesh: Mesh, tx) -> tuple[nnx.GraphDef, TrainState, TrainState]:
    """(graphdef, abstract state, state shardings); call inside `jax.set_mesh` + RULES."""
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        # the key is made inside eval_shape: a concrete key cannot be placed on an AOT topology mesh
        abstract = jax.eval_shape(lambda: _init_fn(cfg, tx)(jax.random.key(cfg.seed)))
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    return graphdef, abstract, state_shardings(abstract, mesh, tx)


def abstract_train_state(cfg, tx) -> TrainState:
    """Shapes and dtypes of the whole state without a mesh (a launcher's memory check)."""
    with nnx.use_eager_sharding(False):
        return jax.eval_shape(lambda: _init_fn(cfg, tx)(jax.random.key(cfg.seed)))


def create_state(cfg, mesh: Mesh, tx, shardings: TrainState) -> TrainState:
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        init = jax.jit(_init_fn(cfg, tx), out_shardings=shardings, compiler_options=init_compiler_options())
        return init(jax.random.key(cfg.seed))


def nbytes(tree: Any) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def grad_nbytes(cfg, params: Any) -> int:
    """The gradients' bytes, as step.gradients hands them to the optimizer: a float32 weight's in
    grad_dtype, any other in the weight's own dtype."""
    def size(x):
        return jnp.dtype(cfg.grad_dtype if x.dtype == jnp.float32 else x.dtype).itemsize
    return sum(x.size * size(x) for x in jax.tree.leaves(params))


def check_fits(cfg, abstract: TrainState, share: float | None = None, on_cpu: bool = False) -> None:
    """Refuse to allocate a state (params + grads + optimizer) that cannot fit; before any allocation.
    Host memory is what this process may use: the machine's, or its container's cgroup limit.
    `share`: the part of the state this host holds (default: its devices' part; a launcher whose
    workers all run on this host passes 1). `on_cpu`: the state lives in this host's memory (a
    launcher's driver, which must not start a JAX backend before it starts its workers: they would
    be forked from a multithreaded process)."""
    if not cfg.check_memory_fit:
        return
    devices = [] if on_cpu else jax.local_devices()
    if share is None:
        share = len(devices) / jax.device_count()  # this host's part of every sharded array
    state_bytes = nbytes(abstract) + grad_nbytes(cfg, abstract.params)  # + gradients, shaped as the params
    copy = nbytes(abstract) if cfg.enable_checkpointing and cfg.async_checkpointing else 0  # offload.py
    what = "parameters, gradients and optimizer state"
    if on_cpu or devices[0].platform == "cpu":  # device memory is host memory
        host = hostmem.memory()
        what += ", plus its copy while an async checkpoint is written," if copy else ""
        _refuse_above(cfg, abstract, (state_bytes + copy) * share, host.available, what, host.describe())
        return
    limit = (devices[0].memory_stats() or {}).get("bytes_limit", 0)
    if limit:
        _refuse_above(cfg, abstract, state_bytes / jax.device_count(), limit, what,
                      f"each {devices[0].device_kind} has {limit / 2**30:,.1f} GiB")
    if copy:  # an async save's host copy of this host's part of the state, in pinned host memory
        host = hostmem.memory()
        _refuse_above(cfg, abstract, copy * share, host.available,
                      "the host copy an async checkpoint writes from (async_checkpointing=false saves without it)",
                      host.describe())


def _refuse_above(cfg, abstract, need: float, have: float, what: str, where: str) -> None:
    if need > 0.9 * have:
        n_params = sum(x.size for x in jax.tree.leaves(abstract.params))
        raise ConfigError(
            f"model_name={cfg.model_name} ({n_params / 1e9:.2f}B params) needs ~{need / 2**30:,.1f} GiB "
            f"for {what} per host, but {where}; use more devices/hosts, a smaller model, or check the fit "
            f"first with `python -m maxlite.plan`")
