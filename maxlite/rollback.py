"""What the training loop does on a bad loss (resilience/spikes.py's verdict): roll back.

`roll_back(run, res, verdict, last_dispatched)` takes the loop's run (train._Run) and Resilience.
"""

from __future__ import annotations

from maxlite import resume
from maxlite.resilience.spikes import LossDiverged
from maxlite.rundir import print_primary


def roll_back(run, res, verdict, last_dispatched: int) -> int:
    """Back to the newest snapshot or checkpoint before the bad stretch began (maxlite.resume's
    rule), the newer saves (bad states) deleted, the data position left where it is: the batches
    read since that state are skipped, and listed in `rollbacks.jsonl`. Returns the step to go on
    from. Every host reaches the same verdict at the same step (the loss is global)."""
    cfg, bound = run.cfg, verdict.first_bad - 1
    if run.rollbacks >= cfg.spike_max_rollbacks:
        raise LossDiverged(f"{verdict.why}; stopping after {run.rollbacks} rollback(s) "
                           f"(spike_max_rollbacks={cfg.spike_max_rollbacks})")
    with res.section("rollback"):
        if run.ckpt is not None:
            run.ckpt.discard_after(bound)
        if res.snapshots is not None:
            res.snapshots.drop_after(bound)
        start = resume.rollback(run.built, run.ckpt, res.restore, bound)
    if start is None:
        raise LossDiverged(f"{verdict.why}; no in-memory snapshot or checkpoint at or before step {bound} "
                           f"to roll back to (inmemory_snapshot_period, checkpoint_period): stopping")
    run.rollbacks += 1
    end = run.batches.batches_read
    seg_step, seg_batch = max((s for s in run.segments if s[0] <= start.step), default=run.segments[0])
    begin = seg_batch + (start.step - seg_step)  # the batch the restored state's next step read
    gb = cfg.global_batch_size
    record = {"rollback": run.rollbacks, "why": verdict.why, "to_step": start.step, "source": start.source,
              "steps_undone": [start.step + 1, last_dispatched], "skipped_batches": [begin, end],
              "skipped_samples": [begin * gb, end * gb]}
    run.dir.append_jsonl("rollbacks.jsonl", record)
    run.dir.sticky["rollbacks"] = run.rollbacks
    print_primary(run.primary, f"maxlite: {verdict.why}: rolled back to step {start.step} ({start.source} "
                               f"{start.where}, {start.seconds:.2f} s); "
                               f"skipping global batches {begin}..{end - 1} (samples {begin * gb}..{end * gb - 1}); "
                               f"rollback {run.rollbacks} of at most {cfg.spike_max_rollbacks}")
    run.state = start.state
    run.watch.rolled_back(start.step)
    run.segments.append((start.step, end))
    return start.step
