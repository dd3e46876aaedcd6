"""Ray launcher: the trainer configuration for TPU/GPU/CPU, and real clusters on this machine.

The `ray` tests start real Ray clusters and real worker processes (2 workers × 2 simulated CPU
devices, a global JAX mesh across both); they are kept lean (tiny model, 64 tokens, 8 steps).
"""

from __future__ import annotations

import glob
import json
import math
import os
import signal
import pathlib
import re
import subprocess
import sys

import pytest

from maxlite import config as C
from maxlite.launch import ray_trainer as RT
from tests.helpers import wait_until
from tests.ray_cluster import REPO, RayHead, kill_session, ray_env, stop_session
from tests.xla_flags import cpu_xla_flags

# One recipe for every real run here: two processes × two devices, checkpoints every 3 steps.
STEPS = 8
RECIPE = ["model_name=tiny", f"steps={STEPS}", "per_device_batch_size=1", "max_target_length=64",
          "checkpoint_period=3", "enable_tensorboard=false", "write_report=false", "ray_num_workers=2",
          "ray_simulated_devices_per_worker=2", "max_restarts=1"]


def load(*args: str) -> C.Config:
    return C.load(["base.yml", *args])


# ---------------------------------------------------------------- trainer configuration (no cluster)


def test_tpu_v6e_4x4_gives_four_workers_with_four_chips_each():
    cfg = RT.check(load("ray_use_tpu=true", "tpu_topology=4x4", "tpu_accelerator_type=TPU-V6E",
                        "model_name=tiny", "per_device_batch_size=1"))
    scaling = RT.scaling_config(cfg)
    assert scaling.num_workers == 4
    assert scaling.use_tpu is True and scaling.use_gpu is False
    assert scaling.topology == "4x4" and scaling.accelerator_type == "TPU-V6E"
    assert scaling.resources_per_worker == {"TPU": 4}
    assert scaling.placement_strategy == "SPREAD"
    assert cfg.axis_size("fsdp") == 16 == cfg.num_devices and cfg.num_slices == 1
    assert RT.worker_env(cfg)["JAX_PLATFORMS"] == "tpu"
    assert "XLA_FLAGS" not in RT.worker_env(cfg)  # real chips, no simulated devices
    trainer = RT.build_trainer(cfg)  # JaxTrainer accepts it (TPU jax.distributed is Ray's job)
    assert trainer.backend_config.use_tpu is True


def test_tpu_two_slices_give_eight_workers_and_a_dcn_data_axis():
    from ray.util.tpu import get_tpu_num_slices_for_workers

    cfg = RT.check(load("ray_use_tpu=true", "tpu_topology=4x4", "tpu_accelerator_type=TPU-V6E",
                        "num_slices=2", "ray_num_workers=8", "model_name=tiny",
                        "per_device_batch_size=1"))
    scaling = RT.scaling_config(cfg)
    assert scaling.num_workers == 8 and scaling.resources_per_worker == {"TPU": 4}
    # Ray's controller derives the slice count from the same numbers: it must agree with the mesh.
    assert get_tpu_num_slices_for_workers(topology="4x4", accelerator_type="TPU-V6E",
                                          num_workers=8, resources_per_worker={"TPU": 4}) == 2
    assert cfg.num_slices == 2
    assert cfg.dcn_data_parallelism == 2 == math.prod(cfg.parallelism("dcn"))
    assert cfg.ici_fsdp_parallelism == 16 == math.prod(cfg.parallelism("ici"))
    assert cfg.global_batch_size == 32


def test_gpu_workers_get_their_gpus_and_cuda():
    cfg = RT.check(load("ray_use_gpu=true", "ray_num_workers=2", "ray_gpus_per_worker=8",
                        "model_name=tiny", "per_device_batch_size=1"))
    scaling = RT.scaling_config(cfg)
    assert scaling.num_workers == 2 and scaling.use_gpu is True
    assert scaling.resources_per_worker == {"GPU": 8}
    assert cfg.num_devices == 16
    assert RT.worker_env(cfg)["JAX_PLATFORMS"] == "cuda"


