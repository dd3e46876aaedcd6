"""Which rollouts a GRPO step trains on, where they are generated and when.

Synchronous (`off_policy_steps: 0`): step t samples its own prompts with the weights it starts from,
then trains on them. With separate placement (maxlite/rollout/reshard.py) the weights are first
pushed onto the sampler's mesh and the prompts sampled there.

Asynchronous (`off_policy_steps: k`, MaxText's name; separate placement): while step t trains, a
background thread samples the prompts of steps t+1..t+k (read ahead of the loop, maxlite/data/
lookahead.py) on the sampler's devices with the weights pushed at step t, so step u trains on
completions of weights at most k updates old: version v(u) = max(u − k, r(u)), where r(u) is the
last restart at or before u. The loss corrects for the lag with the sampler's log-probabilities
(truncated importance sampling, objectives/rl_loss.py); `rollout_staleness` logs u − v(u).

Rollout workers (`rollout_workers: N`, maxlite/rollout/actors.py): the sampler is N Ray actors; the
push is one `ray.put` of the weights on the loop's thread, and the background thread waits on the
actors while the trainer keeps every device.

Restarts, r: the run's first step (fresh, resumed or rolled back) and every checkpoint step
(multiples of `checkpoint_period`): no rollout for a step at or past the next checkpoint step is
started before that step, so the steps after a checkpoint sample with the weights saved in it, and a
run resumed from that checkpoint samples exactly what the uninterrupted run sampled (the sampling
key is a function of (seed, step), as before). The cost is one synchronous step per checkpoint. A
resume from a save at another step (SIGTERM, preemption) starts its pipeline there: its first k
steps sample with fresher weights than the uninterrupted run did.
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
        if jax.process_count() > 1 and (self.k or not placement.colocated or self.workers):
            raise ConfigError("separate rollout placement, rollout_workers and off_policy_steps run in one "
                              f"process for now (this run has {jax.process_count()}): use one process, or the "
                              "colocated default")
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
        self.pushed = None  # the weights the last synchronous `take` sampled with, until the step's update

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

    def _sample(self, params, batch, step: int, version: int, pushed_seconds: float, key=None):
        if self.push is not None:  # onto the sampler's mesh (one process: placement refuses more)
            batch = {k: v if k.startswith("host_") else jax.device_put(v, self.batch_sharding) for k, v in batch.items()}
        started = time.perf_counter()
        with self._on_sampler():
            got = self.rollout(params, batch, self.key(step) if key is None else key())  # made on the sampler's mesh
        figures = {"rollout_staleness": step - version, "weight_push_seconds": pushed_seconds,
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

    def _pushed(self, params):
        """The weights where the sampler reads them; on the loop's thread, before the update donates them."""
        if self.workers is not None:  # one host copy into Ray's object store
            return self.workers.push(params)
        return (params, 0.0) if self.push is None else self.push(params)

    def take(self, params, batch: dict, step: int):
        """The rollout step `step` trains on (sampled now, or in flight since an earlier step) and its
        figures; starts the next ones. `batch`: the step's prompts (its global batch)."""
        if self.k == 0:
            there, seconds = self._pushed(params)
            self.pushed = there
            return self._sample(there, batch, step, step, seconds)
        if step not in self.pending:  # a restart: this step samples with the weights it starts from
            self.restart()
            there, seconds = self._pushed(params)
            self.pending[step] = self.pool.submit(self._sample, there, batch, step, step, seconds)
        got = self.pending.pop(step).result()
        stop = min(step + self.k, self._next_restart(step) - 1, self.cfg.steps - 1)
        todo = [u for u in range(step + 1, int(stop) + 1) if u not in self.pending]
        if todo:  # one push serves every rollout started at this step
            there, seconds = self._pushed(params)
            for u in todo:
                ahead = self.upcoming(u - step - 1)
                if ahead is None:
                    break
                self.pending[u] = self.pool.submit(self._sample, there, ahead, u, step, seconds)
        return got

    def again(self, batch: dict, step: int, key):
        """Another batch of prompts for step `step`, sampled under `key()` with the weights its `take`
        pushed (DAPO's refill, objectives/grpo.py: synchronous runs only, config_checks refuses the rest)."""
        assert self.k == 0 and self.pushed is not None, "a refill follows the step's synchronous take"
        return self._sample(self.pushed, batch, step, step, 0.0, key)[0]
