"""Resilience with real processes, one at a time: the real loop (`python -m maxlite.train`) on one
process — signals, Ctrl-C, hangs, rollbacks, crashes in a snapshot, one writer per run directory.
Runs on two processes and on Ray: test_resilience_procs.py."""

import json
import os
import re
import signal
import time

import pytest

from maxlite import outcome
from tests.procs import (_complete_checkpoint, checkpoints_listed, fired, finish, losses, remove_snapshots, resumed,
                         rollbacks, run, start, starve_and_finish, status, steps_logged, wait_for)

pytestmark = pytest.mark.timeout(900)  # several training processes one after another (pytest-timeout)


@pytest.fixture(autouse=True)
def _no_snapshots_left(run_dir):
    yield
    remove_snapshots(run_dir)


def test_sigterm_during_compilation_saves_exits_0_and_resumes(run_dir):
    procs, logs = start(run_dir, "c", ["steps=6"])
    # status `running` is written just before the first step, whose call compiles
    wait_for(lambda: status(run_dir, "c").get("state") == "running", procs[0])
    procs[0].send_signal(signal.SIGTERM)
    codes, texts = finish(procs, logs)
    st = status(run_dir, "c")
    assert codes == [0], texts[0][-3000:]
    assert st["state"] == "preempted" and st["summary"]["reason"] == "preempted"
    assert 1 <= st["step"] < 6 and _complete_checkpoint(run_dir, "c", st["step"])
    assert f"step={st['step']}-" in checkpoints_listed(run_dir, "c")
    codes, texts = run(run_dir, "c", ["steps=6"])
    assert codes == [0] and resumed(run_dir, "c") == (st["step"], "checkpoint"), texts[0][-3000:]
    assert status(run_dir, "c")["state"] == "finished" and status(run_dir, "c")["step"] == 6


def test_ctrl_c_saves_says_so_exits_130_and_the_rerun_resumes(run_dir):
    """Ctrl-C (SIGINT) stops a run the way a preemption does — a save at an agreed step — says so in
    one line, exits 130 and leaves status `stopped` (not restarted); the re-run resumes from that
    step. Pressed twice, the run stops at once without a save, and the last complete save stands."""
    from maxlite import checkpoints as ck

    procs, logs = start(run_dir, "i", ["steps=200", "checkpoint_period=2"])
    wait_for(lambda: steps_logged(run_dir, "i") >= 3, procs[0])
    procs[0].send_signal(signal.SIGINT)
    codes, texts = finish(procs, logs)
    st = status(run_dir, "i")
    assert codes == [130], texts[0][-3000:]
    assert (st["state"], st["reason"], st["next"], st["exit_code"]) == ("stopped", "interrupted", "done", 130)
    assert 3 <= st["step"] < 200 and _complete_checkpoint(run_dir, "i", st["step"])
    # Text is the contract here: what the terminal shows after Ctrl-C is one line, no traceback.
    assert texts[0].count(f"maxlite: stopped by the user at step {st['step']} (saved)") == 1
    assert "Traceback" not in texts[0] and "KeyboardInterrupt" not in texts[0]
    codes, texts = run(run_dir, "i", [f"steps={st['step'] + 1}", "checkpoint_period=2"])
    assert codes == [0] and resumed(run_dir, "i") == (st["step"], "checkpoint"), texts[0][-3000:]

    # twice, while step 5 stalls (a 10-minute pause): the first is noted, the second ends it at once
    args = ["steps=200", "checkpoint_period=2", "async_checkpointing=false", "fault_type=pause", "fault_step=5",
            "fault_pause_seconds=600"]
    procs, logs = start(run_dir, "ii", args)
    wait_for(lambda: fired(run_dir, "ii", "pause", 5), procs[0])
    procs[0].send_signal(signal.SIGINT)
    # the terminal's answer to the first Ctrl-C (text is the contract: the user is told it was heard)
    wait_for(lambda: "maxlite: Ctrl-C: saving at the next step" in open(logs[0]).read(), procs[0])
    procs[0].send_signal(signal.SIGINT)
    codes, texts = finish(procs, logs)
    st = status(run_dir, "ii")
    assert codes == [130], texts[0][-3000:]
    assert (st["state"], st["reason"], st["next"]) == ("stopped", "interrupted", "done")
    assert "without a save" in st["error"] and "Traceback" not in texts[0]  # the terminal: no traceback
    assert ck.complete_steps(os.path.join(run_dir, "ii", "checkpoints")) == [2, 4]  # none after the pause
    codes, texts = run(run_dir, "ii", ["steps=5", "checkpoint_period=2", "async_checkpointing=false"])
    assert codes == [0] and resumed(run_dir, "ii") == (4, "checkpoint"), texts[0][-3000:]


def test_hang_is_detected_with_stacks_and_exit_75(run_dir):
    codes, texts = run(run_dir, "h", ["steps=50", "fault_type=hang", "fault_step=6", "enable_checkpointing=false",
                                       "watchdog_min_timeout=3", "watchdog_factor=2"])
    assert codes == [outcome.HANG], texts[0][-3000:]
    log = open(os.path.join(run_dir, "h", "hang_p0.log")).read()
    assert "hang detected in section 'step'" in log and "in at_step" in log  # the stuck frame, for a person to read
    st = status(run_dir, "h")
    assert st["state"] == "failed" and st["exit_code"] == outcome.HANG and "hang" in st["error"]


