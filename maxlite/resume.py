"""THE decision where a run starts, made once for every launcher, attempt and host.

In order:
1. this run's own newest complete state: an in-memory snapshot complete on all hosts
   (`inmemory_snapshot_period`) or its latest complete disk checkpoint; memory wins a tie (it is
   faster), the newer step wins otherwise. A checkpoint whose bytes fail their checksums
   (checkpoints/checksums.py) is never restored: it is marked corrupt, said in one line, and the
   next older state is tried; the corrupt ones newer than where the run starts are kept aside,
   renamed `<step>.corrupt-<time>` (the run saves those steps again);
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
    corrupt: list = dataclasses.field(default_factory=list)  # {step, damaged, detail} passed over

    def record(self) -> dict[str, Any]:
        """What status.json says under `resumed_from`."""
        out = {"step": self.step, "source": self.source, "where": self.where, "seconds": round(self.seconds, 3)}
        if self.corrupt:
            out["corrupt"] = self.corrupt
        return out


def decide(built, ckpt, data_iterator, process_index: int, primary: bool, memory=None) -> Start:
    """Where the run `built` (maxlite.build) starts. Collective when `memory` (the in-memory
    snapshots' `restore(abstract, newer_than)`) is given: every host calls it. Restores onto this
    run's mesh whatever mesh saved the state."""
    cfg = built.cfg
    start = time.perf_counter()
    got, data_state, passed_over = _own_newest(built, ckpt, memory, None, data_iterator, process_index)
    if got is not None and got.source == "memory":
        data_iterator.set_state(data_state)  # this process's own: snapshots need the same hosts
        _note_val_loss(ckpt, got.step)
    elif got is not None:
        _note_val_loss(ckpt, got.step)
        meta = ck.read_meta(ckpt.path, got.step) if primary else {}
        print_primary(primary, f"maxlite: resumed from step {got.step} ({ck.checkpoint_name(meta, got.step)}) "
                      f"in {ckpt.path} in {time.perf_counter() - start:.1f} s")
    elif passed_over:
        steps = ", ".join(map(str, passed_over))
        raise C.ConfigError(f"every checkpoint in {ckpt.path} is corrupt (step(s) {steps}; "
                            f"`python -m maxlite.checkpoints list {ckpt.path}`): nothing intact to resume "
                            f"from; delete them (or pick another run_name) to start afresh")
    elif cfg.load_full_state_path:
        root, step = ck.resolve_step_dir(cfg.load_full_state_path)
        state = _restore_full(root, step, built, data_iterator, process_index)
        got = Start(state, "full_state", step, f"{root}/{step}")
        print_primary(primary, f"maxlite: loaded the full state of step {step} from {root}")
    elif cfg.load_parameters_path:
        root, step = ck.resolve_step_dir(cfg.load_parameters_path)
        got = Start(_params_only(root, step, built), "params", 0, f"{root}/{step}")
        print_primary(primary, f"maxlite: loaded parameters from {root}/{step}; fresh optimizer, starting at step 0")
    else:
        got = Start(built.init_state(), "fresh", 0)
    got.seconds = time.perf_counter() - start
    if got.source in ("memory", "checkpoint") and got.step >= cfg.steps:
        print_primary(primary, f"maxlite: already at step {got.step} of steps={cfg.steps}: nothing to train; "
                      f"raise steps= to train further")
    return got


def _own_newest(built, ckpt, memory, at_most: int | None, data_iterator=None, process_index: int = 0):
    """(Start or None, the snapshot's data state, the corrupt steps passed over) of this run's
    newest own state (of a step <= `at_most` when given): a snapshot or a checkpoint, by the rule
    in the module docstring. Given `data_iterator`, a checkpoint's data position is
    applied to it. Collective: every host calls it and reaches the same answer."""
    import jax

    primary = jax.process_index() == 0
    marked = ck.checksums.marked(ckpt.path) if ckpt is not None else {}  # found corrupt earlier
    skip = set(marked)
    corrupt = [{"step": s, "damaged": m.get("damaged", []), "detail": m.get("detail", ""),
                "found_by": m.get("found_by", "")} for s, m in sorted(marked.items(), reverse=True)]
    complete = ck.complete_steps(ckpt.path) if ckpt is not None else []
    while True:
        disk_step = max((s for s in complete if s not in skip and (at_most is None or s <= at_most)), default=-1)
        snapshot = memory(built.abstract, disk_step, at_most) if memory is not None else None
        if snapshot is not None:
            got = Start(snapshot.state, "memory", snapshot.step, snapshot.detail)
            break
        if disk_step < 0:
            return None, None, sorted(skip)
        try:
            state = _restore_verified(ckpt.path, disk_step, built, data_iterator, process_index, primary)
        except ck.CheckpointCorrupt as e:
            print_primary(primary, f"maxlite: checkpoint step {disk_step} in {ckpt.path} is corrupt: {e.what()}; "
                                   f"never restored: going back to an older state")
            if primary:
                ck.checksums.mark(ckpt.path, disk_step, e, by="resume")
            corrupt.append({"step": disk_step, "damaged": e.damaged, "detail": e.detail, "found_by": "resume"})
            skip.add(disk_step)
            continue
        got = Start(state, "checkpoint", disk_step, f"{ckpt.path}/{disk_step}")
        break
    got.corrupt = sorted((c for c in corrupt if got.step < c["step"] <= (at_most if at_most is not None else c["step"])),
                         key=lambda c: -c["step"])
    for c in got.corrupt:
        if c["found_by"] != "resume":
            print_primary(primary, f"maxlite: checkpoint step {c['step']} in {ckpt.path} was found corrupt earlier "
                                   f"({', '.join(c['damaged'][:6]) or c['detail']}; by {c['found_by']}): never restored")
    if any(s > got.step for s in skip):  # kept aside, renamed; the run saves those steps again
        ckpt.set_aside(sorted(s for s in skip if s > got.step and s in complete))
        ckpt.discard_after(got.step, why="newer than the state the run goes on from")
    return got, (snapshot.data_state if snapshot is not None else None), sorted(skip)


def _restore_verified(root: str, step: int, built, data_iterator, process_index: int, primary: bool):
    """A checkpoint's state; read a second time before it is called corrupt: a transient bad read
    (the storage or the network returned wrong bytes once) must not cost a good checkpoint."""
    try:
        return _restore_full(root, step, built, data_iterator, process_index)
    except ck.CheckpointCorrupt as e:
        first = e
    state = _restore_full(root, step, built, data_iterator, process_index)
    print_primary(primary, f"maxlite: warning: the first read of checkpoint step {step} in {root} failed "
                           f"verification ({first.what()}), the second passed: the storage returned wrong bytes once")
    return state


def rollback(built, ckpt, memory, at_most: int) -> Start | None:
    """Where a run that went bad after step `at_most` goes back to: its newest own state at or
    before that step, by the rule `decide` uses (memory wins a tie, the newer step otherwise;
    corrupt checkpoints passed over), with the data position left where it is (the batches since
    are skipped); None when there is none. Collective: every host calls it."""
    start = time.perf_counter()
    got, _, _ = _own_newest(built, ckpt, memory, at_most)
    if got is not None:
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


def _restore_full(root: str, step: int, built, data_iterator=None, process_index: int = 0):
    """The state saved at `step`, and, given `data_iterator`, its data position applied. Its
    optimizer state must be of this run's `opt_type`, unless `reset_optimizer_state` starts a fresh
    one on its weights and step: once, for a checkpoint saved by a run without the reset (a later
    resume of the reset run's own checkpoints keeps their state)."""
    from maxlite.state import TrainState

    abstract, shardings = built.abstract, built.shardings
    saved = ck.read_meta(root, step).get("config", {})
    reset = built.cfg.reset_optimizer_state and not saved.get("reset_optimizer_state", False)
    if not reset and saved.get("opt_type", "adamw") != built.cfg.opt_type:
        raise C.ConfigError(f"{root}/{step} holds the optimizer state of opt_type={saved.get('opt_type', 'adamw')}, "
                            f"this run has opt_type={built.cfg.opt_type}: resume with the checkpoint's, or add "
                            f"reset_optimizer_state=true to keep its weights and start a fresh optimizer state")
    targets = {"params": ck.sharded_target(abstract.params, shardings.params)}
    if not reset:
        targets["optimizer"] = ck.sharded_target({"step": abstract.step, "opt_state": abstract.opt_state},
                                                 {"step": shardings.step, "opt_state": shardings.opt_state})
    if data_iterator is not None:
        targets["data"] = None
    restored = ck.restore_items(root, step, targets, model=C.to_plain_dict(built.cfg))
    if data_iterator is not None:
        apply_data_state(data_iterator, restored.get("data") or {}, process_index, f"{root}/{step}")
    if reset:
        return _fresh_optimizer(restored["params"], step, built)
    opt = restored["optimizer"]
    return TrainState(step=opt["step"], params=restored["params"], opt_state=opt["opt_state"])


def _params_only(root: str, step: int, built):
    from maxlite.state import fresh_adapters, join, split_adapters

    cfg, mesh, abstract, shardings = built.cfg, built.mesh, built.abstract, built.shardings
    (adapters, base), base_shardings = split_adapters(abstract.params), split_adapters(shardings.params)[1]
    params = ck.restore_items(root, step, {"params": ck.sharded_target(base, base_shardings)},
                              model=C.to_plain_dict(cfg))["params"]
    if adapters is not None:  # LoRA on a base model: fresh adapters (B = 0: step 0 is the base)
        params = join(fresh_adapters(cfg, mesh, split_adapters(shardings.params)[0]), params)
    return _fresh_optimizer(params, 0, built)


def _fresh_optimizer(params, step: int, built):
    """A state of these weights at `step` with the run's optimizer freshly initialised, sharded."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from maxlite.mesh import RULES
    from maxlite.state import TrainState, split_trainable

    with jax.set_mesh(built.mesh), nnx.logical_axis_rules(RULES):
        opt_state = jax.jit(built.tx.init, out_shardings=built.shardings.opt_state)(split_trainable(params)[0])
        at = jax.device_put(jnp.asarray(step, jnp.int32), built.shardings.step)
    return TrainState(step=at, params=params, opt_state=opt_state)