def test_cpu_run_config_env_storage_and_failures(tmp_path, monkeypatch):
    cfg = RT.check(load(*RECIPE, "ray_simulated_devices_per_worker=4", "max_restarts=5",
                        f"base_output_directory={tmp_path}", "run_name=r"))
    scaling = RT.scaling_config(cfg)
    assert scaling.num_workers == 2 and not scaling.use_tpu and not scaling.use_gpu
    assert scaling.resources_per_worker == {"CPU": 1}
    run = RT.run_config(cfg)
    assert run.worker_runtime_env["env_vars"]["JAX_PLATFORMS"] == "cpu"
    # The driver's own XLA flags reach the workers (the runtime env replaces the variable), with
    # the worker's simulated device count in place of the driver's.
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/d")
    assert (RT.run_config(cfg).worker_runtime_env["env_vars"]["XLA_FLAGS"]
            == "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=4")
    assert run.storage_path == f"{tmp_path}/r"  # Ray's records live in the run dir, not ~/ray_results
    assert run.failure_config.max_failures == 0  # Ray never restarts by itself: maxlite.policy decides, per run
    assert cfg.num_devices == 8


def test_elastic_group_asks_ray_for_a_range_and_keeps_the_global_batch():
    """4 workers, 2 at least: Ray gets the range; groups of 3 and 2 accumulate 4 and 6 micro-batches
    where 4 workers accumulate 3, so the global batch stays 24 (3 would not divide 4 × 1)."""
    recipe = load(*RECIPE, "ray_num_workers=4", "ray_min_workers=2", "gradient_accumulation_steps=3",
                  "ici_fsdp_parallelism=1", "ici_data_parallelism=-1")  # any device count
    cfg = RT.check(recipe)
    scaling = RT.scaling_config(cfg)
    assert scaling.num_workers == (2, 4) and scaling.min_workers == 2 and scaling.max_workers == 4
    assert scaling.elastic_resize_monitor_interval_s >= 10**9  # a running group is never resized
    for workers, accumulation in ((3, 4), (2, 6)):
        small = RT.group_config(recipe, workers)
        assert (small.ray_num_workers, small.gradient_accumulation_steps) == (workers, accumulation)
        assert C.resolve(small, workers * 2).global_batch_size == cfg.global_batch_size == 24
    assert RT.scaling_config(RT.check(load(*RECIPE))).num_workers == 2  # ray_min_workers=0: fixed size


@pytest.mark.parametrize("args, message", [
    (("ray_num_workers=4", "ray_min_workers=3"), "a group of 3 of 4 workers cannot keep the global batch"),
    (("ray_num_workers=2", "ray_min_workers=3"), "ray_min_workers=3 is more than the 2 workers"),
    (("ray_use_tpu=true", "tpu_accelerator_type=TPU-V6E"), "needs tpu_topology"),
    (("ray_use_tpu=true", "tpu_topology=4by4", "tpu_accelerator_type=TPU-V6E"), "write it as AxB"),
    (("ray_use_tpu=true", "tpu_topology=2x3", "tpu_accelerator_type=TPU-V6E"), "not a multiple"),
    (("ray_use_tpu=true", "ray_use_gpu=true", "tpu_topology=4x4", "tpu_accelerator_type=TPU-V6E"),
     "only one of"),
    (("ray_num_workers=0",), "at least 1"),
    (("ray_use_tpu=true", "tpu_topology=4x4", "tpu_accelerator_type=TPU-V6E", "ray_num_workers=2"),
     "have 4 hosts; set it to 4 or -1"),
    (("ray_num_workers=3",), "base_emb_dim=256 is not divisible by fsdp × context parallelism 6 × 1"),  # 3 workers × 2 devices
])
def test_recipe_mistakes_are_one_line_errors_before_any_cluster(args, message):
    with pytest.raises(C.ConfigError, match=message):
        RT.check(load("model_name=tiny", *args))


