"""Resilience with real processes: the real loop (`python -m maxlite.train`) on two processes
(jax.distributed + gloo on CPU), and a Ray cluster (`python -m ray_entry.train`). One-process runs:
test_resilience_one_process.py (they may run beside other tests; these may not: tests/conftest.py)."""

import glob
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from maxlite.resilience.keeper import run_key
from tests.helpers import shown
from tests.procs import (ROOT, TINY, _complete_checkpoint, batch_hashes, finish, fired, losses, remove_snapshots,
                         resumed, rollbacks, run, starve_and_finish, start, status, steps_logged, wait_for)
from tests.ray_cluster import ray_env


@pytest.fixture(autouse=True)
def _no_snapshots_left(run_dir):
    yield
    remove_snapshots(run_dir)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """step → loss of one uninterrupted 10-step run on two processes (2 × 2 devices): what every
    interrupted run below must end at, bit for bit (checkpoints and snapshots change no number)."""
    run_dir = str(tmp_path_factory.mktemp("uninterrupted"))
    codes, texts = run(run_dir, "ref", ["steps=10"], processes=2)
    assert codes == [0, 0], shown(texts)
    return losses(run_dir, "ref")


def test_sigterm_mid_run_saves_at_the_same_step_on_both_processes_and_resumes(run_dir):
    procs, logs = start(run_dir, "m", ["steps=200"], processes=2)
    wait_for(lambda: steps_logged(run_dir, "m") >= 3, procs[0])
    procs[1].send_signal(signal.SIGTERM)  # only one host gets the signal; both must stop together
    codes, texts = finish(procs, logs)
    st = status(run_dir, "m")
    assert codes == [0, 0], shown(texts)
    assert st["state"] == "preempted" and st["exit_code"] == 0 and 3 <= st["step"] < 200
    assert _complete_checkpoint(run_dir, "m", st["step"])  # saved collectively: both hosts at that step
    assert max(losses(run_dir, "m")) == st["step"]
    assert st["summary"]["badput_startup_seconds"] > 0
    # re-running resumes from that checkpoint (and stops right away: steps is lowered to it + 1)
    codes, texts = run(run_dir, "m", [f"steps={st['step'] + 1}"], processes=2)
    assert codes == [0, 0] and resumed(run_dir, "m") == (st["step"], "checkpoint"), shown(texts)
    assert status(run_dir, "m")["state"] == "finished"


def test_two_processes_saving_every_step_killed_and_rerun_end_at_the_uninterrupted_losses(run_dir, uninterrupted):
    """Async saves run Orbax on a writer thread (coordination-service barriers) while the loop's own
    gloo collectives go on: saving at every step must neither hang nor change training, a SIGKILL of
    both hosts mid-run leaves only complete checkpoints behind, and the rerun ends bit-identical."""
    from maxlite import checkpoints as ck

    args = ["steps=10", "checkpoint_period=1", "max_num_checkpoints_to_keep=2"]
    procs, logs = start(run_dir, "x", args, processes=2)
    wait_for(lambda: steps_logged(run_dir, "x") >= 5, procs[0])
    for p in procs:
        p.kill()
    finish(procs, logs)
    saved = ck.complete_steps(os.path.join(run_dir, "x", "checkpoints"))
    assert saved and max(saved) < 10
    codes, texts = run(run_dir, "x", args, processes=2)
    assert codes == [0, 0], shown(texts)
    assert resumed(run_dir, "x") == (max(saved), "checkpoint"), shown(texts)
    assert losses(run_dir, "x") == uninterrupted  # all 10 steps, bit-identical
    assert sorted(ck.complete_steps(os.path.join(run_dir, "x", "checkpoints")))[-2:] == [9, 10]


def test_starved_process_is_slow_not_hung(run_dir):
    """The last of two processes keeps computing (starved by a loaded machine, or compiling) for 3×
    its step timeout; the other, waiting for it in the step's collectives, sees its peer's work
    (without it, it was killed as hung). One process: test_resilience_one_process.py."""
    starve_and_finish(run_dir, processes=2)


