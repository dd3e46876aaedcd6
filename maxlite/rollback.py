"""What the loop does about a bad loss: `Rollbacks` judges each loss (resilience/spikes.py) and,
on a verdict, rolls the run back to its newest good state and skips the data since. When the
state a rollback restored goes bad again at its first step, the next rollback goes to an older
state instead (the evidence points at the state, not the data), and when none is left the run
stops with BadState, not with a diverged verdict."""

from __future__ import annotations

from maxlite import resume
from maxlite.outcome import BadState, LossDiverged
from maxlite.resilience.spikes import SpikeWatch, Verdict
from maxlite.rundir import print_primary


class Rollbacks:
    def __init__(self, cfg, built, ckpt, batches, run_dir, primary: bool, start_step: int):
        self.cfg, self.built, self.ckpt, self.batches = cfg, built, ckpt, batches
        self.dir, self.primary = run_dir, primary
        self.watch = SpikeWatch(cfg.spike_factor, cfg.spike_patience)
        self.count = 0
        # (step, global batches read before that step's batch): where the step → data map jumps
        # (the attempt's start, each rollback); a rollback reports the samples it skips from it
        self.segments = [(start_step, batches.batches_read)]

    def see(self, step: int, loss: float, finite: bool) -> Verdict | None:
        """The loss of `step`; a Verdict when the run must roll back."""
        return self.watch.see(step, loss, finite)

    def roll_back(self, res, verdict: Verdict, last_dispatched: int) -> resume.Start:
        """Back to the newest snapshot or checkpoint before the bad stretch began (maxlite.resume's
        rule) — or, when the evidence points at the state the last rollback restored, before that
        state — the newer saves (bad states) deleted, the data position left where it is: the
        batches read since that state are skipped, and listed in `rollbacks.jsonl`. Every host
        reaches the same verdict at the same step (the loss is global). Collective."""
        cfg, suspect = self.cfg, verdict.state_step
        bound = suspect - 1 if suspect is not None else verdict.first_bad - 1
        if self.count >= cfg.spike_max_rollbacks:
            raise self._stop(verdict, f"stopping after {self.count} rollback(s) "
                                      f"(spike_max_rollbacks={cfg.spike_max_rollbacks})")
        with res.section("rollback"):
            if self.ckpt is not None:
                self.ckpt.poll(wait=True)  # a save in flight is complete (or failed) before choosing
            start = resume.rollback(self.built, self.ckpt, res.restore, bound)
            if start is not None:  # only then: with nothing to go back to, the states stay as they are
                if self.ckpt is not None:
                    self.ckpt.discard_after(bound)
                if res.snapshots is not None:
                    res.snapshots.drop_after(bound)
        if start is None:
            raise self._stop(verdict, f"no in-memory snapshot or checkpoint at or before step {bound} to roll "
                                      f"back to (inmemory_snapshot_period, checkpoint_period): stopping")
        self.count += 1
        end = self.batches.batches_read
        seg_step, seg_batch = max((s for s in self.segments if s[0] <= start.step), default=self.segments[0])
        begin = seg_batch + (start.step - seg_step)  # the batch the restored state's next step read
        gb = cfg.global_batch_size
        self.dir.append_jsonl("rollbacks.jsonl", {
            "rollback": self.count, "why": verdict.why, "to_step": start.step, "source": start.source,
            "suspect": "state" if suspect is not None else "data", "bad_state_step": suspect,
            "steps_undone": [start.step + 1, last_dispatched], "skipped_batches": [begin, end],
            "skipped_samples": [begin * gb, end * gb]})
        self.dir.sticky["rollbacks"] = self.count
        further = (f"the state of step {suspect} went bad again at its first step, with other batches: the "
                   f"state is suspect, not the data; " if suspect is not None else "")
        print_primary(self.primary, f"maxlite: {verdict.why}: {further}rolled back to step {start.step} "
                                    f"({start.source} {start.where}, {start.seconds:.2f} s); skipping global batches "
                                    f"{begin}..{end - 1} (samples {begin * gb}..{end * gb - 1}); "
                                    f"rollback {self.count} of at most {cfg.spike_max_rollbacks}")
        self.watch.rolled_back(start.step)
        self.segments.append((start.step, end))
        return start

    def _stop(self, verdict: Verdict, how: str) -> RuntimeError:
        """The error that ends the run: a diverged loss, unless the evidence points at a state."""
        if verdict.state_step is None:
            return LossDiverged(f"{verdict.why}; {how}")
        return BadState(f"{verdict.why}, at the first step after rolling back to step {verdict.state_step}: "
                        f"that state goes bad with other batches too (not a diverged run); {how}")
