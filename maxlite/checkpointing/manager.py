"""The loop's checkpointer: owns its schedule, saves asynchronously, surfaces storage failures.

`initial_state` decides where a run starts: its own latest complete checkpoint (automatic
resume: state, step, data position), else `load_full_state_path`, else `load_parameters_path`
(weights only: fresh optimizer at step 0), else a fresh sharded init.
"""

from __future__ import annotations

import json
import time
from typing import Any

from maxlite import checkpoints as ck
from maxlite import config as C
from maxlite.checkpointing import offload
from maxlite.rundir import print_primary, read_status


class CheckpointSaveError(RuntimeError):
    """A save failed and checkpoint_error_policy=stop: the run ends (status failed), earlier checkpoints intact."""


def gather_json(obj: Any) -> list[Any]:
    """Every process's JSON-able `obj`, in process order (one small allgather; no-op on one process)."""
    import jax
    if jax.process_count() == 1:
        return [obj]
    import numpy as np
    from jax.experimental import multihost_utils as mu

    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = np.asarray(mu.process_allgather(np.array([raw.size], np.int32))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:raw.size] = raw
    rows = np.asarray(mu.process_allgather(padded))
    return [json.loads(bytes(rows[i, :sizes[i]])) for i in range(len(sizes))]


class Checkpointer:
    """Periodic + final saves of (params, optimizer, data states, meta) into `checkpoint_dir(cfg)`."""

    def __init__(self, cfg, primary: bool, state_bytes: int):
        import jax

        self.cfg, self.primary, self.state_bytes = cfg, primary, state_bytes
        self.process_bytes = state_bytes // jax.process_count()  # what this process writes, about
        self.path = ck.checkpoint_dir(cfg)
        if primary:
            ck.check_path(self.path)
            earlier = read_status(cfg.run_dir) or {}
            failed = {f["step"]: f["error"] for f in earlier.get("checkpoint_failures", [])}
            for name, why in ck.clean_leftovers(self.path, failed):
                print_primary(True, f"maxlite: removed incomplete checkpoint {name}, left by {why}")
        # Async saves: a host copy written by our writer thread (offload.py); Orbax's own async
        # path only where the backend has no pinned host memory.
        self.writer = offload.Writer() if cfg.async_checkpointing and offload.host_kind_available() else None
        if self.writer is not None and jax.process_count() > 1:
            offload.use_coordination_barriers()
        self.mngr = ck.open_manager(self.path, ck.manager_options(cfg, async_save=self.writer is None))
        self.config_dict = C.to_plain_dict(cfg)  # the resolved config every save records
        self.val_loss: float | None = None
        self.pending: tuple[int, float, float] | None = None  # step, start time, seconds blocked
        self.blocked_seconds: list[float] = []
        self.failures: list[dict[str, Any]] = []  # {step, error} of every failed save of this attempt
        self.saved: list[int] = []  # steps this attempt saved completely

    def unrecovered_failures(self) -> list[dict[str, Any]]:
        """Failed saves with no complete save after them: the run has not kept what they held."""
        last_ok = max(self.saved, default=-1)
        return [f for f in self.failures if f["step"] > last_ok]

    @property
    def latest_step(self) -> int | None:
        return self.mngr.latest_step()

    def has(self, step: int) -> bool:
        """A save of `step` exists or is under way (Orbax's own record: no listing of the storage)."""
        return (self.pending is not None and self.pending[0] == step) or step in self.mngr.all_steps()

    def note_eval(self, loss: float) -> None:
        """The val loss the next save records (and best-k retention ranks by)."""
        self.val_loss = loss

    def due(self, step: int) -> bool:
        period = self.cfg.checkpoint_period
        return (period > 0 and step % period == 0) or (
            step == self.cfg.steps and self.cfg.save_checkpoint_on_completion)

    def maybe_save(self, step: int, state, data_iterator) -> bool:
        """Save at `step` if the schedule says so; the loop waits only for the device→host copy."""
        if not self.due(step) or self.has(step):
            return False
        return self.save(step, state, data_iterator)

    def save(self, step: int, state, data_iterator) -> bool:
        import jax
        import orbax.checkpoint as ocp

        self.poll(wait=True)  # one save at a time: report the previous one first
        if self.writer is None:
            jax.block_until_ready(state)  # Orbax's copy waits for the step in flight; time the save alone
        start = time.perf_counter()
        if self.writer is not None:
            state = offload.to_host(state)  # enqueued: the loop goes on while it copies
        cfg = self.cfg
        data = {"process_count": None, "states": gather_json(data_iterator.get_state())}
        data["process_count"] = len(data["states"])
        meta = {"step": step, "consumed_samples": step * cfg.global_batch_size,
                "tokens_seen": step * cfg.tokens_per_step, "val_loss": self.val_loss,
                "config": self.config_dict,
                "mesh_shape": dict(zip(C.MESH_AXES, cfg.mesh_shape)),
                "process_count": data["process_count"], "maxlite_version": ck.maxlite_version(),
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        args = ocp.args.Composite(
            params=ck.array_save(state.params, self.process_bytes),
            optimizer=ck.array_save({"step": state.step, "opt_state": state.opt_state}, self.process_bytes),
            data=ocp.args.JsonSave(data), meta=ocp.args.JsonSave(meta))
        metrics = {"val_loss": self.val_loss} if self.val_loss is not None else None
        print_primary(self.primary, f"maxlite: saving checkpoint {ck.checkpoint_name(meta, step)} "
                           f"({self.state_bytes / 2**20:,.1f} MiB) → {self.path}")
        if self.writer is not None:
            self.writer.submit(lambda: self._write(step, args, metrics))
        else:
            try:
                self.mngr.save(step, args=args, metrics=metrics)
            except Exception as e:  # noqa: BLE001 — storage failures are reported, then policy decides
                self._failed(step, e)
                return False
        blocked = time.perf_counter() - start
        self.blocked_seconds.append(blocked)
        self.pending = (step, start, blocked)
        if not self.cfg.async_checkpointing:
            self.poll(wait=True)
        return True

    def _write(self, step: int, args, metrics) -> None:
        """On the writer thread: the whole Orbax save of the host copy, until it is durable."""
        self.mngr.save(step, args=args, metrics=metrics)
        self.mngr.wait_until_finished()

    def poll(self, wait: bool = False) -> None:
        """Report a finished save (or its failure); never waits unless `wait`."""
        if self.pending is None or (not wait and (self.writer.busy() if self.writer is not None
                                                  else self.mngr.is_saving_in_progress())):
            return
        step, start, blocked = self.pending
        self.pending = None
        try:
            if self.writer is not None:
                self.writer.wait()
            self.mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            self._failed(step, e)
            return
        seconds = time.perf_counter() - start
        self.saved.append(step)
        print_primary(self.primary, f"maxlite: saved checkpoint step {step}: {self.state_bytes / 2**20:,.1f} MiB "
                           f"in {seconds:.2f} s ({self.state_bytes / 2**20 / max(seconds, 1e-9):,.0f} MiB/s; "
                           f"the loop waited {blocked:.2f} s)")

    def _failed(self, step: int, e: BaseException) -> None:
        earlier = [s for s in self.mngr.all_steps() if s != step]  # cached: the storage may be down
        intact = f"the previous checkpoint (step {earlier[-1]}) is intact" if earlier else "no earlier checkpoint"
        text = (str(e).splitlines() or [""])[0][:300]
        error = f"{type(e).__name__}: {text}"
        self.failures.append({"step": step, "error": error})
        if self.primary:
            ck.remove_failed_save(self.path, step)  # best effort: the storage may still be down
        line = f"maxlite: checkpoint save at step {step} to {self.path} failed: {error}; {intact}"
        if self.cfg.checkpoint_error_policy == "stop":
            print_primary(self.primary, line + "; stopping (checkpoint_error_policy=stop)", err=True)
            raise CheckpointSaveError(line) from None
        print_primary(self.primary, line + "; training continues (checkpoint_error_policy=continue)", err=True)

    def close(self) -> None:
        try:
            self.poll(wait=True)  # reports the last save's outcome
        finally:
            if self.writer is not None:
                self.writer.close()
            try:
                self.mngr.close()
            except Exception:  # noqa: BLE001 — a failed save was already reported by poll()
                pass


def _restore_full(root: str, step: int, abstract, shardings, data_iterator, process_index: int):
    from maxlite.state import TrainState

    targets = {"params": ck.sharded_target(abstract.params, shardings.params),
               "optimizer": ck.sharded_target({"step": abstract.step, "opt_state": abstract.opt_state},
                                              {"step": shardings.step, "opt_state": shardings.opt_state}),
               "data": None}
    restored = ck.restore_items(root, step, targets)
    states = (restored.get("data") or {}).get("states") or []
    if states:
        if len(states) > process_index and (len(states) == _process_count() or _all_same(states)):
            data_iterator.set_state(states[process_index] if len(states) == _process_count() else states[0])
        else:
            raise C.ConfigError(f"{root}/{step}: its data position was saved by {len(states)} processes, "
                                f"this run has {_process_count()}; resume with the same number of hosts")
    opt = restored["optimizer"]
    return TrainState(step=opt["step"], params=restored["params"], opt_state=opt["opt_state"])


def _process_count() -> int:
    import jax
    return jax.process_count()


def _all_same(states: list) -> bool:
    return all(json.dumps(s, sort_keys=True) == json.dumps(states[0], sort_keys=True) for s in states)


def _params_only(cfg, mesh, tx, abstract, shardings):
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from maxlite.mesh import RULES
    from maxlite.state import TrainState

    root, step = ck.resolve_step_dir(cfg.load_parameters_path)
    params = ck.restore_items(root, step, {"params": ck.sharded_target(abstract.params, shardings.params)})["params"]
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(params)
        zero = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
    return TrainState(step=zero, params=params, opt_state=opt_state), f"{root}/{step}"


def initial_state(cfg, checkpointer: Checkpointer | None, mesh, tx, abstract, shardings, data_iterator,
                  process_index: int, primary: bool):
    """The state the run starts from, restoring onto this run's mesh whatever mesh saved it."""
    from maxlite.state import create_state

    if checkpointer is not None and checkpointer.latest_step is not None:
        step = checkpointer.latest_step
        start = time.perf_counter()
        state = _restore_full(checkpointer.path, step, abstract, shardings, data_iterator, process_index)
        meta = ck.read_meta(checkpointer.path, step) if primary else {}
        if meta.get("val_loss") is not None:
            checkpointer.note_eval(meta["val_loss"])
        print_primary(primary, f"maxlite: resumed from step {step} ({ck.checkpoint_name(meta, step)}) in "
                      f"{checkpointer.path} in {time.perf_counter() - start:.1f} s")
        if step >= cfg.steps:
            print_primary(primary, f"maxlite: already at step {step} of steps={cfg.steps}: nothing to train; "
                          f"raise steps= to train further")
        return state
    if cfg.load_full_state_path:
        root, step = ck.resolve_step_dir(cfg.load_full_state_path)
        state = _restore_full(root, step, abstract, shardings, data_iterator, process_index)
        print_primary(primary, f"maxlite: loaded the full state of step {step} from {root}")
        return state
    if cfg.load_parameters_path:
        state, where = _params_only(cfg, mesh, tx, abstract, shardings)
        print_primary(primary, f"maxlite: loaded parameters from {where}; fresh optimizer, starting at step 0")
        return state
    return create_state(cfg, mesh, tx, shardings)
