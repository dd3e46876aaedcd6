"""Rollout workers as Ray actors (maxlite/rollout/actors.py) on a real local Ray cluster: a pool of two
generates what the in-process engine generates for the same weights, key and top-k/top-p cut; a worker
killed inside generate, and one that hangs there, is replaced and the step's completions are unchanged;
a share falls due rollout_worker_timeout_s after its submission (an injected clock); GRPO trains with
a worker one step off-policy; bad values are refused in one line."""

import concurrent.futures
import json
import os
import signal
import tempfile
import time

import jax
import numpy as np
import pytest
from flax import nnx

from maxlite import api, config as C
from maxlite.rollout import actors
from maxlite.rollout.engine import Sampling, make_engine
from maxlite.train import train
from tests.rollout_workers import HangsOnce, HoldsInGenerate
from tests.helpers import GRPO_SEPARATE as SEPARATE, SMALL

pytestmark = pytest.mark.ray

GRPO = [a for a in SEPARATE if "devices_fraction" not in a]  # colocated: the actors are the sampler
PROMPTS = [[5, 17, 100, 3, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48], [150, 1, 2], [7, 8]]
SAMPLING = Sampling(6, temperature=1.0, generations=2, top_k=20, top_p=0.9)  # the cut travels to the actors


@pytest.fixture(scope="module")
def local_ray():
    """A private local cluster (GOTCHAS: no auth token, its own temp dir), stopped after the module."""
    import ray

    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED")}
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    temp = tempfile.mkdtemp(prefix="ray_mla_", dir="/tmp")  # short: holds unix sockets
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
    yield ray
    ray.shutdown()
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def model():
    cfg = C.load([*GRPO, "rollout_workers=2", "init_scale=0.5"])
    graphdef, params = nnx.split(api.create_model(cfg, seed=3), nnx.Param)
    expected = make_engine(cfg, graphdef).generate(params, PROMPTS, SAMPLING, jax.random.key(7))
    return cfg, params, expected


def _equal(done, expected):
    assert [t.tolist() for t in done.tokens] == [t.tolist() for t in expected.tokens]
    for a, b in zip(done.logps, expected.logps):
        # float32 rounding: a worker prefills its share (2 prompts) where the in-process engine prefills
        # the 4 at once, and XLA:CPU's dots may sum another batch shape in another order
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert done.stops == expected.stops


def test_two_workers_generate_what_the_in_process_engine_does(local_ray, model):
    cfg, params, expected = model
    pool = actors.WorkerPool(cfg)
    try:
        _equal(pool.generate(params, PROMPTS, SAMPLING, jax.random.key(7)), expected)
        first = pool.pushed
        pool.generate(params, PROMPTS, SAMPLING, jax.random.key(7))
        assert pool.pushed is first  # the same weights: no second push
        assert pool.restarts == 0
    finally:
        pool.close()


def test_a_worker_killed_inside_generate_is_replaced_and_the_completions_are_unchanged(local_ray, model, tmp_path):
    """Both workers pause inside generate (the test hook) until the file `go`; worker 0's process is
    SIGKILLed while it is there; the pool starts another, pushes it the weights and runs that share again."""
    cfg, params, expected = model
    pool = actors.WorkerPool(cfg, worker=HoldsInGenerate, worker_args=(str(tmp_path),))
    try:
        pool.push(params)
        pids = [local_ray.get(a.pid.remote()) for a in pool.actors]
        with concurrent.futures.ThreadPoolExecutor(1) as runner:
            running = runner.submit(pool.generate, params, PROMPTS, SAMPLING, jax.random.key(7))
            started = tmp_path / f"{pids[0]}.started"
            deadline = time.monotonic() + 300  # a bound on the wait, not a timing assertion
            while not started.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert started.exists(), "worker 0 never entered generate"
            os.kill(pids[0], signal.SIGKILL)
            (tmp_path / "go").touch()
            done = running.result()
        _equal(done, expected)
        assert (pool.restarts, pool.hangs) == (1, 0)  # it died: not a hang
        assert local_ray.get(pool.actors[0].pid.remote()) not in pids
    finally:
        pool.close()


