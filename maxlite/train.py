"""The training loop: `python -m maxlite.train base.yml key=value ...`.

Builds in one direction — config → mesh → state → data → step — then runs the steps, reading
each step's metrics one step late so the host never waits on the device.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from maxlite import cli, config as C
from maxlite.rundir import RunDir, print_primary


def train(cfg: C.Config, on_metrics: Callable[[dict[str, Any]], None] | None = None,
          preemption_notice: Callable[[], str | None] | None = None,
          snapshot_keeper: Callable | None = None, status_fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train as configured on every process of the job; returns the summary (with `exit_code`).

    `on_metrics(record)` runs on every process after each step's metrics are read (launchers use it,
    e.g. to report to Ray); it must not block for long. `preemption_notice()` is a launcher's polled
    notice that this job's machines are about to be taken (Ray: a node drain): a line describing it,
    or None; on a notice every host saves a checkpoint at the same step and training goes on.
    `snapshot_keeper(run_dir, rank)`: where a launcher keeps in-memory snapshots (Ray: actors that
    outlive the workers); /dev/shm otherwise. `status_fields`: a launcher's facts about this attempt
    for every status.json it writes (Ray: an elastic group's size). Launchers hand these in; the
    loop knows no launcher.
    """
    from maxlite.resilience.core import Resilience

    started = time.perf_counter()
    # first: a SIGTERM during setup or compilation is caught from here on
    res = Resilience(cfg, notice=preemption_notice, keeper=snapshot_keeper)
    try:
        run = _setup(cfg, res, status_fields or {})
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
    hooks: list  # periodic work (maxlite/hooks.py), called in order after every step
    ckpt: Any = None  # Checkpointer, or None with enable_checkpointing=false
    rollbacks: Any = None  # maxlite.rollback.Rollbacks: the loss verdicts and what they do

    def failed(self, e: BaseException) -> None:
        import jax

        for hook in self.hooks:  # e.g. the device-memory profile of a step out of memory
            hook.on_failure(e)
        try:
            step = int(jax.device_get(self.state.step)) if self.state is not None else None
        except Exception:  # noqa: BLE001 — a step that failed (out of memory) leaves its state unreadable
            step = None
        try:
            failures = {"checkpoint_failures": self.ckpt.failures} if self.ckpt and self.ckpt.failures else {}
            self.dir.set_status("failed", step=step, error=f"{type(e).__name__}: {e}",
                                exit_code=exit_code_of(e), **failures)
        except Exception as status_error:  # noqa: BLE001 — the storage may be what failed; keep `e`
            print(f"maxlite: could not write status.json: {type(status_error).__name__}", file=sys.stderr)

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()  # waits for the last async save
        self.logger.close()
        batches_close = getattr(self.batches, "close", None)
        if batches_close:
            batches_close()


def exit_code_of(e: BaseException) -> int:
    """The exit code `main` gives an error that ends the run."""
    from maxlite.checkpoints.saver import CheckpointSaveError
    from maxlite.resilience import exit_codes
    from maxlite.resilience.spikes import LossDiverged

    if isinstance(e, C.ConfigError):
        return exit_codes.CONFIG_ERROR
    if isinstance(e, LossDiverged):
        return exit_codes.DIVERGED
    return exit_codes.CHECKPOINT_FAILED if isinstance(e, CheckpointSaveError) else exit_codes.FAILED


