"""THE decision where a run starts, made once for every launcher, attempt and host.

In order:
1. this run's own newest complete state: an in-memory snapshot complete on all hosts
   (`inmemory_snapshot_period`) or its latest complete disk checkpoint; memory wins a tie (it is
   faster), the newer step wins otherwise;
2. `load_full_state_path`: another run's full state (params, optimizer, step, data position);
3. `load_parameters_path`: weights only, fresh optimizer, step 0;
4. a fresh sharded init.

The data position is applied here, once, with one compatibility check; everything else the run
needs from where it starts (the best-k `val_loss`) is restored on every path. The answer is
recorded in status.json as `resumed_from: {step, source}`, so tools and tests read a field.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from maxlite import checkpoints as ck
from maxlite import config as C
from maxlite.rundir import print_primary

SOURCES = ("memory", "checkpoint", "full_state", "params", "fresh")


@dataclasses.dataclass
class Start:
    state: Any  # TrainState on this run's mesh
    source: str  # one of SOURCES
    step: int
    where: str = ""  # the checkpoint or snapshot it came from
    seconds: float = 0.0

    def record(self) -> dict[str, Any]:
        """What status.json says under `resumed_from`."""
        return {"step": self.step, "source": self.source, "where": self.where, "seconds": round(self.seconds, 3)}


def decide(built, ckpt, data_iterator, process_index: int, primary: bool, memory=None) -> Start:
    """Where the run `built` (maxlite.build) starts. Collective when `memory` (the in-memory
    snapshots' `restore(abstract, newer_than)`) is given: every host calls it. Restores onto this
    run's mesh whatever mesh saved the state."""
    cfg, abstract, shardings = built.cfg, built.abstract, built.shardings
    start = time.perf_counter()
    disk_step, snapshot = _newest_own(built, ckpt, memory)
    if snapshot is not None:
        data_iterator.set_state(snapshot.data_state)  # this process's own: snapshots need the same hosts
        got = Start(snapshot.state, "memory", snapshot.step, snapshot.detail)
        _note_val_loss(ckpt, snapshot.step)
    elif disk_step >= 0:
        state = _restore_full(ckpt.path, disk_step, abstract, shardings, data_iterator, process_index)
        got = Start(state, "checkpoint", disk_step, f"{ckpt.path}/{disk_step}")
        _note_val_loss(ckpt, disk_step)
        meta = ck.read_meta(ckpt.path, disk_step) if primary else {}
        print_primary(primary, f"maxlite: resumed from step {disk_step} ({ck.checkpoint_name(meta, disk_step)}) "
                      f"in {ckpt.path} in {time.perf_counter() - start:.1f} s")
    elif cfg.load_full_state_path:
        root, step = ck.resolve_step_dir(cfg.load_full_state_path)
        state = _restore_full(root, step, abstract, shardings, data_iterator, process_index)
        got = Start(state, "full_state", step, f"{root}/{step}")
        print_primary(primary, f"maxlite: loaded the full state of step {step} from {root}")
    elif cfg.load_parameters_path:
        root, step = ck.resolve_step_dir(cfg.load_parameters_path)
        got = Start(_params_only(root, step, built.cfg, built.mesh, built.tx, abstract, shardings), "params", 0, f"{root}/{step}")
        print_primary(primary, f"maxlite: loaded parameters from {root}/{step}; fresh optimizer, starting at step 0")
    else:
        got = Start(built.init_state(), "fresh", 0)
    got.seconds = time.perf_counter() - start
    if got.source in ("memory", "checkpoint") and got.step >= cfg.steps:
        print_primary(primary, f"maxlite: already at step {got.step} of steps={cfg.steps}: nothing to train; "
                      f"raise steps= to train further")
    return got


def _newest_own(built, ckpt, memory, at_most: int | None = None):
    """(newest complete disk step or -1, the in-memory snapshot if it is at least as new, or None),
    of steps <= `at_most` when given. Collective when `memory` is given."""
    steps = ck.complete_steps(ckpt.path) if ckpt is not None else []
    disk_step = max((s for s in steps if at_most is None or s <= at_most), default=-1)
    snapshot = memory(built.abstract, disk_step, at_most) if memory is not None else None
    return disk_step, snapshot


def rollback(built, ckpt, memory, at_most: int) -> Start | None:
    """Where a run that went bad after step `at_most` goes back to: its newest own state at or
    before that step, by the rule `decide` uses (memory wins a tie, the newer step otherwise), with
    the data position left where it is (the batches since are skipped); None when there is none.
    Collective: every host calls it."""
    start = time.perf_counter()
    disk_step, snapshot = _newest_own(built, ckpt, memory, at_most)
    if snapshot is not None:
        got = Start(snapshot.state, "memory", snapshot.step, snapshot.detail)
    elif disk_step >= 0:
        state = _restore_full(ckpt.path, disk_step, built.abstract, built.shardings)
        got = Start(state, "checkpoint", disk_step, f"{ckpt.path}/{disk_step}")
    else:
        return None
    got.seconds = time.perf_counter() - start
    return got


def apply_data_state(data_iterator, saved: dict, process_index: int, where: str) -> None:
    """The one compatibility check of a saved data position: a global `position`
    (checkpoints.saver.data_record) fits a run of any number of processes; the per-process `states`
    of checkpoints from before it fit the same number of processes, or any number when they are all
    the same. The iterator then checks its own fingerprint (dataset, sequence length, global batch)."""
    import jax

    if "position" in saved:
        data_iterator.set_state(saved["position"])
        return
    states = saved.get("states") or []
    if not states:
        return
    count = jax.process_count()
    if len(states) == count:
        data_iterator.set_state(states[process_index])
    elif all(json.dumps(s, sort_keys=True) == json.dumps(states[0], sort_keys=True) for s in states):
        data_iterator.set_state(states[0])
    else:
        raise C.ConfigError(f"{where}: its data position was saved by {len(states)} processes, this run "
                            f"has {count}; resume with the same number of hosts")


def _note_val_loss(ckpt, step: int) -> None:
    """The eval loss the next save records (best-k retention ranks by it): the newest checkpoint's
    at or before `step`, whichever path the run resumed from."""
    if ckpt is None:
        return
    for s in reversed([s for s in ck.complete_steps(ckpt.path) if s <= step]):
        loss = ck.read_meta(ckpt.path, s).get("val_loss")
        if loss is not None:
            ckpt.note_eval(loss)
            return


def _restore_full(root: str, step: int, abstract, shardings, data_iterator=None, process_index: int = 0):
    """The state saved at `step`, and, given `data_iterator`, its data position applied."""
    from maxlite.state import TrainState

    targets = {"params": ck.sharded_target(abstract.params, shardings.params),
               "optimizer": ck.sharded_target({"step": abstract.step, "opt_state": abstract.opt_state},
                                              {"step": shardings.step, "opt_state": shardings.opt_state})}
    if data_iterator is not None:
        targets["data"] = None
    restored = ck.restore_items(root, step, targets)
    if data_iterator is not None:
        apply_data_state(data_iterator, restored.get("data") or {}, process_index, f"{root}/{step}")
    opt = restored["optimizer"]
    return TrainState(step=opt["step"], params=restored["params"], opt_state=opt["opt_state"])


def _params_only(root: str, step: int, cfg, mesh, tx, abstract, shardings):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from maxlite.mesh import RULES
    from maxlite.state import TrainState, fresh_adapters, join, split_trainable

    base, base_shardings = split_trainable(abstract.params)[1], split_trainable(shardings.params)[1]
    if base is None:  # no LoRA: every parameter comes from the checkpoint
        base, base_shardings = abstract.params, shardings.params
    params = ck.restore_items(root, step, {"params": ck.sharded_target(base, base_shardings)})["params"]
    if base is not abstract.params:  # LoRA on a base model: fresh adapters (B = 0: step 0 is the base)
        params = join(fresh_adapters(cfg, mesh, split_trainable(shardings.params)[0]), params)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(split_trainable(params)[0])
        zero = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
    return TrainState(step=zero, params=params, opt_state=opt_state)
