"""The one wiring: config → mesh → optimizer → abstract state and shardings → the objective's steps.

Used by the training loop, the planner, the benchmarks and the tests, so what is planned,
benchmarked and tested is what runs. Building touches no device memory: the state itself comes
from `maxlite.resume` (a checkpoint, a snapshot) or `Built.init_state()` (a fresh sharded init).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from maxlite import config as C


@dataclasses.dataclass
class Built:
    cfg: C.Config  # resolved against the devices
    mesh: Any
    tx: Any  # optax transformation
    schedule: Callable  # step → learning rate
    graphdef: Any
    abstract: Any  # TrainState of ShapeDtypeStructs
    shardings: Any  # TrainState of NamedShardings
    batch_sharding: Any
    objective: Any  # maxlite.objectives.Objective: what the loop calls with each step's number
    cpu_matmul: Any = None  # maxlite.cpu_matmul.Choice on CPU (how cfg.cpu_matmul was chosen), else None

    @property
    def train_step(self) -> Callable:
        """The objective's main step, jitted with the state donated (what the planner lowers)."""
        return self.objective.compiled

    def init_state(self):
        """A fresh state, initialised sharded (never whole on one device)."""
        from maxlite import state as state_lib
        return state_lib.create_state(self.cfg, self.mesh, self.tx, self.shardings)


def build(cfg: C.Config, devices=None, num_processes: int | None = None) -> Built:
    """Resolve `cfg` against `devices` (default: all of this job's devices) and wire it onto them."""
    import jax

    from maxlite import mesh as mesh_lib

    devices = list(jax.devices() if devices is None else devices)
    if cfg.train_objective == "grpo":  # the trainer's own share when the rollouts have theirs
        from maxlite.rollout.reshard import split_devices
        devices = split_devices(cfg, devices).trainer
    cfg = C.resolve(cfg, len(devices), mesh_lib.num_slices_of(devices),
                    jax.process_count() if num_processes is None else num_processes, devices[0].platform)
    choice = _choose_cpu_matmul(cfg) if devices[0].platform == "cpu" else None
    if choice is not None:
        cfg = dataclasses.replace(cfg, cpu_matmul=choice.path)
    return dataclasses.replace(wire(cfg, devices), cpu_matmul=choice)


def _choose_cpu_matmul(cfg: C.Config):
    """The CPU product (maxlite/cpu_matmul.py): the first process's choice, so every process runs
    the same program."""
    import jax

    from maxlite import cpu_matmul

    choice = cpu_matmul.choose(cfg) if jax.process_index() == 0 else None
    if jax.process_count() > 1:
        from maxlite.checkpoints.saver import gather_json
        choice = cpu_matmul.Choice(**gather_json(dataclasses.asdict(choice) if choice else None)[0])
    return choice


def wire(cfg: C.Config, devices) -> Built:
    """Wire an already resolved `cfg` (`attention` resolved, the platform checked: `config.resolve`) onto `devices`
    (the planner's: a TPU topology's, compiled ahead of time from this CPU). The process then traces and
    compiles: its cycle collector runs less often from here on (maxlite/gc_policy.py)."""
    from maxlite import mesh as mesh_lib, objectives, optim, state as state_lib
    from maxlite.gc_policy import collect_less_often

    collect_less_often()

    # the CPU matmul path is set before anything traces (maxlite/models/matmul.py); a float32 model's product is the same on
    # both paths, so it leaves the process's path as it was
    if devices[0].platform == "cpu" and cfg.dtype != "float32":
        from maxlite.models import matmul
        matmul.use_cpu_path(cfg.cpu_matmul)
    mesh = mesh_lib.make_mesh(cfg, devices)
    tx, schedule = optim.make_optimizer(cfg), optim.learning_rate_schedule(cfg)
    graphdef, abstract, shardings = state_lib.abstract_state(cfg, mesh, tx)
    batch_sharding = mesh_lib.batch_sharding(mesh)
    objective = objectives.make_objective(cfg, graphdef, tx, schedule, shardings, batch_sharding)
    return Built(cfg, mesh, tx, schedule, graphdef, abstract, shardings, batch_sharding, objective)
