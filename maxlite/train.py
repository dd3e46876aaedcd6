"""The training loop: `python -m maxlite.train base.yml key=value ...`.

Builds in one direction — config → mesh → state → data → step — then runs the steps, reading
each step's metrics one step late so the host never waits on the device.
"""

from __future__ import annotations

import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from maxlite import cli, config as C, outcome
from maxlite.rundir import RunDir, print_primary


def train(cfg: C.Config, on_metrics: Callable[[dict[str, Any]], None] | None = None,
          preemption_notice: Callable[[], str | None] | None = None,
          snapshot_keeper: Callable | None = None, status_fields: dict[str, Any] | None = None,
          stop_request: Callable[[], str | None] | None = None,
          on_status: Callable[[str], None] | None = None,
          job: tuple[str, str] = ("", "python -m maxlite.train")) -> dict[str, Any]:
    """Train as configured on every process of the job; returns the summary (with `exit_code`,
    `next` and `reason`: maxlite.outcome's answer, which status.json records too).

    Launchers hand in what only they know; the loop knows no launcher:
    `on_metrics(record)` runs on every process after each step's metrics are read (Ray reports
    them); it must not block for long. `preemption_notice()`: a polled notice that this job's
    machines are about to be taken (Ray: a node drain), a line or None; every host then saves at the
    same step and training goes on. `snapshot_keeper(run_dir, rank)`: where in-memory snapshots
    live (Ray: actors that outlive the workers); /dev/shm otherwise. `status_fields`: facts about
    this attempt for every status.json (Ray: an elastic group's size). `stop_request()`: a polled
    request to stop as Ctrl-C does, a line or None (the Ray driver's Ctrl-C). `on_status(text)`: a
    copy of every status.json written (Slurm's batch script reads a local one). `job`: (the job this
    attempt belongs to, e.g. "slurm:123" — a later attempt of the same job takes the run's lease
    over at once —, the launcher in words): maxlite/lease.py.
    """
    from maxlite.resilience.core import Resilience

    started = time.perf_counter()
    # first: a SIGTERM or Ctrl-C during setup or compilation is caught from here on
    res = Resilience(cfg, notice=preemption_notice, keeper=snapshot_keeper, stop_request=stop_request)
    lease = []  # the run's lease, once held (maxlite/lease.py)
    try:
        run = _setup(cfg, res, status_fields or {}, on_status, snapshot_keeper is not None, job, lease)
        try:
            state, reason = _loop(run, res, on_metrics)
            summary = _finish(run, res, state, reason, started)
        except BaseException as e:
            run.failed(e)
            if not isinstance(e, KeyboardInterrupt):  # Ctrl-C twice: out at once, an unfinished
                run.close()                            # save stays incomplete (never restored)
            raise
        run.close()
        return summary
    except BaseException:
        res.close()  # stops the watchdog thread, gives the signals back; in-memory snapshots stay
        raise
    finally:
        for held in lease:
            held.release()


@dataclass
class _Run:
    """What `_setup` built for the loop."""

    cfg: C.Config
    primary: bool
    dir: RunDir
    mesh: Any
    state: Any
    objective: Any  # maxlite.objectives.Objective: the loop's step, driven by the step number
    batches: Any
    batch_sharding: Any
    logger: Any
    hooks: list  # periodic work (maxlite/hooks.py), called in order after every step
    ckpt: Any = None  # Checkpointer, or None with enable_checkpointing=false
    rollbacks: Any = None  # maxlite.rollback.Rollbacks: the loss verdicts and what they do
    lease: Any = None  # maxlite.lease.Lease on the primary (run_lease_seconds > 0), else None

    def failed(self, e: BaseException) -> None:
        """status.json for a run an exception ended (maxlite.outcome decides what it says)."""
        import jax

        if self.lease is not None and self.lease.lost:
            return  # the run directory is the new holder's: nothing more written
        for hook in self.hooks:  # e.g. the device-memory profile of a step out of memory
            hook.on_failure(e)
        try:
            step = int(jax.device_get(self.state.step)) if self.state is not None else None
        except Exception:  # noqa: BLE001 — a step that failed (out of memory) leaves its state unreadable
            step = None
        try:
            failures = {"checkpoint_failures": self.ckpt.failures} if self.ckpt and self.ckpt.failures else {}
            lost = self.ckpt.unrecovered_failures() if self.ckpt is not None else []
            self.dir.set_status("failed", outcome=outcome.decide(error=e, lost_saves=lost), step=step, **failures)
        except Exception as status_error:  # noqa: BLE001 — the storage may be what failed; keep `e`
            print(f"maxlite: could not write status.json: {type(status_error).__name__}", file=sys.stderr)

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()  # waits for the last async save
        self.logger.close()
        batches_close = getattr(self.batches, "close", None)
        if batches_close:
            batches_close()