def test_starved_process_is_slow_not_hung(run_dir):
    """One process computing for 3× its step timeout: slow, not hung. Two: test_resilience_procs.py."""
    starve_and_finish(run_dir, processes=1)


def test_nan_loss_rolls_back_to_disk_and_stops_with_one_line_when_no_rollback_is_left(run_dir):
    args = ["steps=9", "checkpoint_period=3", "fault_type=nan", "fault_step=5", "async_checkpointing=false"]
    codes, texts = run(run_dir, "c", args, devices=2)
    assert codes == [0], texts[0][-3000:]
    (back,) = rollbacks(run_dir, "c")
    assert (back["why"], back["to_step"], back["source"]) == ("loss is nan at step 5", 3, "checkpoint"), back
    assert status(run_dir, "c")["state"] == "finished"
    codes, texts = run(run_dir, "x", args + ["spike_max_rollbacks=0"], devices=2)
    assert codes == [outcome.DIVERGED]
    # text is the contract: a diverged run ends with one error line, no traceback
    assert texts[0].count("maxlite: error: loss is nan at step 5; stopping after 0 rollback(s) "
                          "(spike_max_rollbacks=0)") == 1 and "Traceback" not in texts[0]
    st = status(run_dir, "x")
    assert st["state"] == "failed" and "loss is nan at step 5" in st["error"] and st["next"] == "fail"


def test_crash_during_snapshot_falls_back_to_disk(run_dir):
    args = ["steps=8", "inmemory_snapshot_period=4", "fault_type=crash_in_snapshot", "fault_step=4",
            "checkpoint_period=3", "async_checkpointing=false"]
    codes, texts = run(run_dir, "d", args)
    assert codes == [1] and fired(run_dir, "d", "crash_in_snapshot", 4)
    assert _complete_checkpoint(run_dir, "d", 3)
    codes, texts = run(run_dir, "d", args)
    assert codes == [0], texts[0][-3000:]
    assert resumed(run_dir, "d") == (3, "checkpoint")  # the snapshot of step 4 never completed
    assert status(run_dir, "d")["step"] == 8


def test_one_writer_per_run_directory(run_dir):
    """Two launches of one run started together: exactly one trains, the other exits TRANSIENT (a
    launcher retries it: the holder will end) with one line naming the holder and writes nothing; kill -9 the holder and a relaunch takes the lease over (its
    process is gone) and resumes. A holder whose lease another launch took (a requeue of the same job
    while it still runs) stops without writing more, exit 73."""
    args = ["steps=12", "checkpoint_period=3", "async_checkpointing=false"]
    procs, logs = start(run_dir, "two", args)
    wait_for(lambda: status(run_dir, "two").get("state") == "running", procs[0])
    codes, texts = run(run_dir, "two", args)  # the second launch, while the first holds the run
    assert codes == [outcome.TRANSIENT], texts[0][-3000:]
    line = texts[0].strip().splitlines()[-1]
    # text is the contract: a user's mistake (a second launch) gets exactly this one line
    assert re.fullmatch(rf"maxlite: error: run directory {run_dir}/two is in use by python -m maxlite\.train on host "
                        rf"\S+, pid {procs[0].pid}, since .*, last heartbeat \d+ s ago: one writer per run; .*", line), line
    codes, texts = finish(procs, logs)
    assert codes == [0], texts[0][-3000:]
    assert sorted(losses(run_dir, "two")) == list(range(1, 13))  # one attempt: one line per step
    with open(os.path.join(run_dir, "two", "metrics.jsonl")) as f:
        assert sum('"loss"' in line for line in f) == 12

    procs, logs = start(run_dir, "k", ["steps=200", "checkpoint_period=2", "async_checkpointing=false"])
    wait_for(lambda: steps_logged(run_dir, "k") >= 5, procs[0])
    procs[0].kill()
    finish(procs, logs)
    codes, texts = run(run_dir, "k", ["steps=7", "checkpoint_period=2", "async_checkpointing=false"])
    st = status(run_dir, "k")
    assert codes == [0] and st["state"] == "finished", texts[0][-3000:]
    assert st["lease"]["took_over"]["pid"] == procs[0].pid and st["lease"]["took_over"]["why"] == "its process is gone"
    assert resumed(run_dir, "k")[1] == "checkpoint"

    procs, logs = start(run_dir, "lost", ["steps=100000", "run_lease_seconds=2"])
    wait_for(lambda: steps_logged(run_dir, "lost") >= 3, procs[0])
    lease = os.path.join(run_dir, "lost", "lease.json")
    held = json.load(open(lease))
    with open(lease + ".new", "w") as f:  # what a requeued attempt of the same job does to it
        json.dump({**held, "token": "requeued", "host": "elsewhere", "pid": 1, "launcher": "Slurm job 9 attempt 1",
                   "heartbeat": time.time()}, f)
    os.replace(lease + ".new", lease)
    before = open(os.path.join(run_dir, "lost", "status.json")).read()
    codes, texts = finish(procs, logs)
    assert codes == [outcome.LEASE_LOST], texts[0][-3000:]
    # text is the contract: status.json is the new holder's now, so the console line is all this
    # launch can say about who took the run over
    assert "another launch took this run over" in texts[0] and "Slurm job 9 attempt 1" in texts[0]
    assert open(os.path.join(run_dir, "lost", "status.json")).read() == before  # the new holder's now
    assert json.load(open(lease))["token"] == "requeued"  # left to its holder
