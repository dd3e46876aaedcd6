"""THE decision after each attempt of a run, for every launcher: restart, requeue, fail or done.

`maxlite.outcome` says how an attempt ended (its status.json, or its exit code alone when the
trainer could not write one); `after_attempt` says what follows, against the run's one restart
budget `max_restarts`:

    done      nothing more to do (finished, stopped by the user, at its max_time)
    requeue   preempted and saved: start again; never counted
    restart   a failure a new attempt can get past, with restarts left: counted
    fail      the recipe is wrong, the loss diverged, killed for memory, or no restarts left

The count of restarts is the run's, kept in its run directory (`restarts.json`, local or gs://):
a requeue or a new `fit()` starts from the same count, so failures add up across preemptions and
launchers. The launcher that survives the attempt (the Ray driver, the Slurm batch script through
`python -m maxlite.policy`) writes status.json from the answer: an attempt killed without a word
leaves a status that still says `running`, and one out of restarts said `restart`.

Importable without JAX.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any

import fsspec

from maxlite import outcome
from maxlite.rundir import read_status, write_text

COUNT_FILE = "restarts.json"  # {"restarts": n, "attempts": [what each attempt ended with]}


@dataclasses.dataclass(frozen=True)
class Decision:
    action: str  # one of outcome.ACTIONS
    end: outcome.Outcome  # how the attempt ended (as the trainer said, or its exit code alone)
    restarts: int  # restarts of this run so far, this one included
    budget: int  # max_restarts (-1: unlimited)
    note: str  # one line for the launcher's log

    @property
    def exit_code(self) -> int:
        """The job's exit code when it ends here: the attempt's, never 0 for a failure."""
        if self.action == outcome.FAIL and self.end.code == outcome.FINISHED:
            return outcome.FAILED
        return self.end.code

    def fields(self) -> dict[str, Any]:
        """What status.json records of the answer."""
        out = {**self.end.fields(), "next": self.action, "exit_code": self.exit_code, "restarts": self.restarts,
               "max_restarts": self.budget}
        if self.action == outcome.FAIL:
            out["state"] = "failed"
        return out


def restarts(run_dir: str) -> int:
    """The restarts this run has made so far (0 before its first failure)."""
    return int(_record(run_dir).get("restarts", 0))


def _record(run_dir: str) -> dict[str, Any]:
    try:
        with fsspec.open(f"{run_dir}/{COUNT_FILE}", "r") as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def ended(code: int | None, status: dict | None, killed_for_memory: bool = False) -> outcome.Outcome:
    """How the attempt ended: killed for memory (a launcher's evidence), else what its status.json
    says (when this attempt wrote its end there), else its exit code alone."""
    if killed_for_memory:
        return outcome.decide("out_of_memory")
    if status and status.get("next") in outcome.ACTIONS and "exit_code" in status:
        return outcome.Outcome(int(status["exit_code"]), status.get("state", "failed"), status["next"],
                               status.get("reason", ""), status.get("error", ""))
    return outcome.from_code(outcome.FAILED if code is None else code)


def after_attempt(run_dir: str, max_restarts: int, code: int | None, status: dict | None = None,
                  killed_for_memory: bool = False) -> Decision:
    """THE decision. `code`: the attempt's exit code (None: unknown, a worker died); `status`: the
    status.json this attempt wrote, or None; `killed_for_memory`: the launcher's evidence.
    Counts a restart in the run directory, and writes status.json from the answer."""
    end = ended(code, status, killed_for_memory)
    record = _record(run_dir)
    count, budget = int(record.get("restarts", 0)), max_restarts
    what = f"{outcome.describe(end.reason)}, exit {end.code}" if end.reason else f"exit {end.code}"
    action = end.next
    if action == outcome.RESTART:
        if budget < 0 or count < budget:
            count += 1
            note = f"run failed ({what}): restart {count} of max_restarts={budget}"
        else:
            action = outcome.FAIL
            note = f"run failed ({what}) and no restarts left (max_restarts={budget})"
    elif action == outcome.REQUEUE:
        note = "run preempted and saved: requeueing (not counted against max_restarts)"
    elif action == outcome.FAIL:
        note = f"run failed ({what}): not retried (a restart would repeat it)"
    else:
        note = {"preempted": "run stopped at its max_time budget: launch again to continue",
                "stopped": f"run stopped by the user ({what}): launch again to resume"}.get(end.state, "run finished")
    decision = Decision(action, end, count, budget, note)
    if end.reason == "lease_lost":
        return decision  # the run directory is the new holder's: nothing written
    attempts = [*record.get("attempts", []), {"time": _now(), **decision.fields()}]
    exists = status is not None or read_status(run_dir) is not None or bool(record)
    if action == outcome.RESTART or exists:  # a run refused before its directory leaves none behind
        fs, path = fsspec.url_to_fs(run_dir)
        fs.makedirs(path, exist_ok=True)
        write_text(f"{run_dir}/{COUNT_FILE}", json.dumps({"restarts": count, "attempts": attempts}, indent=1))
        _write_status(run_dir, decision)
    return decision


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _write_status(run_dir: str, decision: Decision) -> None:
    """status.json from the answer, keeping what the attempt recorded (step, summary, lease)."""
    status = read_status(run_dir) or {}
    status.update(decision.fields(), time=_now())
    write_text(f"{run_dir}/status.json", json.dumps(status, indent=1, default=str))


# ---- the Slurm batch script's two calls (it runs them around each attempt) ----


def main(argv: list[str] | None = None) -> int:
    """`python -m maxlite.policy begin EXP_DIR` before an attempt (the job cgroup's out-of-memory
    count, and the trainer's local status copy cleared); `python -m maxlite.policy end EXP_DIR
    RUN_DIR MAX_RESTARTS EXIT_CODE` after it: prints `ACTION EXIT_CODE REASON STATE` for the script, the note
    on stderr (the job's log)."""
    from maxlite import hostmem

    args = sys.argv[1:] if argv is None else argv
    exp_dir = args[1]
    attempt, copy = f"{exp_dir}/attempt.json", f"{exp_dir}/run_status.json"
    if args[0] == "begin":
        fs, _ = fsspec.url_to_fs(copy)
        if fs.exists(copy):
            fs.rm(copy)  # a copy present after the attempt is that attempt's
        write_text(attempt, json.dumps({"oom_kills": hostmem.job_oom_kills()}))
        return 0
    run_dir, budget, code = args[2], int(args[3]), int(args[4])
    try:
        with open(attempt) as f:
            before = json.load(f)["oom_kills"]
    except (OSError, ValueError, KeyError):
        before = 0
    try:
        with open(copy) as f:
            status = json.load(f)
    except (OSError, ValueError):
        status = None  # the trainer wrote none this attempt (refused, or killed)
    kills = hostmem.job_oom_kills() - before
    memory = kills > 0 and not (status and "exit_code" in status)  # a trainer that ended itself was not killed
    decision = after_attempt(run_dir, budget, code, status, killed_for_memory=memory)
    say = lambda line: print(f"[maxlite.policy {time.strftime('%H:%M:%S', time.gmtime())}] {line}", file=sys.stderr)
    say(f"trainer exited with {code}; run state: {decision.end.state}; next: {decision.action}")
    if memory:
        say(f"trainer killed for memory: this job's cgroup counted {kills} out-of-memory kill(s); not "
              f"requeued (it would be killed again): lower per_device_batch_size, give the job more memory, or "
              f"check the fit with python -m maxlite.plan")
    else:
        say(decision.note)
    print(decision.action, decision.exit_code, decision.end.reason or "-", decision.end.state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
