"""Process exit codes of a maxlite training, in one place (launchers and docs read them here).

0 means "do not restart": the run finished, or it was preempted / hit `max_time` and saved — then
status.json says `preempted` and a launcher requeues it. The non-zero codes below mean "restart me"
(up to `max_restarts` times); 2 is a user mistake and must not be retried.
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



def should_restart(code: int, status_state: str | None, restarts_done: int, max_restarts: int) -> bool:
    """What a launcher does after a process exits: requeue a preempted run, restart failures up to a limit."""
    if code == FINISHED and status_state == "preempted":
        return True  # requeue: does not count against max_restarts
    # any other failure (incl. killed by a signal: negative or >128) restarts, a config error never
    return code not in (FINISHED, CONFIG_ERROR) and restarts_done < max_restarts