def _setup(cfg: C.Config, res, status_fields: dict[str, Any]) -> _Run:
    """config → distributed → the wiring (build) → run dir → state (resume) → data → hooks."""
    from maxlite import mesh as mesh_lib

    mesh_lib.initialize_distributed()  # before any other JAX call
    from maxlite.compile_cache import enable_compilation_cache
    enable_compilation_cache(cfg)  # before anything compiles: a re-run loads its programs

    import jax
    from flax import nnx

    from maxlite import checkpoints, data, hooks, objectives, resume, state as state_lib
    from maxlite.build import build
    from maxlite.checkpoints.saver import Checkpointer
    from maxlite.evaluation import Evaluator
    from maxlite.metrics import MetricsLogger

    built = build(cfg)
    cfg, mesh, primary = built.cfg, built.mesh, jax.process_index() == 0
    if primary:
        checkpoints.check_storage(cfg)  # a missing bucket or no permission: one line, before any write
    run_dir = RunDir(cfg, primary)
    if primary:
        print(f"maxlite: run {cfg.run_name} → {run_dir.path}; {jax.process_count()} process(es), "
              f"mesh {dict(zip(mesh.axis_names, mesh.devices.shape))} on {jax.device_count()} "
              f"{jax.devices()[0].platform} device(s); global batch {cfg.global_batch_size} × "
              f"{cfg.max_target_length} tokens", flush=True)
    if cfg.dataset_type == "sft":  # the loss mask checked before step 0 (sft_audit.txt)
        from maxlite.data import sft_audit
        from maxlite.data.tokenizer import load_tokenizer
        sft_audit.run(cfg, load_tokenizer(cfg.tokenizer_path, cfg.bos_id, cfg.eos_id), run_dir.path, primary)
    state_lib.check_fits(cfg, built.abstract)
    if primary:
        n_params = sum(x.size for x in jax.tree.leaves(built.abstract.params))
        print(f"maxlite: model {cfg.model_name}: {n_params / 1e6:,.2f}M parameters", flush=True)
    # after initialize_distributed, which installs its own SIGTERM handler: attach puts ours back
    res.attach(run_dir.path, mesh, built.shardings, primary, on_status=run_dir.set_status)
    torn_save = res.faults.in_checkpoint if res.faults.armed_in_checkpoint() else None  # tests' fault
    ckpt = (Checkpointer(cfg, primary, state_lib.nbytes(built.abstract), before_commit=torn_save)
            if cfg.enable_checkpointing else None)
    batches = data.make_iterator(cfg, "train", jax.process_index(), jax.process_count())
    start = resume.decide(built, ckpt, batches, jax.process_index(), primary,
                          memory=res.restore)  # collective: every host calls it
    with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        objectives.before_loop(built.train_step, start.state, run_dir.path, primary)  # collective where it computes
    evaluator = Evaluator(cfg, built.graphdef, built.shardings.params, built.batch_sharding,
                          jax.process_index(), jax.process_count(),
                          objectives.eval_score(cfg, built.graphdef, built.train_step)) if cfg.eval_interval > 0 else None
    logger = MetricsLogger(cfg, run_dir.path, primary, start.step)
    run_hooks = hooks.standard(cfg, primary, res, logger, batches, ckpt, evaluator, mesh)
    run_dir.sticky.update(status_fields)
    run_dir.sticky["resumed_from"] = start.record()
    run_dir.set_status("running", step=start.step)
    res.setup_end()
    from maxlite.rollback import Rollbacks
    return _Run(cfg, primary, run_dir, mesh, start.state, built.train_step, batches, built.batch_sharding,
                logger, run_hooks, ckpt, Rollbacks(cfg, built, ckpt, batches, run_dir, primary, start.step))