def test_the_driver_checks_the_host_memory_fit_without_starting_jax():
    # A local CPU cluster's workers share this host: a state that cannot fit is one line before any
    # cluster starts. The driver must check it without a JAX backend: Ray then forks its processes from
    # the driver, and a process whose backend threads run is one JAX warns "will likely lead to a deadlock".
    probe = ("import sys\n"
             "from jax._src import xla_bridge\n"
             "from maxlite import config as C\n"
             "from maxlite.launch import ray_trainer as RT\n"
             "for argv in (['demo.yml'], ['base.yml', 'model_name=llama3-8b', 'ray_num_workers=2']):\n"
             "    try:\n"
             "        RT.preflight(RT.check(C.load(argv)), local_cluster=True)\n"
             "        print('fits', argv[-1])\n"
             "    except C.ConfigError as e:\n"
             "        print('refused', argv[-1], str(e))\n"
             "print('backend started', bool(xla_bridge._backends))\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=ray_env(JAX_PLATFORMS="cpu"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "fits demo.yml"
    assert lines[1].startswith("refused ray_num_workers=2 model_name=llama3-8b (8.03B params) needs ~")
    assert "per host, but this host has" in lines[1]
    assert lines[2] == "backend started False"


def test_entry_point_exits_2_on_a_bad_key(capsys):
    from ray_entry.train import main

    assert main(["base.yml", "ray_num_wrokers=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("maxlite: error: unknown config key 'ray_num_wrokers'")
    assert "did you mean 'ray_num_workers'" in err


def test_workers_report_to_ray_at_checkpoint_steps_and_the_last():
    """Each report waits for Ray's controller (one report per 2 s poll): a report every step held a
    0.2 s step to 2 s (benchmarks/bench_ray_steps.py)."""
    reported = [step for step in range(1, STEPS + 1) if RT.reports_to_ray(load(*RECIPE), step)]
    assert reported == [3, 6, 8]  # checkpoint_period=3, steps=8
    no_saves = load(*RECIPE, "checkpoint_period=0")
    assert [step for step in range(1, STEPS + 1) if RT.reports_to_ray(no_saves, step)] == [8]


# ---------------------------------------------------------------- real clusters


def _metrics(run_dir: pathlib.Path) -> dict[int, float]:
    """step → loss from metrics.jsonl (a resumed run appends; the last record of a step wins)."""
    losses = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record and "step" in record:
            losses[record["step"]] = record["loss"]
    return losses


@pytest.fixture(scope="module")
def head(ray_head):
    """The session's Ray head (tests/conftest.py): these tests crash, hang and stop workers, never it."""
    return ray_head


@pytest.fixture(scope="module")
def uninterrupted(head, tmp_path_factory):
    """One uninterrupted `ray job submit` run of RECIPE: (completed process, run dir). Worker 1 stalls
    for PAUSE seconds once (losses do not change): where rank 0's goodput puts the wait is checked."""
    base = tmp_path_factory.mktemp("ray_runs")
    done = head.submit(["base.yml", *RECIPE, f"base_output_directory={base}", "run_name=whole", *PAUSE_ARGS])
    return done, base / "whole"


PAUSE = 12.0
PAUSE_ARGS = ["fault_type=pause", "fault_step=4", "fault_process=1", f"fault_pause_seconds={PAUSE}"]


@pytest.mark.ray
def test_job_submit_trains_on_two_workers(uninterrupted):
    done, run_dir = uninterrupted
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]  # `ray job submit` exits 0 when the job succeeded
    # text is the contract for the next three: what the job's console shows (the run's layout, one
    # line per step from rank 0 only, the driver's last line)
    assert re.search(r"2 process\(es\), mesh \{'data': 1, 'stage': 1, 'fsdp': 4, .*'tensor': 1\} on 4 cpu device\(s\)", out)
    steps = [int(s) for s in re.findall(r"completed step: (\d+),", out)]
    assert steps == list(range(1, STEPS + 1)), out[-6000:]  # printed once each, by rank 0 only
    assert re.search(r"maxlite: Ray run finished: 8 steps, final loss \d", out)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == STEPS and status["summary"]["steps"] == STEPS
    # rank 0 waited out worker 1's 12 s stall inside a step: step time (productive), not `other`
    # (the accounting itself, on an injected clock: test_resilience_units.py)
    assert (run_dir / ".fault_pause_4_p1").exists()  # the stall happened
    assert status["summary"]["productive_seconds"] >= PAUSE
    assert (run_dir / RT.RAY_RUN_NAME).is_dir()  # Ray's storage_path is inside the run dir
    assert sorted(_metrics(run_dir)) == list(range(1, STEPS + 1))


@pytest.mark.ray
def test_killed_worker_restarts_and_ends_at_the_same_loss(head, uninterrupted, tmp_path):
    _, whole_dir = uninterrupted
    done = head.submit(["base.yml", *RECIPE, f"base_output_directory={tmp_path}", "run_name=killed",
                        "fault_type=crash", "fault_step=5", "fault_process=0",
                        "async_checkpointing=false"])  # step 3 is on disk before the crash
    # rank 0, the lease holder, dies without cleanup: the restarted group must take its lease over
    # (a rank 0 that ends on a peer's crash releases it, and the next group simply takes it)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "fault injection: crash at step 5" in out
    assert "maxlite: Ray run finished: 8 steps (the last attempt ran 5), final loss" in out
    assert (tmp_path / "killed" / ".fault_crash_5_p0").exists()  # fired once: the restart ran through
    assert _resumed(tmp_path / "killed") == {"step": 3, "source": "checkpoint"}  # the save before the crash
    status = json.loads((tmp_path / "killed" / "status.json").read_text())
    assert status["restarts"] == 1 and status["next"] == "done"  # the one restart, counted in the run directory
    lease = status["lease"]  # handed on to the new group
    assert lease["took_over"]["why"] == "a later attempt of the same job" and lease["launcher"].startswith("Ray job")
    whole, killed = _metrics(whole_dir), _metrics(tmp_path / "killed")
    assert sorted(killed) == list(range(1, STEPS + 1))
    # Same processes, same layout, restored state and data position: the very same numbers.
    assert killed[STEPS] == pytest.approx(whole[STEPS], rel=1e-6)
    for step in range(4, STEPS + 1):
        assert killed[step] == pytest.approx(whole[step], rel=1e-6), step


@pytest.mark.ray
def test_a_worker_that_dies_with_no_restarts_left_ends_with_one_answer(head, tmp_path):
    """A worker dies without a word (a crash: Ray's text lists the OOM killer among the possible
    causes) and max_restarts=0: the driver ends without a traceback, exit 1, and status.json — which
    the dead worker left at `running` — says the same (the driver writes it, maxlite.policy decides)."""
    driver = subprocess.run(
        [sys.executable, "-m", "ray_entry.train", "base.yml", *RECIPE, "ray_num_workers=1", "max_restarts=0",
         "fault_type=crash", "fault_step=2", f"base_output_directory={tmp_path}", "run_name=dead"],
        env=ray_env(RAY_ADDRESS=head.gcs_address), cwd=REPO, capture_output=True, text=True, timeout=480)
    out = driver.stdout + driver.stderr
    status = json.loads((tmp_path / "dead" / "status.json").read_text())
    assert driver.returncode == status["exit_code"] == 1, out[-4000:]
    assert (status["state"], status["next"], status["reason"], status["restarts"]) == ("failed", "fail", "crash", 0)
    assert "Traceback" not in out, out[-4000:]


@pytest.mark.ray
def test_hung_worker_is_detected_restarted_and_ends_at_the_same_loss(head, uninterrupted, tmp_path):
    """Rank 1 hangs after step 4: a watchdog dumps the stacks and exits 75, Ray restarts the group,
    which resumes from step 3 and ends at the uninterrupted losses. Which watchdog fires first is a
    race: rank 1's (stuck in the fault) or rank 0's (stuck reading step 5's result, the collective
    rank 1 never joins), each with its own timeout from the step times it saw; the first one ends
    the group. (After step 5, rank 0 could also wait in step 6's save, in section `checkpoint` with
    a timeout of its own: the likely cause of the one failure seen, on a loaded machine, whose
    log was not kept.)"""
    _, whole_dir = uninterrupted
    done = head.submit(["base.yml", *RECIPE, f"base_output_directory={tmp_path}", "run_name=hung",
                        "fault_type=hang", "fault_step=4", "fault_process=1", "async_checkpointing=false",
                        "watchdog_min_timeout=5", "watchdog_factor=3"])
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "fault injection: hang at step 4" in out
    assert "maxlite: hang detected in section 'step'" in out and "exiting with code 75" in out
    dumps = [pathlib.Path(f).read_text() for f in glob.glob(str(tmp_path / "hung" / "hang_p*.log"))]
    assert dumps and all("hang detected in section 'step'" in d and "--- thread" in d for d in dumps)  # the stacks
    assert _resumed(tmp_path / "hung") == {"step": 3, "source": "checkpoint"}
    whole, hung = _metrics(whole_dir), _metrics(tmp_path / "hung")
    assert sorted(hung) == list(range(1, STEPS + 1))
    for step in range(4, STEPS + 1):
        assert hung[step] == pytest.approx(whole[step], rel=1e-6), step


@pytest.mark.ray
def test_sigterm_to_a_worker_saves_on_every_host_restarts_and_ends_at_the_same_loss(head, uninterrupted, tmp_path):
    """A real SIGTERM to rank 1 after step 4 (what a node shutdown sends): Ray runs the loop off the
    main thread, so JAX's preemption service catches it and both hosts stop at one step; that step
    is saved, Ray restarts the group, which resumes there and ends at the uninterrupted losses."""
    _, whole_dir = uninterrupted
    done = head.submit(["base.yml", *RECIPE, f"base_output_directory={tmp_path}", "run_name=termed",
                        "fault_type=sigterm", "fault_step=4", "fault_process=1", "checkpoint_period=0"])
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "fault injection: SIGTERM to this process at step 4" in out
    stop = int(re.search(r"got SIGTERM \(JAX's preemption service\): every host stops at step (\d+)", out).group(1))
    assert 4 <= stop < STEPS
    assert f"preempted: saving step {stop} and waiting for it" in out
    assert _resumed(tmp_path / "termed") == {"step": stop, "source": "checkpoint"}  # nothing recomputed
    whole, termed = _metrics(whole_dir), _metrics(tmp_path / "termed")
    assert sorted(termed) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert termed[step] == pytest.approx(whole[step], rel=1e-6), step


@pytest.mark.ray
def test_two_workers_match_one_process_with_the_same_global_batch(uninterrupted, tmp_path):
    """Each worker reads its own half of the global batch; together they equal one process's: the
    same global batches (hashes), the same losses up to the order the gradient's f32 partial sums
    are reduced in (gloo across processes, in-process here), which bf16 compute lets show at 1e-5."""
    _, whole_dir = uninterrupted
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(4)}
    done = subprocess.run(
        [sys.executable, "-m", "maxlite.train", "base.yml", *RECIPE, "enable_checkpointing=false",
         f"base_output_directory={tmp_path}", "run_name=single"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    single, whole = _metrics(tmp_path / "single"), _metrics(whole_dir)
    assert sorted(single) == sorted(whole)
    assert _batch_hashes(tmp_path / "single") == _batch_hashes(whole_dir)
    for step in single:
        assert whole[step] == pytest.approx(single[step], rel=1e-4), step


def _cmdline(proc: pathlib.Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def _attempts(path: pathlib.Path) -> list[dict[int, float]]:
    """metrics.jsonl split into attempts (a resumed attempt starts again below the last step)."""
    attempts: list[dict[int, float]] = []
    last = None
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        if "loss" not in record or "step" not in record:
            continue
        if last is None or record["step"] <= last:
            attempts.append({})
        attempts[-1][record["step"]] = record["loss"]
        last = record["step"]
    return attempts


@pytest.mark.ray
def test_drained_node_saves_at_once_and_the_restarted_group_repeats_the_same_losses(tmp_path):
    """A node drained for preemption (what KubeRay / the autoscaler do on a spot reclaim): every
    worker saves at the same step and trains on; at the drain deadline Ray restarts the group on
    another node, which resumes from that save and recomputes the same losses, bit for bit."""
    with RayHead(num_cpus=0) as head:  # the workers can only go where we put CPUs
        node_a = head.add_node("a", num_cpus=2)
        driver = subprocess.Popen(
            [sys.executable, "-m", "ray_entry.train", "base.yml", *RECIPE, "steps=100000",
             "checkpoint_period=0", "save_checkpoint_on_completion=false", f"base_output_directory={tmp_path}",
             "run_name=drained"],
            env=ray_env(RAY_ADDRESS=head.gcs_address), cwd=REPO, stdout=open(tmp_path / "driver.log", "w"),
            stderr=subprocess.STDOUT, start_new_session=True)
        log, metrics = tmp_path / "driver.log", tmp_path / "drained" / "metrics.jsonl"

        def alive():
            assert driver.poll() is None, log.read_text()[-4000:]

        def wait_for(what, timeout_s=300):
            return wait_until(what, timeout_s, alive=alive, context=lambda: log.read_text()[-4000:])

        try:
            wait_for(lambda: len(_attempts(metrics)) == 1 and max(_attempts(metrics)[0]) >= 3)
            head.add_node("b", num_cpus=2)  # where the restarted group can go
            head.drain_for_preemption(node_a, deadline_s=3600)  # the deadline is ours: below
            saved = int(wait_for(lambda: re.search(r"preemption notice: saving step (\d+)", log.read_text())).group(1))
            wait_for(lambda: max(_attempts(metrics)[0]) >= saved + 2)  # it trained on after its save
            kill_session(head.nodes["a"].pid)  # the drain deadline: the node is gone
            wait_for(lambda: (_resumed(tmp_path / "drained") or {}).get("step") == saved)
            # the new group trains over what the drained one did after its save (4 steps of it at most)
            wait_for(lambda: len(_attempts(metrics)) == 2 and
                     max(_attempts(metrics)[1]) >= min(max(_attempts(metrics)[0]), saved + 4))
        finally:
            stop_session(driver.pid)
    out = log.read_text()
    assert "is being drained for preemption" in out, out[-4000:]
    first, second = _attempts(metrics)
    assert min(second) == saved + 1  # nothing lost: it went on from the save
    redone = sorted(set(first) & set(second))
    assert len(redone) >= 2, (first, second)  # the drained group trained on after its save
    assert [second[s] for s in redone] == [first[s] for s in redone]  # same state, same data: same numbers


def _resumed(run_dir: pathlib.Path) -> dict | None:
    """Where the run's latest attempt started (status.json `resumed_from`): step and source."""
    try:
        record = json.loads((run_dir / "status.json").read_text()).get("resumed_from") or {}
    except (OSError, ValueError):
        return None
    return {"step": record.get("step"), "source": record.get("source")}


def _batch_hashes(run_dir: pathlib.Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "batch_hash" in record:
            out[record["step"]] = record["batch_hash"]
    return out


@pytest.mark.ray
def test_lost_host_continues_on_the_one_left_with_the_same_global_batch(uninterrupted, tmp_path):
    """Two workers on two nodes; one node dies for good while the group waits on a stalled step.
    No node comes back within elastic_wait_seconds: Ray starts the group on the one node left, which
    accumulates 2 micro-batches (the same global batch), resumes from the step-3 checkpoint the two
    saved, reads the same global batches and ends at the uninterrupted run's losses."""
    _, whole_dir = uninterrupted
    with RayHead(num_cpus=0) as head:  # the workers can only go where we put CPUs
        head.add_node("a", num_cpus=1)
        head.add_node("b", num_cpus=1)
        log = tmp_path / "driver.log"
        driver = subprocess.Popen(
            [sys.executable, "-m", "ray_entry.train", "base.yml", *RECIPE, "ray_min_workers=1",
             "elastic_wait_seconds=10", "max_restarts=2", "fault_type=pause", "fault_step=5", "fault_process=0",
             "fault_pause_seconds=15", f"base_output_directory={tmp_path}", "run_name=el"],
            env=ray_env(RAY_ADDRESS=head.gcs_address), cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,
            start_new_session=True)
        def alive():
            assert driver.poll() is None, log.read_text()[-4000:]

        try:
            wait_until(lambda: (tmp_path / "el" / ".fault_pause_5_p0").exists(), 300, alive=alive,
                       context=lambda: log.read_text()[-4000:])
            kill_session(head.nodes["b"].pid)  # the node is gone, with its worker
            driver.wait(timeout=400)
        finally:
            stop_session(driver.pid)
    out = log.read_text()
    assert driver.returncode == 0, out[-4000:]
    assert _resumed(tmp_path / "el") == {"step": 3, "source": "checkpoint"}
    status = json.loads((tmp_path / "el" / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == STEPS
    assert status["elastic"] == {"workers": 1, "of": 2, "gradient_accumulation_steps": 2}
    assert _batch_hashes(tmp_path / "el") == _batch_hashes(whole_dir)
    got, want = _metrics(tmp_path / "el"), _metrics(whole_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s] for s in sorted(got)] == pytest.approx([want[s] for s in sorted(want)], rel=1e-4)


@pytest.mark.ray
def test_ctrl_c_on_the_driver_saves_on_every_worker_exits_130_and_the_rerun_resumes(tmp_path):
    """A terminal's Ctrl-C (SIGINT to the driver's whole process group, its local Ray cluster
    included): the workers save at a step they agree on, status.json says `stopped`, the driver
    exits 130 with one line; the same command again resumes from that step, on a private cluster
    it starts and stops (no process of it left)."""
    argv = [sys.executable, "-m", "ray_entry.train", "base.yml", *RECIPE, "checkpoint_period=0",
            f"base_output_directory={tmp_path}", "run_name=int"]
    log = tmp_path / "driver.log"
    driver = subprocess.Popen([*argv, "steps=100000"], env=ray_env(), cwd=REPO, stdout=open(log, "w"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: len(_metrics(tmp_path / "int")) >= 3 if (tmp_path / "int" / "metrics.jsonl").exists()
                   else False, 400, alive=lambda: driver.poll() is None, context=lambda: log.read_text()[-4000:])
        os.killpg(driver.pid, signal.SIGINT)
        assert driver.wait(timeout=300) == 130, log.read_text()[-4000:]
    finally:
        stop_session(driver.pid)
    out = log.read_text()
    status = json.loads((tmp_path / "int" / "status.json").read_text())
    assert (status["state"], status["reason"], status["next"]) == ("stopped", "interrupted", "done")
    stop = status["step"]
    assert out.count(f"maxlite: stopped by the user at step {stop} (saved)") == 1, out[-4000:]
    assert (tmp_path / "int" / "checkpoints" / str(stop)).is_dir()
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]  # Ray's own processes too
    # The same command again (no RAY_ADDRESS: it starts a private cluster, trains, stops it).
    env = ray_env()
    env.pop("RAY_AUTH_MODE")  # the launcher must set it itself
    again = subprocess.run([*argv, f"steps={stop + 1}"], env=env, cwd=REPO, capture_output=True,
                           text=True, timeout=480)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-4000:]
    assert _resumed(tmp_path / "int") == {"step": stop, "source": "checkpoint"}
    assert re.findall(r"completed step: (\d+),", out) == [str(stop + 1)]
    assert f"Ray run finished: {stop + 1} steps (the last attempt ran 1), final loss" in out, out[-4000:]
    temp_dir = re.search(r"local Ray cluster \(\d+ CPUs, temp dir (\S+)\)", out).group(1)
    assert not os.path.exists(temp_dir)
    leftovers = [p for p in pathlib.Path("/proc").iterdir() if p.name.isdigit()
                 and temp_dir.encode() in _cmdline(p)]
    assert leftovers == []  # every process of that private cluster is gone
