"""The loop's checkpointer: owns its schedule, saves asynchronously, surfaces storage failures.

Where a run starts (its own checkpoint, an in-memory snapshot, another run's state) is decided
in `maxlite.resume`.
"""

from __future__ import annotations

import json
import time
from typing import Any

from maxlite import checkpoints as ck
from maxlite import config as C
from maxlite.checkpoints import checksums, offload
from maxlite.checkpoints.layout import set_aside
from maxlite.outcome import CheckpointSaveError  # a save failed under checkpoint_error_policy=stop
from maxlite.rundir import print_primary, read_status


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


def data_record(states: list[Any]) -> dict[str, Any]:
    """What a checkpoint keeps of the data: one `position` in the global sample order, which any
    number of processes resumes from. Every source's position is global (each process reads its
    rows of the same global batches), so processes that disagree are out of step: that is a bug,
    and no checkpoint is better than one that would resume the wrong data."""
    first = json.dumps(states[0], sort_keys=True)
    for p, s in enumerate(states[1:], 1):
        if json.dumps(s, sort_keys=True) != first:
            raise RuntimeError(f"process {p}'s data position {json.dumps(s)[:200]} differs from process 0's "
                               f"{first[:200]}: the processes read different batches")
    return {"process_count": len(states), "position": states[0]}


