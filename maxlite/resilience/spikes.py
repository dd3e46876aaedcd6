"""The loss watch: a non-finite loss, or one above `spike_factor` × the median of the recent good
losses for `spike_patience` steps in a row, is a verdict to roll back (train.py acts on it).

A verdict also says what the evidence points at. A bad stretch that begins at the very first step
after a rollback implicates the state that rollback restored: it went bad with other batches than
the ones that led to the rollback, so skipping data cannot help, and the next rollback goes to an
older state (maxlite/rollback.py). Otherwise the evidence points at the data or the optimisation.

Pure host-side arithmetic on the losses the loop already reads (one step late), so every host,
reading the same replicated loss, reaches the same verdict at the same step without a vote.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

WINDOW = 32  # good losses the median is taken over
MIN_HISTORY = 8  # good losses needed before a spike can be judged (the early loss falls fast)


@dataclass(frozen=True)
class Verdict:
    first_bad: int  # the first step of the bad stretch (a 1-based count of completed steps)
    step: int  # the step whose loss completed the verdict
    why: str  # one line: what was seen
    state_step: int | None = None  # the restored state the evidence points at (bad at its first step)


class SpikeWatch:
    def __init__(self, factor: float, patience: int):
        """`factor` 0 judges non-finite losses only."""
        self.factor, self.patience = factor, max(1, patience)
        self._good: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._run: list[tuple[int, float]] = []  # the current stretch of spiked losses
        self._restored: int | None = None  # the step of the state the last rollback restored

    def _verdict(self, first_bad: int, step: int, why: str) -> Verdict:
        suspect = self._restored if self._restored is not None and first_bad == self._restored + 1 else None
        return Verdict(first_bad, step, why, suspect)

    def see(self, step: int, loss: float, finite: bool = True) -> Verdict | None:
        """The loss of `step` (`finite`: its loss and gradient were); a Verdict when the run must
        roll back."""
        if not math.isfinite(loss):
            return self._verdict(step, step, f"loss is {loss} at step {step}")
        if not finite:
            return self._verdict(step, step, f"the gradient is not finite at step {step} (loss {loss:.4g})")
        if self.factor > 0 and len(self._good) >= MIN_HISTORY:
            median = statistics.median(v for _, v in self._good)
            if loss > self.factor * median:
                self._run.append((step, loss))
                if len(self._run) >= self.patience:
                    first = self._run[0][0]
                    return self._verdict(first, step, f"loss {loss:.4g} above {self.factor:g} × the median "
                                                f"{median:.4g} of the last {len(self._good)} good steps "
                                                f"for {len(self._run)} step(s), steps {first}..{step}")
                return None
        self._run = []
        self._good.append((step, loss))
        return None

    def rolled_back(self, to_step: int) -> None:
        """The run goes on from `to_step` (a restored state): forget what came after it."""
        self._run, self._restored = [], to_step
        kept = [(s, v) for s, v in self._good if s <= to_step]
        self._good.clear()
        self._good.extend(kept)
