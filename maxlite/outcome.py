"""How a run ended, in one place: what happened → (exit code, status.json state, next action).

`decide(reason=..., error=..., lost_saves=...)` is THE map. The loop's end, a failure, the hang
watchdog, the Ray worker and `main` all call it; status.json records its answer (`exit_code`,
`state`, `next`, `reason`), and maxlite.policy turns `next` into what a launcher does against the
run's restart count:

    done      finished, stopped at its own time budget (max_time), or stopped by the user: nothing to do
    requeue   preempted (a signal or a drain) and saved: start again from that checkpoint, uncounted
    restart   a failure a new attempt can get past (crash, hang, straggler, failed save, a passing
              condition): counted against the run's one restart budget, `max_restarts`
    fail      never retried: the recipe is wrong, or the loss diverged (the same data would diverge
              again)

A launcher that has no status of this attempt (the trainer was killed) has only the exit code:
`from_code(code)` is the same map read from the code alone.

Importable without JAX (launchers, config, the Slurm script generator use it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

# ---- exit codes ----
FINISHED = 0  # steps done; also preempted-and-saved and max_time (status.json tells them apart)
FAILED = 1  # an uncaught error (also an injected crash)
CONFIG_ERROR = 2  # the recipe is wrong: one line, never retried
CHECKPOINT_FAILED = 74  # a checkpoint save failed and no later save succeeded (EX_IOERR)
HANG = 75  # the watchdog saw a section exceed its timeout (EX_TEMPFAIL: "try again")
STRAGGLER = 76  # stop_if_straggler: a process scored below straggler_threshold
PREEMPT_TIMEOUT = 77  # a preemption signal, but no safe point within preemption_grace_seconds
DIVERGED = 78  # the loss went bad with no rollback left: a restart would repeat it
BAD_STATE = 79  # restored states go bad at their first step and none older is left: a restart would too
LEASE_LOST = 73  # another launch took the run directory over (EX_CANTCREAT): this one stops writing
OUT_OF_MEMORY = 137  # killed by the kernel (or Ray's monitor) for memory, as a launcher found out: a
#                     restart would be killed again. 137 alone (any SIGKILL) is not proof: a restart
TRANSIENT = 69  # a condition that passes (a live writer's lease, a staged copy that failed its check): retried
INTERRUPTED = 130  # the user stopped it (Ctrl-C, SIGINT; the shell's 128 + 2): saved first, unless pressed twice

# ---- next actions ----
DONE, REQUEUE, RESTART, FAIL = "done", "requeue", "restart", "fail"
ACTIONS = (DONE, REQUEUE, RESTART, FAIL)

# stop reasons the loop ends with (the cross-host vote's answers) and failures without an exception
_REASONS = {  # reason → (exit code, status state, next)
    None: (FINISHED, "finished", DONE),
    "preempted": (FINISHED, "preempted", REQUEUE),
    "max_time": (FINISHED, "preempted", DONE),
    "interrupted": (INTERRUPTED, "stopped", DONE),
    "straggler": (STRAGGLER, "failed", RESTART),
    "hang": (HANG, "failed", RESTART),
    "preempt_timeout": (PREEMPT_TIMEOUT, "failed", RESTART),
    "checkpoint_failed": (CHECKPOINT_FAILED, "failed", RESTART),
    "config": (CONFIG_ERROR, "failed", FAIL),
    "diverged": (DIVERGED, "failed", FAIL),
    "bad_state": (BAD_STATE, "failed", FAIL),
    "crash": (FAILED, "failed", RESTART),
    "transient": (TRANSIENT, "failed", RESTART),  # worded as such: "run again", "wait"
    "lease_lost": (LEASE_LOST, "failed", FAIL),  # status.json is the new holder's: not written
    "out_of_memory": (OUT_OF_MEMORY, "failed", FAIL),  # decided by a launcher with the evidence
}
STOP_REASONS = ("max_time", "preempted", "straggler", "interrupted", "lease_lost")  # what the loop's vote can answer


class LossDiverged(RuntimeError):
    """The loss went bad, the evidence points at the data or the optimisation, and no rollback is
    left (or possible): the run stops with this line."""


class BadState(RuntimeError):
    """Restored states go bad at their first step, and no rollback to an older one is left (or
    possible): not a diverged run; the run stops with this line."""


class TransientError(RuntimeError):
    """Not the recipe's fault and not lasting (another launch still holds the run's lease; a staged
    data copy failed its verification): one line, and a new attempt is made (counted)."""


class CheckpointSaveError(RuntimeError):
    """A save failed and checkpoint_error_policy=stop: the run ends (status failed), earlier
    checkpoints intact."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    code: int  # the process's exit code
    state: str  # status.json `state`: finished | preempted | stopped | failed
    next: str  # one of ACTIONS
    reason: str = ""  # "" (finished) or a key of _REASONS
    error: str = ""  # one line, for a failure

    def fields(self) -> dict[str, Any]:
        """What status.json (and a run summary) records of it."""
        out: dict[str, Any] = {"state": self.state, "exit_code": self.code, "next": self.next}
        if self.reason:
            out["reason"] = self.reason
        if self.error:
            out["error"] = self.error
        return out