def test_a_hung_worker_is_killed_and_replaced_and_the_completions_are_unchanged(local_ray, model, tmp_path):
    """One worker's first generate never answers (HangsOnce); rollout_worker_timeout_s after its share
    was submitted the pool kills it, starts another, pushes it the weights and runs that share again."""
    _, params, expected = model
    cfg = C.load([*GRPO, "rollout_workers=2", "init_scale=0.5", "rollout_worker_timeout_s=30"])
    pool = actors.WorkerPool(cfg, worker=HangsOnce, worker_args=(str(tmp_path),))
    try:
        pool.push(params)
        pids = [local_ray.get(a.pid.remote()) for a in pool.actors]  # started: the 30 s hold load, compile, sample
        done = pool.generate(params, PROMPTS, SAMPLING, jax.random.key(7))
        _equal(done, expected)
        hung = int((tmp_path / "hung").read_text())
        assert hung in pids
        assert (pool.restarts, pool.hangs, done.stats["hangs"]) == (1, 1, 1)
        assert hung not in [local_ray.get(a.pid.remote()) for a in pool.actors]
        deadline = time.monotonic() + 60  # a bound on the wait, not a timing assertion
        while _alive(hung) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(hung), "the hung worker was replaced but not killed"
    finally:
        pool.close()


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_share_falls_due_timeout_seconds_after_its_submission():
    now = [100.0]
    due = actors.Deadlines(30, clock=lambda: now[0])
    due.start(0)
    now[0] = 110
    due.start(1)
    assert due.overdue() == [] and due.wait_s() == 20
    now[0] = 130
    assert due.overdue() == [0] and due.wait_s() == 0
    due.done(0)
    due.start(0)  # its share submitted again
    assert due.overdue() == [] and due.wait_s() == 10
    now[0] = 140
    assert due.overdue() == [1]
    due.done(1)
    assert due.overdue() == [] and due.wait_s() == 20
    forever = actors.Deadlines(0, clock=lambda: now[0])
    forever.start(0)
    now[0] = 1e9
    assert forever.overdue() == [] and forever.wait_s() is None


def test_grpo_trains_with_a_worker_one_step_off_policy(local_ray, tmp_path):
    train(C.load([*GRPO, "rollout_workers=1", "off_policy_steps=1", "steps=3", "checkpoint_period=0",
                  f"base_output_directory={tmp_path}", "run_name=actors"]))
    rows = [r for r in map(json.loads, open(f"{tmp_path}/actors/metrics.jsonl")) if "reward" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["rollout_staleness"] for r in rows] == [0, 1, 1]
    assert all(r["rollout_worker_restarts"] == r["rollout_worker_hangs"] == 0 and np.isfinite(r["loss"]) for r in rows)


def test_tool_rollouts_on_a_worker_equal_the_in_process_ones_and_run_one_step_off_policy(local_ray, tmp_path):
    """Multi-turn rollouts with tools (maxlite/rollout/tools.py) through a rollout worker: each round is
    one generate call on the actor, the tool runs in the trainer. Step 7 (the first GRPO step, after a
    6-step warm-up that teaches the tool-call end) samples the same tool rounds as the in-process
    engine and trains to the same loss; step 8, generated while step 7 trained, calls the tools too."""
    argv = [*SMALL, "vocab_size=4096", "dtype=float32", "max_target_length=96", "train_objective=grpo",
            "dataset_type=prompts", "reward_functions=[maxlite.objectives.rewards:exact_answer]",
            "grpo_max_new_tokens=40", "grpo_num_generations=4", "per_device_batch_size=2", "alignment_sft_steps=6",
            "learning_rate=1e-2", "rollout_tools=[tests.tool_fns:assistant, tests.tool_fns:raises]",
            "tool_call_start=<|im_start|>", "tool_call_end=<", "max_tool_turns=2", "tool_workers=1",
            "reward_workers=1", "lr_schedule_type=constant", "warmup_steps_fraction=0", "checkpoint_period=0",
            "log_period=1", "eval_interval=0", f"base_output_directory={tmp_path}"]
    train(C.load([*argv, "steps=7", "run_name=here"]))
    train(C.load([*argv, "steps=8", "run_name=actor", "rollout_workers=1", "off_policy_steps=1"]))
    here, actor = ([r for r in map(json.loads, open(f"{tmp_path}/{name}/metrics.jsonl")) if "reward" in r]
                   for name in ("here", "actor"))
    figures = ("reward", "tool_calls", "tool_failures", "tool_timeouts", "turns", "completion_length", "loss")
    assert [r["step"] for r in actor] == [7, 8] and [r["rollout_staleness"] for r in actor] == [0, 1]
    assert {k: actor[0][k] for k in figures} == {k: here[0][k] for k in figures}
    assert here[0]["tool_calls"] > 0 and here[0]["turns"] > 1
    assert actor[1]["tool_calls"] > 0 and actor[1]["rollout_worker_restarts"] == 0


def test_bad_values_are_refused_in_one_line():
    with pytest.raises(C.ConfigError, match="rollout_workers"):
        C.load([*GRPO, "rollout_workers=-1"])
    with pytest.raises(C.ConfigError, match=r"^rollout_worker_timeout_s=-1.0 must be >= 0"):
        C.load([*GRPO, "rollout_workers=1", "rollout_worker_timeout_s=-1"])
    with pytest.raises(C.ConfigError, match="rollout_workers=1 generates in Ray actors of its own"):
        C.load([*SEPARATE, "rollout_workers=1"])
    with pytest.raises(C.ConfigError, match="rollout_workers places GRPO's rollouts"):
        C.load(["base.yml", "rollout_workers=1"])