def _preflight(cfg: C.Config, built, primary: bool, launcher_keeper: bool):
    """Everything that can refuse the recipe, before the run directory exists: storage, memory,
    the data (files, tokenizer) — reads only. Returns the train data iterator it opened."""
    from maxlite import checkpoints, config_checks, data, mesh as mesh_lib, state as state_lib

    if primary:
        checkpoints.check_storage(cfg)  # a missing bucket or no permission: one line, before any write
    config_checks.check_keeper(cfg, launcher_keeper)
    state_lib.check_fits(cfg, built.abstract)
    reader = mesh_lib.readers(built.batch_sharding)  # processes holding the same rows read the same rows
    batches = data.make_iterator(cfg, "train", *reader)
    if built.objective.reads_ahead:  # asynchronous GRPO samples the next steps' prompts while one trains
        from maxlite.data.lookahead import Lookahead
        batches = Lookahead(batches)
        built.objective.read_ahead(batches.peek)
    # GRPO's refill reads on in the run's own data; its sampling keys follow the data's position
    built.objective.draw_from(lambda: next(batches, None), lambda: batches.batches_read)
    if cfg.eval_interval > 0:  # the eval files and tokenizer, read the same way
        data.make_iterator(cfg, "eval", *reader).close()
    return batches


def _hold_the_run(cfg: C.Config, primary: bool, job: tuple[str, str]):
    """The primary checks that the run directory holds no other recipe's saved run (maxlite/run_identity.py)
    and takes the run's lease, before anything is written (every process learns whether it did: a
    refused launch ends everywhere with the same line)."""
    import jax

    from maxlite import run_identity
    from maxlite.checkpoints.saver import gather_json
    from maxlite.lease import FILE as lease_file, Holder, Lease
    from maxlite.rundir import set_aside

    lease = None
    refused = None  # [the error's kind, its line]: what every process raises
    held = run_identity.verdict(cfg.run_dir, cfg.run_name, C.to_plain_dict(cfg)) if primary else run_identity.Verdict()
    if held.refused:
        refused = ["ConfigError", held.refused]
    if primary and not refused and cfg.run_lease_seconds > 0:
        lease = Lease(cfg.run_dir, Holder(*job), cfg.run_lease_seconds,
                      log=lambda line: print(line, file=sys.stderr, flush=True))
        try:
            lease.acquire()
        except (C.ConfigError, outcome.TransientError) as e:  # a path under a file; a live writer
            refused = [type(e).__name__, str(e)]
    if jax.process_count() > 1:
        refused = gather_json(refused)[0]
    if refused:
        raise (outcome.TransientError if refused[0] == "TransientError" else C.ConfigError)(refused[1])
    if held.replaced:  # the primary holds the run now: the earlier run's records go aside, not mixed in
        aside = set_aside(cfg.run_dir, keep=(lease_file,))
        print(f"{held.replaced} (its files: {aside})", flush=True)
    return lease


