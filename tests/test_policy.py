"""maxlite.policy: what follows an attempt (restart, requeue, fail, done) against the run's one
restart count, kept in the run directory, and status.json written from the answer."""

import json
import subprocess
import sys

from maxlite import outcome as O, policy

PREEMPTED = O.decide("preempted").fields()  # what a trainer that saved on a preemption writes
CRASHED = O.decide(error=RuntimeError("boom")).fields()


def _status(run_dir):
    return json.loads((run_dir / "status.json").read_text())


def test_a_requeue_does_not_reset_the_failure_count(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    first = policy.after_attempt(str(run), 1, O.FAILED, CRASHED)
    assert (first.action, first.restarts) == ("restart", 1)
    requeued = policy.after_attempt(str(run), 1, O.FINISHED, PREEMPTED)  # a new job, fit() or driver next
    assert (requeued.action, requeued.restarts) == ("requeue", 1)
    again = policy.after_attempt(str(run), 1, O.FAILED, CRASHED)
    assert (again.action, again.restarts, again.exit_code) == ("fail", 1, O.FAILED)
    assert policy.restarts(str(run)) == 1
    st = _status(run)
    assert (st["state"], st["next"], st["exit_code"], st["restarts"]) == ("failed", "fail", O.FAILED, 1)


def test_a_worker_that_died_without_a_word_ends_with_status_and_exit_code_agreeing(tmp_path):
    """The trainer was killed: its status.json still says `running`; the launcher writes the end."""
    run = tmp_path / "r"
    run.mkdir()
    (run / "status.json").write_text(json.dumps({"state": "running", "step": 6, "lease": {"pid": 1}}))
    end = policy.after_attempt(str(run), 0, None)  # max_restarts=0, exit code unknown (a Ray worker)
    st = _status(run)
    assert (end.action, end.exit_code) == ("fail", O.FAILED)
    assert (st["state"], st["next"], st["exit_code"], st["reason"]) == ("failed", "fail", O.FAILED, "crash")
    assert st["step"] == 6 and st["lease"] == {"pid": 1}  # what the attempt recorded stays
    killed = policy.after_attempt(str(run), -1, -9)  # unlimited: a SIGKILL is restarted, as a shell says it
    assert (killed.action, killed.end.code, _status(run)["next"]) == ("restart", 137, "restart")


def test_killed_for_memory_a_wrong_recipe_and_a_lost_lease(tmp_path):
    run = tmp_path / "r"
    oom = policy.after_attempt(str(run), 5, 137, killed_for_memory=True)
    assert (oom.action, oom.exit_code, oom.end.reason) == ("fail", 137, "out_of_memory")
    assert not run.exists()  # refused before its run directory: nothing written for it
    recipe = policy.after_attempt(str(run), 5, O.CONFIG_ERROR)
    assert (recipe.action, recipe.exit_code) == ("fail", O.CONFIG_ERROR) and not run.exists()
    run.mkdir()
    (run / "status.json").write_text(json.dumps({"state": "running", "owner": "the new holder"}))
    lost = policy.after_attempt(str(run), 5, O.LEASE_LOST, O.decide("lease_lost").fields())
    assert lost.action == "fail" and _status(run) == {"state": "running", "owner": "the new holder"}
    assert policy.restarts(str(run)) == 0


def test_the_slurm_batch_script_asks_the_policy(tmp_path):
    """The script's two calls, as it makes them: `begin` clears the trainer's local status copy of
    an earlier attempt; `end` prints ACTION EXIT_CODE REASON STATE and counts the restart."""
    exp, run = tmp_path / "exp", tmp_path / "runs" / "r"
    exp.mkdir()
    (exp / "run_status.json").write_text(json.dumps(PREEMPTED))  # an earlier attempt's

    def call(*args):
        done = subprocess.run([sys.executable, "-m", "maxlite.policy", *args], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    assert call("begin", str(exp)) == [] and not (exp / "run_status.json").exists()
    assert call("end", str(exp), str(run), "1", "137") == ["restart", "137", "crash", "failed"]
    assert policy.restarts(str(run)) == 1
    call("begin", str(exp))
    (exp / "run_status.json").write_text(json.dumps(PREEMPTED))  # this attempt's trainer saved and said so
    assert call("end", str(exp), str(run), "1", "0") == ["requeue", "0", "preempted", "preempted"]
    call("begin", str(exp))
    assert call("end", str(exp), str(run), "1", "1") == ["fail", "1", "crash", "failed"]
    assert _status(run)["next"] == "fail" and _status(run)["restarts"] == 1