class Checkpointer:
    """Periodic + final saves of (params, optimizer, data states, meta) into `checkpoint_dir(cfg)`."""

    def __init__(self, cfg, primary: bool, state_bytes: int, before_commit=None, checksums: bool = True):
        """`before_commit(step)`: called once a save's files are written, before Orbax marks it
        complete (fault injection: `Faults.in_checkpoint` dies there, leaving a torn save).
        `checksums=False` saves without them: only to measure what they cost (bench_checkpoint.py)."""
        import jax

        self.cfg, self.primary, self.state_bytes, self.checksums = cfg, primary, state_bytes, checksums
        self.process_bytes = state_bytes // jax.process_count()  # what this process writes, about
        self.path = ck.checkpoint_dir(cfg)
        if primary:
            ck.check_path(self.path)
            earlier = read_status(cfg.run_dir) or {}
            failed = {f["step"]: f["error"] for f in earlier.get("checkpoint_failures", [])}
            for name, why in ck.clean_leftovers(self.path, failed):
                print_primary(True, f"maxlite: removed incomplete checkpoint {name}, left by {why}")
            if "://" not in self.path:
                warning = ck.check_room(self.path, state_bytes, cfg.max_num_checkpoints_to_keep, self._saves())
                if warning:
                    print_primary(True, warning, err=True)
        # Async saves: a host copy written by our writer thread (offload.py); Orbax's own async
        # path only where the backend has no pinned host memory.
        self.writer = offload.Writer() if cfg.async_checkpointing and offload.host_kind_available() else None
        if self.writer is not None and jax.process_count() > 1:
            offload.use_coordination_barriers()
        options = ck.manager_options(cfg, async_save=self.writer is None)
        if before_commit is not None:
            options.temporary_path_class = ck.temporary_path_with_hook(self.path, before_commit)
        self.mngr = ck.open_manager(self.path, options)
        self.config_dict = C.to_plain_dict(cfg)  # the resolved config every save records
        self.val_loss: float | None = None
        self.pending: tuple[int, float, float] | None = None  # step, start time, seconds blocked
        self.blocked_seconds: list[float] = []
        self.failures: list[dict[str, Any]] = []  # {step, error} of every failed save of this attempt
        self.tried: int | None = None  # the step of the last save begun (a rollback's re-run saves anew)
        self.saved: list[int] = []  # steps this attempt saved completely

    def _saves(self) -> int:
        """How many saves the schedule makes over the whole run (at most)."""
        period, steps = self.cfg.checkpoint_period, self.cfg.steps
        saves = steps // period if period > 0 else 0
        final = self.cfg.save_checkpoint_on_completion and (period <= 0 or steps % period)
        return max(saves + bool(final), 1)

    def unrecovered_failures(self) -> list[dict[str, Any]]:
        """Failed saves with no complete save after them: the run has not kept what they held."""
        last_ok = max(self.saved, default=-1)
        return [f for f in self.failures if f["step"] > last_ok]

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
        """Save at `step` if the schedule says so; the loop waits only for the device→host copy.
        A step the schedule already tried is not tried again: the last step is due twice (its period,
        the run's completion), and once its save had failed the completion save failed a second time."""
        if not self.due(step) or self.has(step) or step == self.tried:
            return False
        return self.save(step, state, data_iterator)

    def save(self, step: int, state, data_iterator) -> bool:
        import jax

        self.poll(wait=True)  # one save at a time: report the previous one first
        self.tried = step
        if self.writer is None:
            jax.block_until_ready(state)  # Orbax's copy waits for the step in flight; time the save alone
        start = time.perf_counter()
        if self.writer is not None:
            state = offload.to_host(state)  # enqueued: the loop goes on while it copies
        cfg = self.cfg
        data = data_record(gather_json(data_iterator.get_state()))
        meta = {"step": step, "consumed_samples": step * cfg.global_batch_size,
                "tokens_seen": step * cfg.tokens_per_step, "val_loss": self.val_loss,
                "config": self.config_dict,
                "mesh_shape": dict(zip(C.MESH_AXES, cfg.mesh_shape)),
                "process_count": data["process_count"], "maxlite_version": ck.maxlite_version(),
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        json_items = {"data": data, "meta": meta} if self.primary else {}
        metrics = {"val_loss": self.val_loss} if self.val_loss is not None else None
        print_primary(self.primary, f"maxlite: saving checkpoint {ck.checkpoint_name(meta, step)} "
                           f"({self.state_bytes / 2**20:,.1f} MiB) → {self.path}")
        if self.writer is not None:
            self.writer.submit(lambda: self._write(step, lambda: self._args(state, data, meta, json_items), metrics))
        else:
            try:  # Orbax's own async save returns before the CRCs are done: the state may be donated next
                args = self._args(state, data, meta, json_items, wait=cfg.async_checkpointing)
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

    def _args(self, state, data, meta, json_items, wait: bool = False):
        """Orbax's save args, with this process's checksums of the bytes it is about to write:
        computed while Orbax writes them (the checksums item waits for them), or first (`wait`)."""
        import jax
        import orbax.checkpoint as ocp

        optimizer = {"step": state.step, "opt_state": state.opt_state}
        items = {}
        if self.checksums:
            record = checksums.record({"params": state.params, "optimizer": optimizer}, json_items,
                                      jax.process_index(), jax.process_count())
            items[checksums.ITEM] = checksums.save_args(record.result() if wait else record)
        return ocp.args.Composite(
            params=ck.array_save(state.params, self.process_bytes),
            optimizer=ck.array_save(optimizer, self.process_bytes),
            data=ocp.args.JsonSave(data), meta=ocp.args.JsonSave(meta), **items)

    def _write(self, step: int, make_args, metrics) -> None:
        """On the writer thread: the whole Orbax save of the host copy, until it is durable.
        `make_args()` builds the save args there (its checksums wait for the host copy)."""
        self.mngr.save(step, args=make_args(), metrics=metrics)
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

    def discard_after(self, step: int, why: str = "they hold the states being rolled back") -> list[int]:
        """Delete the checkpoints of steps after `step` (a rolled-back run's bad states, or corrupt
        ones: a later restart must not resume from them, and the steps run again save anew);
        returns them. Collective: every host calls it."""
        self.poll(wait=True)
        gone = [s for s in self.mngr.all_steps() if s > step]
        self.tried = None
        for s in gone:
            self.mngr.delete(s)
        self.saved = [s for s in self.saved if s <= step]
        if gone:
            print_primary(self.primary, f"maxlite: deleted checkpoint(s) of step(s) {', '.join(map(str, gone))}: "
                                        f"{why}")
        return gone

    def set_aside(self, steps: list[int]) -> list[str]:
        """Keep the complete steps found corrupt aside, renamed (checkpoints/layout.py: a damaged
        checksum record must not cost good weights); they are never restored. Collective: every
        host calls it; the primary renames."""
        self.poll(wait=True)
        names = [set_aside(self.path, s) for s in steps] if self.primary else []
        names = gather_json(names)[0]  # every host waits for the renames
        self.mngr.reload()
        self.saved = [s for s in self.saved if s not in steps]
        if names:
            print_primary(self.primary, f"maxlite: kept checkpoint step(s) {', '.join(map(str, steps))} aside as "
                                        f"{', '.join(names)} (corrupt: never restored; remove them with python -m "
                                        f"maxlite.checkpoints remove-corrupt {self.path})")
        return names

    def _failed(self, step: int, e: BaseException) -> None:
        earlier = [s for s in self.mngr.all_steps() if s != step]  # cached: the storage may be down
        intact = f"the previous checkpoint (step {earlier[-1]}) is intact" if earlier else "no earlier checkpoint"
        text = ck.error_line(e)
        error = f"{type(e).__name__}: {text}"  # tensorstore's code and its last clause: "No space left"
        self.failures.append({"step": step, "error": error})
        if self.primary and "://" not in self.path:
            # Local: remove the tmp dir now. Remote storage that just failed would make the loop wait
            # through the client's retries (minutes); the next start removes it, naming this failure.
            ck.remove_failed_save(self.path, step)
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