def test_a_peers_stall_is_the_steps_time_not_other(run_dir):
    """Process 1 stalls 12 s once; process 0 waits for it in the step's collectives, the stop vote
    or the next read. Goodput (process 0's) counts that wait as the step's time: `other` was where
    it went, with most of every step's wait on a peer."""
    pause = 12.0
    codes, texts = run(run_dir, "g", ["steps=8", "enable_checkpointing=false", "fault_type=pause", "fault_step=4",
                                       "fault_process=1", f"fault_pause_seconds={pause}"], processes=2)
    assert codes == [0, 0], shown(texts)
    assert fired(run_dir, "g", "pause", 4, 1)
    summary = status(run_dir, "g")["summary"]
    assert summary["productive_seconds"] >= pause  # the 12 s wait landed in a step (the accounting
    # itself, on an injected clock: tests/test_resilience_units.py)
    causes = sum(v for k, v in summary.items() if k.startswith("badput_"))
    assert causes + summary["productive_seconds"] == pytest.approx(summary["goodput_wall_seconds"], abs=0.01)


def test_slowed_process_is_scored_below_threshold(run_dir):
    codes, texts = run(run_dir, "s", ["steps=24", "fault_type=slow", "fault_process=1", "fault_step=0",
                                       "fault_slowdown_factor=4", "straggler_report_interval=2",
                                       "enable_checkpointing=false"], processes=2)
    assert codes == [0, 0], shown(texts)
    reports = [json.loads(x) for x in open(os.path.join(run_dir, "s", "stragglers.jsonl"))]
    # Both hosts' step times reach process 0 through the vote and are scored there; which host the
    # wall clock calls slow under this machine's load is not asserted (the scoring and the slowed
    # time counted as own work: on injected clocks in tests/test_resilience_units.py).
    assert len(reports) >= 2 and all(len(r["relative"]) == 2 == len(r["individual"]) for r in reports)
    for r in reports:  # each verdict follows its scores (min of relative and individual below 0.7)
        assert r["stragglers"] == [p for p in (0, 1) if min(r["relative"][p], r["individual"][p]) < 0.7], r
    assert "straggler_min_relative_score" in status(run_dir, "s")["summary"]  # scores reach the outputs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small .bin/.idx corpus: the indexed source, the one a long run reads."""
    import numpy as np
    from maxlite.data import indexed
    prefix = str(tmp_path_factory.mktemp("idx") / "corpus")
    rng = np.random.default_rng(0)
    with indexed.IndexedWriter(prefix, np.uint16) as w:
        for _ in range(400):
            w.add_document(np.append(rng.integers(1, 250, rng.integers(5, 80)), 0))
    return prefix


# (processes, devices, extra keys) of the first attempt and of the resumed one: 4 devices on 2
# hosts → 1 host, and 2 devices accumulating 2 micro-batches → 2 hosts; the global batch stays 4
TOPOLOGY_CHANGES = {"2x2_to_1x4": ((2, 4, []), (1, 4, [])),
                    "1x2_accum2_to_2x2": ((1, 2, ["gradient_accumulation_steps=2"]), (2, 4, []))}


@pytest.fixture(scope="module")
def corpus_reference(corpus, tmp_path_factory):
    """(step → loss, step → batch_hash) of one uninterrupted 10-step run on the corpus, two processes."""
    run_dir = str(tmp_path_factory.mktemp("corpus_reference"))
    codes, texts = run(run_dir, "ref", ["dataset_type=indexed", f"data_prefix={corpus}", "steps=10"], processes=2)
    assert codes == [0, 0], shown(texts)
    return losses(run_dir, "ref"), batch_hashes(run_dir, "ref")