def _setup(cfg: C.Config, res, status_fields: dict[str, Any], on_status, launcher_keeper: bool,
           job: tuple[str, str], leases: list) -> _Run:
    """config → distributed → the wiring (build) → preflight → the lease → run dir → state (resume) →
    hooks."""
    from maxlite import mesh as mesh_lib

    from maxlite.compile_cache import enable_compilation_cache
    enable_compilation_cache(cfg)  # before anything compiles, initialize_distributed's gloo connect included
    mesh_lib.initialize_distributed()  # before any other JAX call (the cache's settings are no call)

    import jax
    from flax import nnx

    from maxlite import hooks, resume, state as state_lib
    from maxlite.build import build
    from maxlite.checkpoints.saver import Checkpointer
    from maxlite.evaluation import Evaluator
    from maxlite.metrics import MetricsLogger

    built = build(cfg)  # resolves the recipe against the devices (attention included)
    cfg, mesh, primary = built.cfg, built.mesh, jax.process_index() == 0
    batches = _preflight(cfg, built, primary, launcher_keeper)
    lease = _hold_the_run(cfg, primary, job)
    if lease is not None:
        leases.append(lease)
    run_dir = RunDir(cfg, primary, on_status)
    if primary:
        print(f"maxlite: run {cfg.run_name} → {run_dir.path}; {jax.process_count()} process(es), "
              f"mesh {dict(zip(mesh.axis_names, mesh.devices.shape))} on {jax.device_count()} "
              f"{jax.devices()[0].platform} device(s); global batch {cfg.global_batch_size} × "
              f"{cfg.max_target_length} tokens; attention {cfg.attention}"
              + (f"; cpu matmul {built.cpu_matmul.describe()}" if built.cpu_matmul else "")
              + (f"; pipeline {_pipeline_words(cfg.pipeline_schedule)}" if cfg.pipeline_schedule else ""), flush=True)
    if cfg.dataset_type == "sft":  # the loss mask checked before step 0 (sft_audit.txt)
        from maxlite.data import sft_audit
        from maxlite.data.tokenizer import load_tokenizer
        sft_audit.run(cfg, load_tokenizer(cfg.tokenizer_path, cfg.bos_id, cfg.eos_id), run_dir.path, primary)
    if primary:
        n_params = sum(x.size for x in jax.tree.leaves(built.abstract.params))
        trained = sum(x.size for x in jax.tree.leaves(state_lib.split_trainable(built.abstract.params)[0]))
        print(f"maxlite: model {cfg.model_name}: {n_params / 1e6:,.2f}M parameters"
              + (f", {trained / 1e6:,.2f}M of them trained" if trained != n_params else "")
              + (f"; vision encoder {cfg.vision_encoder}: {_vision_words(cfg)}" if cfg.vision_encoder else ""),
              flush=True)
        if cfg.opt_type == "muon":
            from maxlite import optim
            print(optim.describe_split(optim.muon_split(state_lib.split_trainable(built.abstract.params)[0])), flush=True)
    # after initialize_distributed, which installs its own SIGTERM handler: attach puts ours back
    res.attach(run_dir.path, mesh, built.shardings, primary, on_status=run_dir.set_status)
    torn_save = res.faults.in_checkpoint if res.faults.armed_in_checkpoint() else None  # tests' fault
    ckpt = (Checkpointer(cfg, primary, state_lib.nbytes(built.abstract), before_commit=torn_save)
            if cfg.enable_checkpointing else None)
    start = resume.decide(built, ckpt, batches, jax.process_index(), primary,
                          memory=res.restore)  # collective: every host calls it
    with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        built.objective.restore(start.state, start.step, run_dir)  # collective where it computes
    evaluator = Evaluator(cfg, built.graphdef, built.shardings.params, built.batch_sharding,
                          *mesh_lib.readers(built.batch_sharding),
                          built.objective.scorer) if cfg.eval_interval > 0 else None
    logger = MetricsLogger(cfg, run_dir.path, primary, start.step)
    run_hooks = hooks.standard(cfg, primary, res, logger, batches, ckpt, evaluator, mesh)
    run_dir.sticky.update(status_fields)
    run_dir.sticky.update(attention=cfg.attention, resumed_from=start.record())  # what runs, where from
    if built.cpu_matmul:
        run_dir.sticky["cpu_matmul"] = built.cpu_matmul.record()
    if cfg.pipeline_schedule:
        run_dir.sticky["pipeline"] = cfg.pipeline_schedule
    if lease is not None:
        run_dir.sticky["lease"] = {"host": lease.me.host, "pid": lease.me.pid, "launcher": lease.me.launcher,
                                   **({"took_over": lease.took_over} if lease.took_over else {})}
        res.stops.lease = lease
    run_dir.set_status("running", step=start.step)
    res.setup_end()
    from maxlite.rollback import Rollbacks
    return _Run(cfg, primary, run_dir, mesh, start.state, built.objective, batches, built.batch_sharding,
                logger, run_hooks, ckpt, Rollbacks(cfg, built, ckpt, batches, run_dir, primary, start.step), lease)


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
                if run.objective.data_rows(step) is not None:  # the rows it trains on (else its own)
                    local = res.train_rows(step + 1, local, run.objective.data_rows(step))
                batch = mesh_lib.global_batch(local, run.batch_sharding)
                run.state, metrics = run.objective(run.state, batch, step, res)  # step number `step`
                verdict = _read(run, res, pending, on_metrics) if pending is not None else None
                pending = (step + 1, metrics, clock)
                if verdict is not None:  # the step just dispatched started from a bad state too
                    res.step_abandoned()
                    step, pending = _roll_back(run, res, verdict, last_dispatched=step + 1), None
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
            step = _roll_back(run, res, verdict, last_dispatched)
            if reason:  # stopping anyway: from the good state (the final save holds it)
                break
        res.loop_end()
        for hook in run.hooks:
            hook.at_end(int(run.state.step), run.state, reason)
    return run.state, reason


