"""Periodic work as hooks: objects the loop calls, in one list, after every step and at the end.

A hook owns its own schedule (`every` steps, or its own rule, as the checkpointer does). New
periodic work — samples during training, loss-spike checks — is a new class in the list that
`train._setup` builds, not a change to the loop.

    after_step(step, state)       after step `step` (a count of completed steps) was dispatched
    save_now(step, state, why)    a complete save at once, waited for (preemption notice, final save)
    at_end(step, state, reason)   after the last step; `reason` is the agreed stop reason or None
    on_failure(error)             the run is ending with `error` (before status.json says failed)
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from maxlite import config as C
from maxlite.rundir import print_primary


class Hook:
    """Does nothing; subclasses override what they need."""

    def after_step(self, step: int, state) -> None:
        pass

    def save_now(self, step: int, state, why: str) -> None:
        pass

    def at_end(self, step: int, state, reason: str | None) -> None:
        pass

    def on_failure(self, error: BaseException) -> None:
        pass


class EvalHook(Hook):
    """Eval loss and perplexity every `eval_interval` steps, to every metric output and to listeners
    (the checkpointer records it; best-k retention ranks by it)."""

    def __init__(self, evaluator, logger, section: Callable, listeners: list[Callable[[float], None]]):
        self.evaluator, self.logger, self.section, self.listeners = evaluator, logger, section, listeners

    def after_step(self, step: int, state) -> None:
        if not self.evaluator.due(step):
            return
        with self.section("eval"):
            values = self.evaluator.run(state.params, state.opt_state)
        self.logger.log_eval(step, {k: v for k, v in values.items() if k not in ("tokens", "batches")})
        for listen in self.listeners if "loss" in values else ():  # GRPO's eval is a reward, not a loss
            listen(values["loss"])


class CheckpointHook(Hook):
    """The checkpointer's whole schedule: periodic async saves, the save on a preemption notice,
    the final save (at completion, or of a stopped run) — each inside the watchdog's section."""

    def __init__(self, ckpt, data_iterator, section: Callable, primary: bool, on_completion: bool):
        self.ckpt, self.data, self.section = ckpt, data_iterator, section
        self.primary, self.on_completion = primary, on_completion

    def after_step(self, step: int, state) -> None:
        with self.section("checkpoint"):
            self.ckpt.maybe_save(step, state, self.data)  # async: waits only to enqueue the host copy
            self.ckpt.poll()

    def save_now(self, step: int, state, why: str) -> None:
        with self.section("checkpoint"):
            print_primary(self.primary, f"maxlite: {why}: saving step {step} and waiting for it")
            if not self.ckpt.has(step):
                self.ckpt.save(step, state, self.data)
            self.ckpt.poll(wait=True)

    def at_end(self, step: int, state, reason: str | None) -> None:
        if reason == "lease_lost":  # the run directory is another launch's now: write nothing
            return
        if reason:  # preempted, max_time, straggler, interrupted: the final save, finished before we exit
            self.save_now(step, state, reason)
        elif self.on_completion:
            with self.section("checkpoint"):
                self.ckpt.maybe_save(step, state, self.data)  # e.g. steps was lowered on resume


class NoCheckpointHook(Hook):
    """enable_checkpointing=false: say so where a save would have been the only copy."""

    def __init__(self, primary: bool):
        self.primary = primary

    def save_now(self, step: int, state, why: str) -> None:
        print_primary(self.primary, f"maxlite: {why} at step {step}, but enable_checkpointing=false: nothing saved")

    def at_end(self, step: int, state, reason: str | None) -> None:
        if reason and reason != "lease_lost":
            self.save_now(step, state, reason)


class SnapshotHook(Hook):
    """In-memory snapshots every `inmemory_snapshot_period` steps (resilience/snapshot.py): the
    state and this process's data position, replicated to a peer host's memory."""

    def __init__(self, snapshots, data_iterator, section: Callable):
        self.snapshots, self.data, self.section = snapshots, data_iterator, section

    def after_step(self, step: int, state) -> None:
        if self.snapshots.due(step):
            with self.section("snapshot"):  # enqueues the copies; a thread writes them
                self.snapshots.take(step, state, self.data.get_state())


