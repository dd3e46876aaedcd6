"""The training loop: `python -m maxlite.train base.yml key=value ...`.

Builds in one direction — config → mesh → state → data → step — then runs the steps, reading
each step's metrics one step late so the host never waits on the device.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from maxlite import config as C
from maxlite.rundir import RunDir, print_primary


def _global_batch(local: dict, sharding) -> dict:
    import jax

    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


def train(cfg: C.Config, on_metrics: Callable[[dict[str, Any]], None] | None = None,
          preemption_notice: Callable[[], str | None] | None = None) -> dict[str, Any]:
    """Train as configured on every process of the job; returns the summary (with `exit_code`).

    `on_metrics(record)` runs on every process after each step's metrics are read (launchers use it,
    e.g. to report to Ray); it must not block for long. `preemption_notice()` is a launcher's polled
    notice that this job's machines are about to be taken (Ray: a node drain): a line describing it,
    or None; on a notice every host saves a checkpoint at the same step and training goes on.
    """
    from maxlite.resilience import Resilience

    started = time.perf_counter()
    # first: a SIGTERM during setup or compilation is caught from here on
    res = Resilience(cfg, notice=preemption_notice)
    try:
        run = _setup(cfg, res)
        try:
            state, reason = _loop(run, res, on_metrics)
            return _finish(run, res, state, reason, started)
        except BaseException as e:
            run.failed(e)
            raise
        finally:
            run.close()
    except BaseException:
        res.close()  # stops the watchdog thread, gives the signals back; in-memory snapshots stay
        raise


@dataclass
class _Run:
    """What `_setup` built for the loop."""

    cfg: C.Config
    primary: bool
    dir: RunDir
    mesh: Any
    state: Any
    train_step: Callable
    batches: Any
    batch_sharding: Any
    logger: Any
    ckpt: Any = None  # Checkpointer, or None with enable_checkpointing=false
    evaluator: Any = None  # Evaluator, or None with eval_interval=0

    def failed(self, e: BaseException) -> None:
        import jax

        try:
            step = int(jax.device_get(self.state.step)) if self.state is not None else None
            self.dir.set_status("failed", step=step, error=f"{type(e).__name__}: {e}")
        except Exception as status_error:  # noqa: BLE001 — the storage may be what failed; keep `e`
            print(f"maxlite: could not write status.json: {type(status_error).__name__}", file=sys.stderr)

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()  # waits for the last async save
        self.logger.close()
        batches_close = getattr(self.batches, "close", None)
        if batches_close:
            batches_close()


def _setup(cfg: C.Config, res) -> _Run:
    """config → distributed → mesh → state (memory snapshot, checkpoint or init) → data → step."""
    from maxlite import mesh as mesh_lib

    mesh_lib.initialize_distributed()  # before any other JAX call
    from maxlite.compile_cache import enable_compilation_cache
    enable_compilation_cache(cfg)  # before anything compiles: a re-run loads its programs

    import jax

    from maxlite import checkpoints, data, optim, state as state_lib, step as step_lib
    from maxlite.checkpointing import Checkpointer, initial_state
    from maxlite.evaluation import Evaluator
    from maxlite.metrics import MetricsLogger

    cfg = C.resolve(cfg, jax.device_count(), mesh_lib.num_slices_of(jax.devices()), jax.process_count())
    primary = jax.process_index() == 0
    checkpoints.validate(cfg)
    if primary:
        checkpoints.check_storage(cfg)  # a missing bucket or no permission: one line, before any write
    run_dir = RunDir(cfg, primary)
    mesh = mesh_lib.make_mesh(cfg)
    if primary:
        print(f"maxlite: run {cfg.run_name} → {run_dir.path}; {jax.process_count()} process(es), "
              f"mesh {dict(zip(mesh.axis_names, mesh.devices.shape))} on {jax.device_count()} "
              f"{jax.devices()[0].platform} device(s); global batch {cfg.global_batch_size} × "
              f"{cfg.max_target_length} tokens", flush=True)

    tx, schedule = optim.make_optimizer(cfg), optim.learning_rate_schedule(cfg)
    graphdef, abstract, shardings = state_lib.abstract_state(cfg, mesh, tx)
    state_lib.check_fits(cfg, abstract)
    if primary:
        n_params = sum(x.size for x in jax.tree.leaves(abstract.params))
        print(f"maxlite: model {cfg.model_name}: {n_params / 1e6:,.2f}M parameters", flush=True)
    # after initialize_distributed, which installs its own SIGTERM handler: attach puts ours back
    res.attach(run_dir.path, mesh, shardings, primary, on_status=run_dir.set_status)
    ckpt = Checkpointer(cfg, primary, state_lib.nbytes(abstract)) if cfg.enable_checkpointing else None
    batches = data.make_iterator(cfg, "train", jax.process_index(), jax.process_count())
    disk_step = ckpt.latest_step if ckpt is not None and ckpt.latest_step is not None else -1
    restored = res.restore(abstract, newer_than=disk_step)  # collective: every host calls it
    if restored is not None:  # newest snapshot complete on all hosts (own shards or peer replicas)
        state = restored.state
        batches.set_state(restored.data_state)
    else:  # logs "resumed from step N (...) in <dir> in S s" when it reads the disk checkpoint
        state = initial_state(cfg, ckpt, mesh, tx, abstract, shardings, batches, jax.process_index(), primary)
    batch_sharding = mesh_lib.batch_sharding(mesh)
    train_step = step_lib.jit_train_step(cfg, graphdef, tx, schedule, shardings, batch_sharding)
    evaluator = Evaluator(cfg, graphdef, shardings.params, batch_sharding, jax.process_index(),
                          jax.process_count()) if cfg.eval_interval > 0 else None
    logger = MetricsLogger(cfg, run_dir.path, primary, int(state.step))
    run_dir.set_status("running", step=int(state.step))
    res.setup_end()
    return _Run(cfg, primary, run_dir, mesh, state, train_step, batches, batch_sharding, logger, ckpt, evaluator)


def _loop(run: _Run, res, on_metrics) -> tuple[Any, str | None]:
    """The steps, metrics read one step late; returns the last state and the agreed stop reason."""
    import jax
    from flax import nnx

    from maxlite import mesh as mesh_lib
    from maxlite.resilience import SAVE_NOW

    cfg, ckpt, logger, batches = run.cfg, run.ckpt, run.logger, run.batches

    def read(pending) -> None:
        step, metrics, dispatched = pending
        with res.device_wait():  # waits for that step (and, through it, for the other hosts)
            values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        done = time.perf_counter()
        if not values.pop("finite"):
            raise FloatingPointError(f"loss is {values['loss']} at step {step}: stopping")
        logger.log_step(step, done - dispatched[0], {**values, **res.metrics()})
        dispatched[0] = done
        if on_metrics is not None:
            on_metrics(logger.history[-1])

    reason = None
    with jax.set_mesh(run.mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        pending, clock = None, [time.perf_counter()]
        for step in range(int(run.state.step), cfg.steps):
            res.step_begin(step)
            with res.data_wait():
                local = next(batches)
            batch = _global_batch(local, run.batch_sharding)
            with res.device_wait():  # on CPU a dispatch may run the step inline, waiting for peers
                run.state, metrics = run.train_step(run.state, batch)
            if pending is not None:
                read(pending)
            pending = (step + 1, metrics, clock)
            if run.evaluator is not None and run.evaluator.due(step + 1):
                with res.section("eval"):
                    values = run.evaluator.run(run.state.params)
                logger.log_eval(step + 1, {k: values[k] for k in ("loss", "perplexity")})
                if ckpt is not None:
                    ckpt.note_eval(values["loss"])
            if ckpt is not None:
                with res.section("checkpoint"):
                    ckpt.maybe_save(step + 1, run.state, batches)  # async: waits only for the device→host copy
                    ckpt.poll()
            # may snapshot into host memory; the answer is the same on every host, at the same step
            reason = res.step_end(step + 1, run.state, batches.get_state)
            if reason == SAVE_NOW:  # a preemption notice: a complete checkpoint now, then train on
                reason = None
                _save_and_wait(run, res, step + 1, "preemption notice")
            elif reason:
                break
        if pending is not None:
            read(pending)
        if reason:  # preempted, max_time, straggler: the final save, finished before we exit
            _save_and_wait(run, res, int(run.state.step), reason)
        elif ckpt is not None and cfg.save_checkpoint_on_completion:
            with res.section("checkpoint"):
                ckpt.maybe_save(int(run.state.step), run.state, batches)  # e.g. steps was lowered on resume
    return run.state, reason


def _save_and_wait(run: _Run, res, step: int, why: str) -> None:
    if run.ckpt is None:
        print_primary(run.primary, f"maxlite: {why} at step {step}, but enable_checkpointing=false: nothing saved")
        return
    with res.section("checkpoint"):
        print_primary(run.primary, f"maxlite: {why}: saving step {step} and waiting for it")
        if not run.ckpt.has(step):
            run.ckpt.save(step, run.state, run.batches)
        run.ckpt.poll(wait=True)


def _finish(run: _Run, res, state, reason: str | None, started: float) -> dict[str, Any]:
    """Summary (MFU against the measured peak), goodput, exit code, status.json."""
    import jax

    from maxlite.peak import peak_tflops_per_device

    logger, primary = run.logger, run.primary
    summary = logger.summary(time.perf_counter() - started, None)
    if primary and "tokens_per_second" in summary and not reason:  # preempted: exit fast, no peak probe
        peak, source = peak_tflops_per_device()
        if jax.devices()[0].platform == "cpu":
            peak /= jax.local_device_count()  # simulated CPU devices share the host's cores
        summary = logger.summary(time.perf_counter() - started, peak)
        summary["peak_source"] = source
    if run.ckpt is not None:
        run.ckpt.poll(wait=True)  # the last save is part of the run: goodput counts it
    code, status, fields = res.finish(reason)
    summary.update(res.scores)
    summary.update({("goodput_" + k if k in ("wall_seconds", "attempt") else k): v for k, v in fields.items()})
    summary["exit_code"] = code
    logger.print_summary(summary)
    print_primary(primary, _badput_line(summary, status, int(state.step)))
    run.dir.set_status(status, step=int(state.step), summary=summary, exit_code=code)
    return summary


def _badput_line(summary: dict, status: str, step: int) -> str:
    """Where the wall time went, across restarts (goodput.json keeps the totals)."""
    causes = [(k[len("badput_"):-len("_seconds")], v) for k, v in summary.items()
              if k.startswith("badput_") and v >= 0.005]
    bad = ", ".join(f"{name} {v:.2f}s" for name, v in sorted(causes, key=lambda kv: -kv[1])) or "none"
    return (f"maxlite: {status} at step {step} (exit {summary['exit_code']}); goodput "
            f"{summary.get('goodput', 0.0):.3f} ({summary.get('productive_seconds', 0.0):.2f}s productive of "
            f"{summary.get('goodput_wall_seconds', 0.0):.2f}s wall, attempt {summary.get('goodput_attempt', 1)}); "
            f"badput: {bad}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m maxlite.train [base.yml|your.yml] key=value ...\n"
              "keys, defaults and comments: maxlite/configs/base.yml", file=sys.stderr)
        return 0 if argv else 2
    from maxlite.checkpointing.manager import CheckpointSaveError
    from maxlite.resilience import preemption

    try:
        cfg = C.load(argv)
        preemption.catch_outside_the_loop(cfg.preemption_signals)  # before the loop and after it
        summary = train(cfg)
    except C.ConfigError as e:
        print(f"maxlite: error: {e}", file=sys.stderr)
        return 2
    except CheckpointSaveError:
        # Already reported on stderr; earlier checkpoints are intact; status.json says failed.
        # The failed save's writer threads may retry the dead storage for many minutes and would
        # hold the interpreter's exit: leave now (outputs are flushed and closed).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if preemption.noted_signal():  # e.g. Slurm's SIGTERM at the time limit, just after the last step
        print(f"maxlite: got {preemption.noted_signal()} after the run ended; its outcome stands", flush=True)
    return int(summary.get("exit_code", 0))  # 0 finished/preempted (status.json tells them apart), 76 straggler


if __name__ == "__main__":
    sys.exit(main())
