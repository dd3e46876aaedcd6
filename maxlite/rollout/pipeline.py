"""Which rollouts a GRPO step trains on, where they are generated and when.

Synchronous (`off_policy_steps: 0`): step t samples its own prompts with the weights it starts from,
then trains on them. With separate placement (maxlite/rollout/reshard.py) the weights are first
pushed onto the sampler's mesh and the prompts sampled there.

Asynchronous (`off_policy_steps: k`, MaxText's name; separate placement): while step t trains, a
background thread samples the next prompt batches of the run's data (read ahead of the loop,
maxlite/data/lookahead.py) on the sampler's devices with the weights pushed at step t: the k batches
after the last one step t took, so whichever later step takes one — the next step's own batch, or a
batch DAPO's refill draws (objectives/grpo.py) — it takes it at most k updates after the push
(each step takes at least one batch). Step u's rollout is of weights v(u) ≥ max(u − k, r(u)), where
r(u) is the last restart at or before u. The loss corrects for the lag with the sampler's
log-probabilities (truncated importance sampling, objectives/rl_loss.py); `rollout_staleness` logs
u − v(u) (the stalest batch the step took). A batch not sampled ahead is sampled when taken, with the
step's own weights.

Rollout workers (`rollout_workers: N`, maxlite/rollout/actors.py): the sampler is N Ray actors; the
push is one `ray.put` of the weights on the loop's thread, and the background thread waits on the
actors while the trainer keeps every device.

Restarts, r: the run's first step (fresh, resumed or rolled back) and every checkpoint step
(multiples of `checkpoint_period`): no batch that a step at or past the next checkpoint step could
take is sampled before that step, so the steps after a checkpoint sample with the weights saved in
it, and a run resumed from that checkpoint samples exactly what the uninterrupted run sampled (the
sampling key is a function of (seed, the batch's position in the run's data)). The cost is one
synchronous step per checkpoint. A resume from a save at another step (SIGTERM, preemption) starts
its pipeline there: its first k steps sample with fresher weights than the uninterrupted run did.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time

import jax

from maxlite.config import ConfigError


class RolloutPipeline:
    """`take(params, batch, step) -> (scored rollout of step `step`, figures)`."""

    def __init__(self, cfg, rollout, sampling_key, params_like, trainer_devices):
        from maxlite import mesh as mesh_lib
        from maxlite.rollout import reshard

        self.cfg, self.rollout, self.key = cfg, rollout, sampling_key
        self.k = cfg.off_policy_steps
        placement = reshard.split_devices(cfg, jax.devices())
        self.workers = rollout.engine if cfg.rollout_workers else None  # actors.WorkerPool: the actors are the sampler
        assert jax.process_count() == 1 or not (self.k or not placement.colocated or self.workers), \
            "config_checks refuses these on several processes"
        if self.k and not self.workers and placement.trainer[0].platform == "cpu" and \
                2 * (len(placement.trainer) + len(placement.sampler)) > len(jax.devices()):
            # XLA:CPU runs every device's share of a program on one pool of max(cores, devices) threads:
            # two programs with collectives at once (4 + 4 of 8 devices, seen) can each hold threads
            # the other's collective waits for, and XLA aborts the process after 40 s
            raise ConfigError(f"off_policy_steps on CPU: the trainer's {len(placement.trainer)} and the sampler's "
                              f"{len(placement.sampler)} devices may use at most half of the {len(jax.devices())}: "
                              "lower trainer_devices_fraction / sampler_devices_fraction")
        self.push = None
        if not placement.colocated:
            assert list(trainer_devices) == placement.trainer, "the trainer is built on its own share"
            mesh = reshard.rollout_mesh(cfg, placement.sampler)
            self.push, self.batch_sharding = reshard.WeightPush(params_like, mesh), mesh_lib.batch_sharding(mesh)
        self.pool = concurrent.futures.ThreadPoolExecutor(1, "rollouts") if self.k else None
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.upcoming = None  # peek(i) → the i-th data batch after the loop's (set by read_ahead)
        self.pushed = None  # (step, the weights where the sampler reads them, the push's seconds)

    def restart(self) -> None:
        """Drop what is in flight (resume, rollback): the next step starts the pipeline again."""
        for future in self.pending.values():
            future.cancel()
        for future in self.pending.values():
            if not future.cancelled():
                future.exception()  # wait: a sample in flight still holds the old weights' buffers
        self.pending.clear()
        self.pushed = None

    def _next_restart(self, step: int) -> float:
        period = self.cfg.checkpoint_period
        return (step // period + 1) * period if period > 0 else float("inf")

    def _sample(self, params, batch, position: int, version: int, pushed_seconds: float):
        """The rollout of data batch `position` with the weights of step `version`, and its figures."""
        if self.push is not None:  # onto the sampler's mesh (one process: placement refuses more)
            batch = {k: v if k.startswith("host_") else jax.device_put(v, self.batch_sharding) for k, v in batch.items()}
        started = time.perf_counter()
        with self._on_sampler():
            got = self.rollout(params, batch, self.key(position))  # the key made on the sampler's mesh
        figures = {"version": version, "weight_push_seconds": pushed_seconds,
                   "rollout_seconds": time.perf_counter() - started}
        if self.workers is not None:
            figures["rollout_worker_restarts"] = self.workers.restarts  # actors replaced so far
            figures["rollout_worker_hangs"] = self.workers.hangs  # of which for a hang (the rest died)
        return got, figures

    def _on_sampler(self):
        """The sampler's mesh and the logical rules (JAX's and Flax's contexts are per thread: the
        background thread has neither, the loop's thread has the trainer's mesh)."""
        if self.push is None:
            return contextlib.nullcontext()
        from flax import nnx

        from maxlite import mesh as mesh_lib

        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.push.mesh))
        stack.enter_context(nnx.logical_axis_rules(mesh_lib.RULES))
        return stack

    def _pushed(self, params, step: int):
        """The weights of step `step` where the sampler reads them, pushed once per step; on the loop's
        thread, before the update donates them."""
        if self.pushed is None or self.pushed[0] != step:
            if self.workers is not None:  # one host copy into Ray's object store
                there, seconds = self.workers.push(params)
            else:
                there, seconds = (params, 0.0) if self.push is None else self.push(params)
            self.pushed = (step, there, seconds)
        return self.pushed[1], self.pushed[2]

    def take(self, params, batch: dict, step: int, position: int):
        """The rollout of data batch `position` (`batch`: its global batch), taken by step `step`, and its
        figures: sampled ahead, or now with the step's weights. The step's own batch and each batch a
        refill draws, in the order the step takes them."""
        if position in self.pending:
            got, figures = self.pending.pop(position).result()
        else:
            there, seconds = self._pushed(params, step)
            if self.pool is None:
                got, figures = self._sample(there, batch, position, step, seconds)
            else:  # on the sampler's thread, as every sample of an asynchronous run
                got, figures = self.pool.submit(self._sample, there, batch, position, step, seconds).result()
        return got, {"rollout_staleness": step - figures.pop("version"), **figures}

    def ahead(self, params, step: int, position: int) -> None:
        """Asynchronous: start the samples of the k batches from data position `position` (the next the
        loop takes) that are not in flight, with step `step`'s weights — none that a step at or past
        the next checkpoint step could take."""
        if self.pool is None:
            return
        count = int(min(self.k, self._next_restart(step) - 1 - step, self.cfg.steps - 1 - step))
        todo = [q for q in range(position, position + count) if q not in self.pending]
        for q in todo:
            upcoming = self.upcoming(q - position)
            if upcoming is None:  # the data ends there
                break
            there, seconds = self._pushed(params, step)  # one push serves every sample started at this step
            self.pending[q] = self.pool.submit(self._sample, there, upcoming, q, step, seconds)