class SampleHook(Hook):
    """Continuations of `sample_prompts` from the model being trained, decoded with the KV cache on
    the training mesh (every process takes part; the primary prints): every `sample_every_steps`
    steps and at the end of a finished run."""

    def __init__(self, cfg, mesh, primary: bool, section: Callable):
        from maxlite.data.tokenizer import load_tokenizer
        from maxlite.generate import Sampling

        self.cfg, self.mesh, self.primary, self.section = cfg, mesh, primary, section
        self.tokenizer = load_tokenizer(cfg.tokenizer_path, cfg.bos_id, cfg.eos_id)
        self.sampling = Sampling(cfg.sample_max_new_tokens, cfg.sample_temperature, cfg.sample_top_k,
                                 seed=cfg.seed)

    def _sample(self, step: int, state) -> None:
        from maxlite.generate import generate_text

        with self.section("sample"):
            texts, got = generate_text(self.cfg, state.params, list(self.cfg.sample_prompts), self.tokenizer,
                                       self.sampling, self.mesh, chat=self.cfg.dataset_type in C.CHAT_DATASETS)
        arrow = " → " if self.cfg.dataset_type in C.CHAT_DATASETS else ""  # chat: a user turn, then the answer
        for prompt, text in zip(self.cfg.sample_prompts, texts):
            print_primary(self.primary, f"maxlite: sample at step {step}: {prompt}{arrow}{text}")
        print_primary(self.primary, f"maxlite: sampled {sum(map(len, got.tokens))} tokens in {got.seconds:.2f} s "
                                    f"({got.tokens_per_second:,.0f} tokens/s, KV cache)")

    def after_step(self, step: int, state) -> None:
        every = self.cfg.sample_every_steps
        if every and step % every == 0 and step < self.cfg.steps:
            self._sample(step, state)

    def at_end(self, step: int, state, reason: str | None) -> None:
        if reason is None:  # finished (a preempted run leaves at once)
            self._sample(step, state)


class ProfilerHook(Hook):
    """`profiler: xplane`: a jax.profiler trace of `profiler_steps` steps, starting after the first
    `skip_first_n_steps_for_profiler` steps of each attempt, on the primary process only (SPMD: its
    devices run the same program as every host's), under {run_dir}/profile (maxlite/profiler.py).
    Whatever the key, a step that runs out of device memory leaves that process's device-memory
    profile there."""

    def __init__(self, cfg, primary: bool, section: Callable):
        self.cfg, self.primary, self.section = cfg, primary, section
        self.trace, self.first, self.last = None, None, None

    def after_step(self, step: int, state) -> None:
        if self.first is None:
            self.first = step - 1  # the step this attempt started from
        self.last = step
        if not (self.cfg.profiler and self.primary):
            return
        begin = self.first + self.cfg.skip_first_n_steps_for_profiler
        if step == begin:
            self._start(state)
        elif step == begin + self.cfg.profiler_steps:
            self._stop(state)

    def _start(self, state) -> None:
        import jax

        from maxlite.profiler import Trace

        with self.section("profile"):
            jax.block_until_ready(state)  # the trace holds whole steps: the ones before it are done
            self.trace = Trace(self.cfg.run_dir)
            self.trace.start()

    def _stop(self, state) -> None:
        import jax

        with self.section("profile"):
            jax.block_until_ready(state)  # the traced steps have run
            where = self.trace.stop()
        self.trace = None
        print_primary(self.primary, f"maxlite: profile of steps {self.last - self.cfg.profiler_steps + 1}-"
                                    f"{self.last} → {where} (tensorboard --logdir {self.cfg.run_dir})")

    def at_end(self, step: int, state, reason: str | None) -> None:
        if self.trace is not None:  # the run ended inside the traced steps
            self._stop(state)

    def on_failure(self, error: BaseException) -> None:
        import jax

        from maxlite import profiler

        if not profiler.out_of_memory(error):
            return
        try:  # no step in the name: dispatch runs ahead, the error may surface a step late
            path = profiler.save_memory_profile(self.cfg.run_dir, f"memory_oom_p{jax.process_index()}.prof")
            print(f"maxlite: out of device memory; device memory in use → {path} (pprof -http=: {path})",
                  file=sys.stderr, flush=True)
        except Exception as e:  # noqa: BLE001 — the run's own error is the one to report
            print(f"maxlite: warning: no device memory profile ({type(e).__name__}: {e})", file=sys.stderr,
                  flush=True)


def standard(cfg, primary: bool, res, logger, batches, ckpt=None, evaluator=None, mesh=None) -> list[Any]:
    """The hooks every run has, in the order they run: eval first (a save records its loss), the
    checkpointer, then in-memory snapshots, then samples (`sample_prompts`), then the profiler (its
    trace stops after the others' work of that step)."""
    hooks: list[Hook] = []
    if evaluator is not None:
        hooks.append(EvalHook(evaluator, logger, res.section, [ckpt.note_eval] if ckpt is not None else []))
    hooks.append(CheckpointHook(ckpt, batches, res.section, primary, cfg.save_checkpoint_on_completion)
                 if ckpt is not None else NoCheckpointHook(primary))
    if res.snapshots is not None:
        hooks.append(SnapshotHook(res.snapshots, batches, res.section))
    if cfg.sample_prompts:
        hooks.append(SampleHook(cfg, mesh, primary, res.section))
    hooks.append(ProfilerHook(cfg, primary, res.section))
    return hooks
