"""Process exit codes of a maxlite training, in one place (launchers and docs read them here).

0 means "do not restart": the run finished, or it was preempted / hit `max_time` and saved — then
status.json says `preempted` (with `reason`). The non-zero codes below mean "restart me" (up to
`max_restarts` times); 2 (a user mistake) and 78 (a diverged loss) must not be retried. `next_action` below is the
whole rule, and the only copy of it.
"""

from __future__ import annotations

FINISHED = 0  # steps done; status.json state=finished
PREEMPTED = 0  # signal or max_time: final checkpoint written; status.json state=preempted → requeue
FAILED = 1  # an uncaught error (also an injected crash); restart from the newest snapshot/checkpoint
CONFIG_ERROR = 2  # the recipe is wrong: fix it, never retry
CHECKPOINT_FAILED = 74  # a checkpoint save failed and no later save succeeded (EX_IOERR); restart
HANG = 75  # the watchdog saw a section exceed its timeout (EX_TEMPFAIL: "try again")
STRAGGLER = 76  # stop_if_straggler: a process scored below straggler_threshold; restart elsewhere
PREEMPT_TIMEOUT = 77  # preemption signal but no safe point within preemption_grace_seconds
DIVERGED = 78  # the loss went bad with no rollback left (spike_max_rollbacks): a restart would repeat it

# What a launcher does after a trainer exits. THE rule: the trainer writes its answer into
# status.json (`next`); the Slurm batch script and the Ray driver follow it; a launcher only counts.
DONE = "done"  # finished, or stopped at its own time budget (max_time): nothing more to do
REQUEUE = "requeue"  # preempted and saved: start again from that checkpoint; not a failure
RESTART = "restart"  # failed (crash, hang, straggler, failed save, killed): restart, counted
FAIL = "fail"  # the recipe is wrong, the loss diverged (or no restarts are left): never retry
ACTIONS = (DONE, REQUEUE, RESTART, FAIL)


def next_action(code: int, status: dict | None) -> str:
    """After exit `code` with status.json `status` (None when this attempt wrote none, e.g. killed
    with SIGKILL or a command other than the trainer): done | requeue | restart | fail."""
    state = (status or {}).get("state")
    if code in (CONFIG_ERROR, DIVERGED):
        return FAIL
    if code == FINISHED and state in ("finished", None):
        return DONE
    if code == PREEMPTED and state == "preempted":
        return DONE if status.get("reason") == "max_time" else REQUEUE
    return RESTART  # any failure, including a signal (negative, or 128+N from a shell)


def launcher_action(code: int, status: dict | None, failures_so_far: int, max_restarts: int) -> str:
    """`next_action`, with the launcher's count: restarts stop after `max_restarts` failures
    (requeues after a preemption are not failures and are not counted)."""
    action = next_action(code, status)
    if action == RESTART and failures_so_far >= max_restarts:
        return FAIL
    return action