def reason_of(error: BaseException) -> str:
    """The reason an exception ends a run with."""
    from maxlite.config import ConfigError

    if isinstance(error, ConfigError):
        return "config"
    if isinstance(error, LossDiverged):
        return "diverged"
    if isinstance(error, BadState):
        return "bad_state"
    if isinstance(error, CheckpointSaveError):
        return "checkpoint_failed"
    if isinstance(error, TransientError):
        return "transient"
    if isinstance(error, KeyboardInterrupt):  # Ctrl-C pressed twice: out at once, without a save
        return "interrupted"
    return "crash"


def decide(reason: str | None = None, error: BaseException | None = None,
           lost_saves: Sequence[dict] = ()) -> Outcome:
    """THE map. `reason`: the loop's agreed stop reason (None: it finished) or a failure without an
    exception ("hang", "preempt_timeout"); `error`: the exception that ended the run instead;
    `lost_saves`: failed checkpoint saves with no complete save after them — a failed save is never
    success, whatever else happened, unless the recipe itself was wrong or the loss diverged."""
    text = ""
    if error is not None:
        reason = reason_of(error)
        first = (str(error).strip().splitlines() or [""])[0]
        text = (first if reason in ("config", "diverged", "bad_state", "transient") else f"{type(error).__name__}: {first}")[:500]
    if lost_saves and reason not in ("config", "diverged", "bad_state"):
        reason = "checkpoint_failed"
        text = text or f"{len(lost_saves)} checkpoint save(s) failed with no complete save after them " \
                       f"(first: step {lost_saves[0]['step']}: {lost_saves[0]['error']})"
    if reason not in _REASONS:
        raise ValueError(f"unknown run end reason {reason!r}")
    code, state, action = _REASONS[reason]
    if reason == "interrupted" and error is not None:
        text = "stopped by a second Ctrl-C, without a save"
    return Outcome(code, state, action, reason or "", text)


def from_code(code: int) -> Outcome:
    """How an attempt ended, from its exit code alone (a shell's 128 + N for a signal N; Python's
    -N): a code that is one reason's own names it; any other is a crash (a restart)."""
    code = 128 - code if code < 0 else code
    own = [r for r, (c, _, _) in _REASONS.items() if c == code]
    reason = own[0] if len(own) == 1 and code not in (FAILED, OUT_OF_MEMORY) else None
    if reason is None:
        return decide() if code == FINISHED else Outcome(code, "failed", RESTART, "crash")
    return decide(reason)


def describe(reason: str) -> str:
    """A few words for a launcher's log line."""
    return {"config": "configuration error", "diverged": "the loss diverged",
            "bad_state": "every state to roll back to goes bad", "interrupted": "stopped by the user",
            "checkpoint_failed": "a checkpoint save failed", "hang": "a hang", "straggler": "a straggler",
            "preempt_timeout": "no safe point within the preemption grace", "crash": "a crash",
            "preempted": "preempted", "max_time": "its max_time budget",
            "lease_lost": "another launch took the run over", "out_of_memory": "killed for memory",
            "transient": "a passing condition"}.get(reason, reason or "finished")
