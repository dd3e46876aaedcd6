"""maxlite.outcome: how a run ended → (exit code, status state, next action), the one map every
launcher follows; and that nothing else in maxlite assigns exit codes or next actions."""

import pathlib
import re
import subprocess

import pytest

from maxlite import config as C, outcome as O
from maxlite.launch import slurm

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("reason, error, want", [
    (None, None, (0, "finished", "done")),
    ("preempted", None, (0, "preempted", "requeue")),  # saved: start again, never counted
    ("max_time", None, (0, "preempted", "done")),  # the recipe's own budget
    ("interrupted", None, (130, "stopped", "done")),  # Ctrl-C: saved, the user's choice stands
    ("straggler", None, (76, "failed", "restart")),
    ("hang", None, (75, "failed", "restart")),
    ("preempt_timeout", None, (77, "failed", "restart")),
    (None, C.ConfigError("bad recipe"), (2, "failed", "fail")),
    (None, O.LossDiverged("loss is nan"), (78, "failed", "fail")),  # the same data would diverge again
    (None, O.CheckpointSaveError("disk"), (74, "failed", "restart")),
    (None, KeyboardInterrupt(), (130, "stopped", "done")),  # Ctrl-C twice: no save, still the user's stop
    (None, RuntimeError("boom"), (1, "failed", "restart")),
    (None, O.TransientError("in use: run again"), (69, "failed", "restart")),  # worded as a retry: retried
])
def test_each_way_a_run_ends_has_one_answer(reason, error, want):
    end = O.decide(reason, error)
    assert (end.code, end.state, end.next) == want
    assert end.fields()["exit_code"] == want[0] and end.fields()["next"] == want[2]


def test_a_lost_save_is_never_success_but_does_not_hide_a_wrong_recipe():
    lost = [{"step": 6, "error": "OSError: no space"}]
    assert O.decide(None, lost_saves=lost).code == O.CHECKPOINT_FAILED
    assert O.decide("preempted", lost_saves=lost).next == O.RESTART
    assert "step 6" in O.decide(None, lost_saves=lost).error
    assert O.decide(None, C.ConfigError("x"), lost).code == O.CONFIG_ERROR
    assert O.decide(None, O.LossDiverged("x"), lost).code == O.DIVERGED


def test_launchers_without_a_status_read_the_exit_code_by_the_same_map():
    for reason in ("interrupted", "hang", "straggler", "preempt_timeout", "config", "diverged", "checkpoint_failed",
                   "transient"):
        end = O.decide(reason)
        assert O.from_code(end.code) == end, reason
    assert O.from_code(0).next == "done"  # an entrypoint that writes no status.json
    assert O.from_code(-9).next == "restart" and O.from_code(137).next == "restart"  # SIGKILL, bare or by a shell
    assert O.from_code(-9).code == 137  # what a shell would say of it


def test_exit_codes_and_next_actions_are_assigned_in_one_module():
    """`grep` finds one place that assigns exit codes (outcome._REASONS) and one that maps them to the
    next action: no other module spells a code or an action."""
    found = subprocess.run(["git", "grep", "-nE", r"exit_code\s*=\s*[0-9]|\"next\"\s*:\s*\"|next_action\(|"
                            r"launcher_action|exit_codes\.", "--", "maxlite", "ray_entry"],
                           cwd=ROOT, capture_output=True, text=True).stdout
    assert found == "", found


def test_a_kill_is_a_restart_unless_a_launcher_knows_it_was_for_memory():
    """137 alone is any SIGKILL (a crash test, a node's death): restarted. Killed for memory is a
    launcher's finding (the job cgroup's OOM count, Ray's memory monitor): not retried."""
    import ray.exceptions

    from maxlite.launch import ray_trainer

    assert O.from_code(137).next == "restart"
    end = O.decide("out_of_memory")
    assert (end.code, end.state, end.next) == (137, "failed", "fail")

    class Failed(Exception):  # Ray Train's TrainingFailedError carries the workers' causes
        def __init__(self, causes):
            self.worker_failures = causes

    monitor = ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory.")
    assert ray_trainer._killed_for_memory(Failed({1: monitor}))
    wrapped = RuntimeError("the worker's task failed")  # Ray wraps the monitor's error in its own
    wrapped.__cause__ = monitor
    assert ray_trainer._killed_for_memory(Failed({1: wrapped}))
    assert not ray_trainer._killed_for_memory(Failed({1: RuntimeError("maxlite: training stopped with exit code 75")}))
    # Ray's text for any worker that died lists the OOM killer among the common causes: a crash
    died = RuntimeError("The actor is dead because its worker process has died. Some common causes include: (1) "
                        "the process was killed by the OOM killer due to high memory usage, (2) ray stop --force was "
                        "called, or (3) the worker crashed unexpectedly due to SIGSEGV")
    assert not ray_trainer._killed_for_memory(Failed({0: died}))