@pytest.mark.parametrize("change", TOPOLOGY_CHANGES)
def test_resume_on_another_topology_reads_the_same_global_batches(run_dir, corpus, corpus_reference, change):
    """A run killed at step 7 and resumed from its step-5 checkpoint on another number of hosts and
    devices consumes exactly the uninterrupted run's global batches (every step's batch_hash equal:
    no sample skipped or repeated) and tracks its losses (within 1e-4: only the reduction order differs, 3e-5 seen with accumulation)."""
    data = ["dataset_type=indexed", f"data_prefix={corpus}", "steps=10"]
    want, hashes = corpus_reference
    (p1, d1, extra1), (p2, d2, extra2) = TOPOLOGY_CHANGES[change]
    crash = ["checkpoint_period=5", "async_checkpointing=false", "fault_type=crash", "fault_step=7", "fault_process=0",
             "watchdog_min_timeout=5", "watchdog_factor=2"]
    procs, logs = start(run_dir, "x", data + crash + extra1, processes=p1, devices=d1)
    procs[0].wait(timeout=600)
    for p in procs[1:]:  # the survivor fails on its own within seconds; do not wait for it
        p.kill()
    finish(procs, logs)
    assert _complete_checkpoint(run_dir, "x", 5)
    codes, texts = run(run_dir, "x", data + crash + extra2, processes=p2, devices=d2)
    assert codes == [0] * p2, shown(texts)
    assert resumed(run_dir, "x") == (5, "checkpoint")
    assert batch_hashes(run_dir, "x") == hashes
    assert len(set(hashes.values())) == 10  # ten different batches
    got = losses(run_dir, "x")
    assert sorted(got) == list(range(1, 11))
    assert [got[s] for s in sorted(got)] == pytest.approx([want[s] for s in sorted(want)], rel=1e-4)


def test_nan_loss_rolls_back_to_memory_skips_its_batches_and_finishes(run_dir, corpus):
    """Two processes; process 1's rows of step 7's batch make the loss NaN. Step 7's checkpoint (a
    NaN state, saved before the loss was read) is deleted, the state of step 6 comes back from the
    in-memory snapshot, and the batches of the two undone steps are skipped: the steps after read
    exactly the global batches an uninterrupted run reads two steps later (batch hashes do not
    depend on the topology, so the reference is one process), and the run ends finite."""
    data = ["dataset_type=indexed", f"data_prefix={corpus}"]
    codes, texts = run(run_dir, "ref", data + ["steps=14", "enable_checkpointing=false"], processes=1, devices=4)
    assert codes == [0], shown(texts)
    args = data + ["steps=12", "checkpoint_period=7", "inmemory_snapshot_period=2", "fault_type=nan", "fault_step=7",
                   "fault_process=1"]
    codes, texts = run(run_dir, "m", args, processes=2)
    assert codes == [0, 0], shown(texts)
    (back,) = rollbacks(run_dir, "m")
    assert (back["why"], back["to_step"], back["source"]) == ("loss is nan at step 7", 6, "memory"), back
    assert (back["skipped_batches"], back["skipped_samples"]) == ([6, 8], [24, 32]), back  # [first, end)
    import jax
    import numpy as np
    from maxlite import checkpoints as ck
    # the NaN state's checkpoint (step 7, saved before its loss was read) is gone: step 7 again holds
    # the state trained from step 6 on the next batches, finite
    _, params = ck.load_params(os.path.join(run_dir, "m", "checkpoints"), step=7)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))
    with open(os.path.join(run_dir, "m", "rollbacks.jsonl")) as f:
        (record,) = map(json.loads, f)
    assert record["to_step"] == 6 and record["source"] == "memory" and record["steps_undone"] == [7, 8]
    assert record["skipped_batches"] == [6, 8] and record["skipped_samples"] == [24, 32]
    st = status(run_dir, "m")
    assert st["state"] == "finished" and st["step"] == 12 and st["rollbacks"] == 1
    got, ref = batch_hashes(run_dir, "m"), batch_hashes(run_dir, "ref")
    assert [got[s] for s in range(1, 7)] == [ref[s] for s in range(1, 7)]
    assert [got[s] for s in range(7, 13)] == [ref[s] for s in range(9, 15)]  # batches 6 and 7 skipped
    assert all(v == v and v < 20 for v in losses(run_dir, "m").values())  # finite from step 7 on
    data = ck.restore_items(os.path.join(run_dir, "m", "checkpoints"), 12, {"data": None})["data"]
    assert data["position"]["batches_read"] == 14  # 12 steps trained, 2 batches skipped