def _roll_back(run: _Run, res, verdict, last_dispatched: int) -> int:
    """Back to the newest good state (maxlite/rollback.py); the objective learns where the run is
    now. Returns the step the loop goes on from."""
    good = run.rollbacks.roll_back(res, verdict, last_dispatched)
    run.state = good.state
    run.objective.restore(good.state, good.step, run.dir)
    return good.step


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


def _pipeline_words(p: dict) -> str:
    return (f"{p['schedule']}, {p['stages']} stages × {p['repeats']} repeat(s) of {p['layers_per_stage']} layer(s), "
            f"{p['microbatches']} micro-batches, bubble {100 * p['bubble_fraction']:.1f}%")


def _finish(run: _Run, res, state, reason: str | None, started: float) -> dict[str, Any]:
    """Summary (MFU against the measured peak), goodput, the outcome (maxlite.outcome), status.json."""
    import jax

    from maxlite import cpu_matmul, report
    from maxlite.peak import peak_tflops_per_device

    logger, primary = run.logger, run.primary
    summary = logger.summary(time.perf_counter() - started, None)
    if primary and "tokens_per_second" in summary and not reason:  # stopped: exit fast, no peak probe
        with res.section("peak_probe"):
            peak, source = peak_tflops_per_device(run.cfg.dtype, run.cfg.cpu_matmul,
                                                  cpu_matmul.default_cache_file(run.cfg))
        if jax.devices()[0].platform == "cpu":
            peak /= jax.local_device_count()  # simulated CPU devices share the host's cores
        summary = logger.summary(time.perf_counter() - started, peak)
        summary["peak_source"] = source
    if run.ckpt is not None:
        run.ckpt.poll(wait=True)  # the last save is part of the run: goodput counts it
    if reason == "lease_lost":  # the run directory is the new holder's: nothing more written
        res.finish(reason)
        end = outcome.decide(reason)
        print_primary(primary, f"maxlite: error: another launch took this run over at step {int(state.step)} "
                               f"({run.lease.lost if run.lease else 'the primary lost its lease'}); this one "
                               f"stopped without writing more (exit {end.code})", err=True)
        return {**summary, **end.fields()}
    fields = res.finish(reason)
    failures = run.ckpt.failures if run.ckpt is not None else []
    lost = run.ckpt.unrecovered_failures() if run.ckpt is not None else []
    end = outcome.decide(reason, lost_saves=lost)
    summary.update(res.scores)
    summary.update({("goodput_" + k if k in ("wall_seconds", "attempt") else k): v for k, v in fields.items()})
    summary.update(end.fields())
    summary["checkpoint_saves_failed"] = len(failures)
    if run.cfg.pipeline_schedule:  # MFU counts the model's FLOPs only: the bubble's idle time lowers it
        summary["pipeline"] = run.cfg.pipeline_schedule
    logger.print_summary(summary)
    print_primary(primary, _badput_line(summary, end.state, int(state.step)))
    if lost:
        steps = ", ".join(str(f["step"]) for f in lost)
        print_primary(primary, f"maxlite: error: {len(lost)} checkpoint save(s) failed with no complete save "
                      f"after them (step(s) {steps}; first error: {lost[0]['error']}); exit "
                      f"{end.code}: the run's progress since its last complete checkpoint is not kept", err=True)
    elif end.reason == "interrupted":
        saved = "saved" if run.ckpt is not None else "not saved (enable_checkpointing=false)"
        print_primary(primary, f"maxlite: stopped by the user at step {int(state.step)} ({saved}); run the same "
                               f"command again to resume from there")
    extra = {"checkpoint_failures": failures} if failures else {}
    run.dir.set_status(end.state, outcome=end, step=int(state.step), summary=summary, **extra)
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