def _loop(run: _Run, res, on_metrics) -> tuple[Any, str | None]:
    """The steps, metrics read one step late, hooks after each; a bad loss rolls back (and the loop
    goes on from there); returns the last state and the agreed stop reason."""
    import jax
    from flax import nnx

    from maxlite import mesh as mesh_lib
    from maxlite.resilience.stops import SAVE_NOW

    reason, pending = None, None
    with jax.set_mesh(run.mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        clock = [time.perf_counter()]
        step = int(run.state.step)
        while True:
            while step < run.cfg.steps:
                res.step_begin(step)
                with res.data_wait():
                    local = next(run.batches)
                local = res.faults.corrupt(step + 1, local)  # tests' injected bad batch
                batch = mesh_lib.global_batch(local, run.batch_sharding)
                with res.device_wait():  # on CPU a dispatch may run the step inline, waiting for peers
                    run.state, metrics = run.train_step(run.state, batch)
                verdict = _read(run, res, pending, on_metrics) if pending is not None else None
                pending = (step + 1, metrics, clock)
                if verdict is not None:  # the step just dispatched started from a bad state too
                    res.step_abandoned()
                    good = run.rollbacks.roll_back(res, verdict, last_dispatched=step + 1)
                    run.state, step, pending = good.state, good.step, None
                    continue
                res.step_end(step + 1)  # injected faults; the step's own time
                for hook in run.hooks:
                    hook.after_step(step + 1, run.state)
                reason = res.decide(step + 1)  # the same answer on every host, at the same step
                if reason == SAVE_NOW:  # a preemption notice: a complete checkpoint now, then train on
                    reason = None
                    for hook in run.hooks:
                        hook.save_now(step + 1, run.state, "preemption notice")
                elif reason:
                    break
                step += 1
            if pending is None:
                break
            verdict, last_dispatched, pending = _read(run, res, pending, on_metrics), pending[0], None
            if verdict is None:
                break
            good = run.rollbacks.roll_back(res, verdict, last_dispatched)
            run.state, step = good.state, good.step
            if reason:  # stopping anyway: from the good state (the final save holds it)
                break
        res.loop_end()
        for hook in run.hooks:
            hook.at_end(int(run.state.step), run.state, reason)
    return run.state, reason


def _read(run: _Run, res, pending, on_metrics):
    """A step's metrics, one step late: the host never waits for the step it just dispatched.
    Returns the loss watch's verdict (resilience/spikes.py): None, or a rollback to make."""
    import jax

    step, metrics, dispatched = pending
    with res.device_wait():  # waits for that step (and, through it, for the other hosts)
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
    done = time.perf_counter()
    finite = bool(values.pop("finite"))
    verdict = run.rollbacks.see(step, values["loss"], finite)
    if finite:
        run.logger.log_step(step, done - dispatched[0], {**values, **res.metrics()})
    dispatched[0] = done
    if on_metrics is not None and finite:
        on_metrics(run.logger.history[-1])
    return verdict


def _finish(run: _Run, res, state, reason: str | None, started: float) -> dict[str, Any]:
    """Summary (MFU against the measured peak), goodput, exit code, status.json."""
    import jax

    from maxlite import report
    from maxlite.peak import peak_tflops_per_device
    from maxlite.resilience import exit_codes

    logger, primary = run.logger, run.primary
    summary = logger.summary(time.perf_counter() - started, None)
    if primary and "tokens_per_second" in summary and not reason:  # preempted: exit fast, no peak probe
        with res.section("peak_probe"):
            peak, source = peak_tflops_per_device(run.cfg.dtype)
        if jax.devices()[0].platform == "cpu":
            peak /= jax.local_device_count()  # simulated CPU devices share the host's cores
        summary = logger.summary(time.perf_counter() - started, peak)
        summary["peak_source"] = source
    if run.ckpt is not None:
        run.ckpt.poll(wait=True)  # the last save is part of the run: goodput counts it
    code, status, fields = res.finish(reason)
    failures = run.ckpt.failures if run.ckpt is not None else []
    lost = run.ckpt.unrecovered_failures() if run.ckpt is not None else []
    if lost:  # a failed save is never success, whatever the policy let the loop do
        code, status = exit_codes.CHECKPOINT_FAILED, "failed"
        fields = {**fields, "reason": "checkpoint_failed"}
    summary.update(res.scores)
    summary.update({("goodput_" + k if k in ("wall_seconds", "attempt") else k): v for k, v in fields.items()})
    summary["exit_code"] = code
    summary["checkpoint_saves_failed"] = len(failures)
    logger.print_summary(summary)
    print_primary(primary, _badput_line(summary, status, int(state.step)))
    if lost:
        steps = ", ".join(str(f["step"]) for f in lost)
        print_primary(primary, f"maxlite: error: {len(lost)} checkpoint save(s) failed with no complete save "
                      f"after them (step(s) {steps}; first error: {lost[0]['error']}); exit "
                      f"{code}: the run's progress since its last complete checkpoint is not kept", err=True)
    extra = {"checkpoint_failures": failures} if failures else {}
    if "reason" in fields:
        extra["reason"] = fields["reason"]
    summary["next"] = exit_codes.next_action(code, {"state": status, **extra})  # what status.json says too
    run.dir.set_status(status, step=int(state.step), summary=summary, exit_code=code, **extra)
    report.at_end(run.cfg, primary)  # report.html + report.png in the run directory
    return summary


def _badput_line(summary: dict, status: str, step: int) -> str:
    """Where the wall time went, across restarts (goodput.json keeps the totals)."""
    causes = [(k[len("badput_"):-len("_seconds")], v) for k, v in summary.items()
              if k.startswith("badput_") and v >= 0.005]
    bad = ", ".join(f"{name} {v:.2f}s" for name, v in sorted(causes, key=lambda kv: -kv[1])) or "none"
    failed = summary.get("checkpoint_saves_failed", 0)
    saves = f"; {failed} checkpoint save(s) failed" if failed else ""
    return (f"maxlite: {status} at step {step} (exit {summary['exit_code']}){saves}; goodput "
            f"{summary.get('goodput', 0.0):.3f} ({summary.get('productive_seconds', 0.0):.2f}s productive of "
            f"{summary.get('goodput_wall_seconds', 0.0):.2f}s wall, attempt {summary.get('goodput_attempt', 1)}); "
            f"badput: {bad}")


def _several_processes() -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and jax.process_count() > 1


@cli.entry_point()
def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m maxlite.train [base.yml|your.yml] key=value ...\n"
              "keys, defaults and comments: maxlite/configs/base.yml", file=sys.stderr)
        return 0 if argv else 2
    from maxlite.checkpoints.saver import CheckpointSaveError
    from maxlite.resilience import exit_codes, preemption
    from maxlite.resilience.spikes import LossDiverged

    try:
        cfg = C.load(argv)
        preemption.catch_outside_the_loop(cfg.preemption_signals)  # before the loop and after it
        summary = train(cfg)
    except CheckpointSaveError:
        # Already reported on stderr; earlier checkpoints are intact; status.json says failed.
        # The failed save's writer threads may retry the dead storage for many minutes and would
        # hold the interpreter's exit: leave now (outputs are flushed and closed).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_codes.CHECKPOINT_FAILED)
    except C.ConfigError:
        raise  # the user's mistake: one line, exit 2 (maxlite/cli.py)
    except LossDiverged as e:  # every host stops at the same step: one line, status.json says failed
        if not _several_processes() or sys.modules["jax"].process_index() == 0:
            print(f"maxlite: error: {e}", file=sys.stderr, flush=True)
        return exit_code_of(e)
    except Exception:  # noqa: BLE001 — a crash: its traceback, then out at once
        if not _several_processes():
            raise
        # A peer may be gone (that is often why we failed): jax.distributed's exit barrier would
        # wait for it for minutes (its heartbeat/shutdown timeouts) before the launcher may restart.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_codes.FAILED)
    if preemption.noted_signal():  # e.g. Slurm's SIGTERM at the time limit, just after the last step
        print(f"maxlite: got {preemption.noted_signal()} after the run ended; its outcome stands", flush=True)
    return int(summary.get("exit_code", 0))  # 0 finished/preempted (status.json tells them apart), 76 straggler


if __name__ == "__main__":
    sys.exit(main())