def test_crash_recovers_from_peer_memory_like_an_uninterrupted_run(run_dir, uninterrupted):
    args = ["steps=10", "inmemory_snapshot_period=2"]
    crash = args + ["fault_type=crash", "fault_step=7", "fault_process=1",
                    "watchdog_min_timeout=5", "watchdog_factor=2"]  # the survivor stops within seconds
    codes, texts = run(run_dir, "x", crash, processes=2)
    # the survivor fails too: gloo sees the peer gone, or else its watchdog fires (exit 75)
    assert codes[1] == 1 and codes[0] != 0, texts[0][-2000:]
    shm = f"/dev/shm/maxlite-snap-{run_key(os.path.join(run_dir, 'x'))}"
    mine = glob.glob(f"{shm}/*.own-*.1.snap")
    assert mine
    for f in mine:
        os.remove(f)  # host 1 is gone with its memory: only host 0's replica of its shard is left
    codes, texts = run(run_dir, "x", crash, processes=2)
    assert codes == [0, 0], shown(texts)
    # step 6 from memory, host 1's shard from the replica host 0 held: rank 0 saw "own shard", not
    # "own shards" (status.json's resumed_from is rank 0's)
    assert status(run_dir, "x")["resumed_from"] | {"seconds": 0} == {
        "step": 6, "source": "memory", "where": "own shard", "seconds": 0}, shown(texts)
    assert losses(run_dir, "x") == uninterrupted  # bit-identical to the uninterrupted run
    assert not os.path.exists(shm) or not os.listdir(shm)  # finished: the keeper was cleared


RAY_SCRIPT = """
import os, ray
ray.init(address={address!r})
from maxlite.launch.ray_keeper import RayKeeper

@ray.remote(max_retries=0)
def worker_puts_then_dies():
    k = RayKeeper({run!r}, 0)
    k.put(5, "own", 0, b"state-bytes" * 1000)
    os._exit(1)  # the worker process dies; anything it owned in the object store dies with it

try:
    ray.get(worker_puts_then_dies.remote())
    raise SystemExit("the worker did not die")
except ray.exceptions.WorkerCrashedError:
    pass
k = RayKeeper({run!r}, 0)  # the restarted worker finds the detached actor by name
assert k.steps("own", 0) == [5], k.steps("own", 0)
assert k.get(5, "own", 0) == b"state-bytes" * 1000
k.clear()
ray.shutdown()
"""  # exit status 0: every check above held


@pytest.mark.ray
def test_ray_keeper_outlives_the_worker(ray_head, tmp_path):
    script = textwrap.dedent(RAY_SCRIPT).format(address=ray_head.gcs_address, run=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=ray_env(PYTHONPATH=ROOT),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.ray
def test_ray_two_workers_crash_recovers_from_memory_at_the_uninterrupted_loss(ray_head, run_dir, uninterrupted):
    """`python -m ray_entry.train`: Ray Train restarts the whole worker group after the injected crash;
    the detached keeper actors hand the state back. The reference is the same 2 × 2-device layout
    run as two plain processes (no Ray: faster, and the same numbers)."""
    args = ["steps=10", "inmemory_snapshot_period=2", "enable_checkpointing=false"]
    env = {k: v for k, v in ray_env(RAY_ADDRESS=ray_head.gcs_address, PYTHONPATH=ROOT).items()
           if not k.startswith("MAXLITE_")}
    got = subprocess.run([sys.executable, "-m", "ray_entry.train", *TINY, *args, f"base_output_directory={run_dir}",
                          "run_name=x", "ray_num_workers=2", "ray_simulated_devices_per_worker=2",
                          "max_restarts=2", "fault_type=crash", "fault_step=7", "fault_process=1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = got.stdout + got.stderr
    assert got.returncode == 0, out[-4000:]
    st = status(run_dir, "x")
    assert (st["state"], st["step"]) == ("finished", 10), out[-4000:]
    assert os.path.exists(os.path.join(run_dir, "x", ".fault_crash_7_p1"))  # the crash fired (once)
    assert resumed(run_dir, "x") == (6, "memory"), out[-4000:]  # the snapshot before the crash
    # held by the Ray keeper actors, not /dev/shm (auto picks the launcher's keeper)
    assert not os.path.exists(f"/dev/shm/maxlite-snap-{run_key(os.path.join(run_dir, 'x'))}")
    assert losses(run_dir, "x") == uninterrupted  # bit-identical to the uninterrupted run