def _vision_words(cfg) -> str:
    """What of the vision encoder trains, in the words of the model line."""
    if cfg.lora_rank:
        return "frozen (LoRA trains the decoder's adapters)"
    return {"frozen": "frozen", "projector": "its projector trains, the rest frozen", "all": "trains"}[cfg.vision_train]


@cli.entry_point()
def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m maxlite.train [base.yml|your.yml] key=value ...\n"
              "keys, defaults and comments: maxlite/configs/base.yml", file=sys.stderr)
        return 0 if argv else 2
    from maxlite.lease import job_identity
    from maxlite.resilience import preemption
    from maxlite.rundir import status_copy

    cfg = C.load(argv)  # a wrong recipe: one line, exit 2 (maxlite/cli.py)
    preemption.catch_outside_the_loop(cfg.preemption_signal_numbers)  # before the loop and after it
    try:
        summary = train(cfg, on_status=status_copy(), job=job_identity())
    except (C.ConfigError, outcome.TransientError):
        raise  # one line (maxlite/cli.py): exit 2, or TRANSIENT (retried)
    except BaseException as e:  # noqa: BLE001 — status.json already says how the run ended
        end = outcome.decide(error=e)
        several = cli.several_processes()
        if end.reason == "crash" and not several:
            raise  # a bug: its traceback, exit 1
        if end.reason == "crash":
            traceback.print_exc()
        elif end.reason != "checkpoint_failed":  # a failed save was reported on stderr already
            if not several or sys.modules["jax"].process_index() == 0:
                print(f"maxlite: {'error: ' if end.reason in ('diverged', 'bad_state') else ''}{end.error}",
                      file=sys.stderr)
        # Out now: a peer may be gone or waiting (cli.leave), a failed save's writer threads may
        # retry dead storage, a second Ctrl-C means now.
        cli.leave(end.code)
    if preemption.noted_signal():  # e.g. Slurm's SIGTERM at the time limit, just after the last step
        print(f"maxlite: got {preemption.noted_signal()} after the run ended; its outcome stands", flush=True)
    return int(summary["exit_code"])


if __name__ == "__main__":
    sys.exit(main())
