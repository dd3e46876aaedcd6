"""Resilience pieces in one process: parsing, scores, blobs, keeper, snapshots round trip, watchdog exit."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from maxlite import config as C
from maxlite import outcome
from maxlite.resilience import goodput, keeper, preemption, snapshot, straggler


def test_signal_and_max_time_set_the_reason():
    p = preemption.Preemption([signal.SIGUSR2], 10.0, 5)
    try:
        assert p.reason() is None
        assert p.reason(reserve_seconds=11) == "max_time"  # not enough time left to save
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.05)
        assert p.reason() == "preempted" and 0 < p.grace_left() <= 5
    finally:
        p.restore_handlers()


def test_signal_before_the_loop_is_handed_to_it_and_one_after_is_only_noted():
    original = signal.getsignal(signal.SIGUSR2)
    try:
        preemption.catch_outside_the_loop([signal.SIGUSR2])  # what `python -m maxlite.train` does first
        os.kill(os.getpid(), signal.SIGUSR2)  # during start-up, before the loop's handlers exist
        time.sleep(0.05)
        p = preemption.Preemption([signal.SIGUSR2], None, 5)
        assert p.reason() == "preempted"  # the run stops at its first safe point
        p.restore_handlers()  # the run ended
        assert preemption.noted_signal() is None
        os.kill(os.getpid(), signal.SIGUSR2)  # after it: noted, the process lives on
        time.sleep(0.05)
        assert preemption.noted_signal() == "SIGUSR2"
    finally:
        signal.signal(signal.SIGUSR2, original)
        preemption._noted.clear()


def test_ctrl_c_stops_like_a_preemption_and_a_second_one_at_once():
    original = signal.getsignal(signal.SIGINT)
    p = preemption.Preemption([signal.SIGTERM], None, 5)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert p.reason() == "preempted" and p.grace_left() is not None
        os.kill(os.getpid(), signal.SIGINT)  # the user's stop outranks the preemption
        time.sleep(0.05)
        assert p.reason() == "interrupted" and p.grace_left() is None  # no deadline: the user decides
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
    finally:
        p.restore_handlers()
    assert signal.getsignal(signal.SIGINT) is original


def test_straggler_scores_and_report():
    current = np.array([0.10, 0.10, 0.30, 0.11])
    best = np.array([0.10, 0.05, 0.0, 0.11])
    s = straggler.scores(current, best)
    np.testing.assert_allclose(s["relative"], [1.0, 1.0, 1 / 3, 0.10 / 0.11])
    np.testing.assert_allclose(s["individual"], [1.0, 0.5, 1.0, 1.0])
    rep = straggler.report(current, best, 0.7)
    assert rep["stragglers"] == [1, 2]  # p1 by its own history, p2 against the others
    assert rep["worst"][0]["process"] == 2 and rep["best"][0]["process"] in (0, 1)
    assert "STRAGGLERS: [1, 2]" in straggler.format_report(10, rep)


def test_step_timer_excludes_device_wait():
    now = [100.0]
    t = straggler.StepTimer(clock=lambda: now[0])
    t.begin()
    now[0] += 0.25  # own work
    t.wait_begin()
    now[0] += 2.0  # waiting on devices / peers
    t.wait_end()
    now[0] += 0.5  # own work again
    assert t.end() == pytest.approx(0.75) and t.window == [pytest.approx(0.75)]
    t.begin()
    now[0] += 9.0
    assert t.end(skip=True) == pytest.approx(9.0) and len(t.window) == 1  # compiling: not counted


def test_goodput_counts_causes_and_restarts(tmp_path):
    path = str(tmp_path / "goodput.json")
    g = goodput.Goodput(path, time.monotonic())
    g.step(1, 2.0, 0.5, compiling=True)
    g.step(2, 1.0, 0.1, compiling=False)
    g.add("checkpoint", 0.3)
    g.save()
    s = g.summary()
    assert s["badput_compilation_seconds"] == 1.5 and s["productive_seconds"] == 0.9
    assert s["badput_data_wait_seconds"] == pytest.approx(0.6) and s["badput_checkpoint_seconds"] == 0.3
    g2 = goodput.Goodput(path, time.monotonic())  # the restarted attempt
    g2.step(2, 1.0, 0.0, compiling=False)  # step 2 again: recomputed
    g2.step(3, 1.0, 0.0, compiling=False)
    s2 = g2.summary()
    assert s2["attempt"] == 2 and s2["badput_recomputed_seconds"] == 1.0 and s2["productive_seconds"] == 1.9


def test_every_second_of_the_loop_belongs_to_one_cause(tmp_path):
    """The loop's calls in their order, with a clock advanced by hand: startup, a compiling step,
    steps whose dispatch, vote and one-step-late read wait for other hosts (their time, not
    `other`), eval and snapshot sections, a step a rollback abandons, the last read, a sample and
    the peak probe. Each cause gets exactly its seconds and nothing is left over."""
    from maxlite.resilience.clock import Clock

    t = [100.0]
    now = lambda: t[0]  # noqa: E731
    clock = Clock(started=100.0, now=now)
    clock.attach(str(tmp_path), primary=True)
    t[0] += 3.0
    clock.setup_end()  # startup 3

    def step(n, data=0.0, dispatch=0.0, waits=0.0, sections=(), end=True):
        clock.step_begin()
        with clock.data_wait():
            t[0] += data
        t[0] += dispatch
        if not end:
            return
        clock.step_end(n)
        for name, seconds in sections:
            with clock.section(name):
                t[0] += seconds
        t[0] += waits  # the vote and the next read, waiting for the step and the peers

    step(1, data=0.5, dispatch=6.0, waits=1.0)  # compiling: 7
    step(2, data=0.25, dispatch=1.0, waits=4.0, sections=[("eval", 2.0)])  # 5 productive
    step(3, dispatch=1.0, waits=1.5, sections=[("snapshot", 0.5)])  # 2.5 productive
    step(4, dispatch=2.0, end=False)  # its read found a NaN in step 3: abandoned
    clock.step_abandoned()
    with clock.section("rollback"):
        t[0] += 1.25
    step(3, dispatch=1.0, waits=1.0)  # step 3 again: recomputed 2
    t[0] += 0.75  # the last read
    clock.loop_end()  # ...belongs to step 3: recomputed 2.75
    with clock.section("sample"):
        t[0] += 1.5
    with clock.section("peak_probe"):
        t[0] += 0.5
    s = clock.goodput.summary()
    assert s["wall_seconds"] == pytest.approx(t[0] - 100.0)
    assert s["productive_seconds"] == pytest.approx(5.0 + 2.5)
    want = {"startup": 3.0, "compilation": 7.0, "data_wait": 0.75, "eval": 2.0, "snapshot": 0.5,
            "rollback": 2.0 + 1.25, "recomputed": 2.75, "sample": 1.5, "peak_probe": 0.5, "other": 0.0}
    assert {k: s[f"badput_{k}_seconds"] for k in want} == pytest.approx(want)


@pytest.mark.parametrize("finished", [False, True])
def test_goodput_charges_the_gap_to_a_restart_not_to_a_later_extension(tmp_path, finished):
    """An attempt last alive 1000 s ago: after a failure or preemption the gap is restart badput and
    wall time; after a finished run (a later command extends it) it is neither."""
    path = str(tmp_path / "goodput.json")
    g = goodput.Goodput(path, time.monotonic())
    g.step(1, 2.0, 0.0, compiling=True)
    g.save(finished=finished)
    with open(path) as f:
        record = json.load(f)
    record["last_alive"] -= 1000.0  # as if that attempt ended 1000 s ago
    with open(path, "w") as f:
        json.dump(record, f)
    s = goodput.Goodput(path, time.monotonic()).summary()
    if finished:
        assert s["badput_restart_seconds"] == 0.0 and s["wall_seconds"] < 1000.0
    else:
        assert s["badput_restart_seconds"] >= 1000.0 and s["wall_seconds"] >= 1000.0


def test_blob_round_trip():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.array([7], np.int32)
    blob = snapshot.pack(5, [("a", a.dtype, (6, 4), [(((0, 3), (0, 4)), a), (((3, 6), (0, 4)), a + 1)]),
                             ("b", b.dtype, (1,), [(((0, 1),), b)])])
    step, leaves = snapshot.unpack(blob)
    assert step == 5
    np.testing.assert_array_equal(leaves["a"][((3, 6), (0, 4))], a + 1)
    np.testing.assert_array_equal(leaves["b"][((0, 1),)], b)


def test_shm_keeper_put_is_atomic_and_drops(tmp_path):
    k = keeper.ShmKeeper(str(tmp_path / "run"), root=str(tmp_path))
    k.put(2, "own", 0, b"x" * 10)
    k.put(4, "own", 0, b"y" * 10)
    open(os.path.join(k.dir, f"{6:010d}.own.0.snap.tmp123"), "wb").close()  # a torn write
    assert k.steps("own", 0) == [2, 4] and k.steps("peer", 0) == []
    assert bytes(k.get(4, "own", 0)) == b"y" * 10  # memory-mapped
    k.drop(2, "own", 0)
    assert k.steps("own", 0) == [4]
    k.clear()
    assert not os.path.exists(k.dir)


def _tiny_state(num_devices=8):
    from tests.helpers import build

    argv = ["base.yml", "model_name=tiny", "base_num_decoder_layers=2", "ici_fsdp_parallelism=4",
            "ici_tensor_parallelism=2", "max_target_length=32", "per_device_batch_size=1"]
    return build(argv, num_devices)


def test_snapshot_round_trip_survives_donation(tmp_path):
    """A snapshot is taken, the next step donates the state, and the restore gives the snapshot back."""
    from flax import nnx

    from maxlite import data, mesh as mesh_lib, optim, state as state_lib
    from maxlite.resilience.vote import Vote

    cfg, mesh, state, step_fn, batch_sharding = _tiny_state()
    tx = optim.make_optimizer(cfg)
    _, abstract, shardings = state_lib.abstract_state(cfg, mesh, tx)
    k = keeper.ShmKeeper(str(tmp_path / "run"), root=str(tmp_path))
    snaps = snapshot.Snapshots(mesh, shardings, k, period=1, max_bytes=1 << 30)
    batches = data.make_iterator(cfg, "train", 0, 1)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        put = lambda: {k_: jax.device_put(v, batch_sharding) for k_, v in next(batches).items()}  # noqa: E731
        state, _ = step_fn(state, put())
        expected = jax.device_get(state)
        expected_data = batches.get_state()
        snaps.take(1, state, expected_data)
        state, _ = step_fn(state, put())  # donates the snapshotted state
        snaps.wait()
        assert k.steps(snaps.own_kind, 0) == [1] and snaps.own_kind == "own-p1m1x1x4x1x1x2"  # 1 process; data, stage, fsdp, context, expert, tensor
        got_state, got_data, got_step, detail = snaps.restore(Vote(8), abstract)
    assert got_step == 1 and got_data == expected_data and detail == "own shards"
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(got_state), expected)
    for got, want in zip(jax.tree.leaves(got_state), jax.tree.leaves(shardings)):
        assert got.sharding == want
    k.clear()


def test_snapshots_respect_the_memory_budget(tmp_path):
    cfg, mesh, state, step_fn, batch_sharding = _tiny_state()
    from maxlite import optim, state as state_lib

    _, abstract, shardings = state_lib.abstract_state(cfg, mesh, optim.make_optimizer(cfg))
    k = keeper.ShmKeeper(str(tmp_path / "run"), root=str(tmp_path))
    size = state_lib.nbytes(abstract)
    snaps = snapshot.Snapshots(mesh, shardings, k, period=1, max_bytes=int(3.5 * size), log=lambda m: None)
    for s in (1, 2, 3, 4):
        snaps.take(s, state, {"i": s})
        snaps.wait()
    assert k.steps(snaps.own_kind, 0) == [2, 3, 4]  # three fit in 3.5× one snapshot; the oldest went
    tight = snapshot.Snapshots(mesh, shardings, k, period=1, max_bytes=size, log=lambda m: None)
    tight.take(5, state, {})
    tight.wait()
    assert tight.disabled and 5 not in k.steps(snaps.own_kind, 0)
    k.clear()


def test_a_snapshot_due_while_the_last_is_written_waits_for_it_and_is_taken(tmp_path):
    """Every host must take the same snapshots (each queues a ring-shift collective), so a busy
    writer makes the next snapshot wait, never skip. The keeper holds step 1's write open until the
    loop has come to step 2 and found it busy."""
    import time

    cfg, mesh, state, step_fn, batch_sharding = _tiny_state()
    from maxlite import optim, state as state_lib

    _, abstract, shardings = state_lib.abstract_state(cfg, mesh, optim.make_optimizer(cfg))
    shm = keeper.ShmKeeper(str(tmp_path / "run"), root=str(tmp_path))
    snaps = None

    class HoldFirstWrite:
        def put(self, step, kind, rank, blob):
            if step == 1:
                deadline = time.monotonic() + 120  # only a broken wait reaches it: the test then fails below
                while snaps.stalls == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)
            shm.put(step, kind, rank, blob)

        def __getattr__(self, name):
            return getattr(shm, name)

    snaps = snapshot.Snapshots(mesh, shardings, HoldFirstWrite(), period=1, max_bytes=1 << 30, log=print)
    snaps.take(1, state, {"i": 1})
    snaps.take(2, state, {"i": 2})  # step 1's write is held open: this waits for it
    snaps.wait()
    assert snaps.stalls == 1
    assert shm.steps(snaps.own_kind, 0) == [1, 2]
    shm.clear()


HANG_SCRIPT = """
import time
from maxlite.resilience.watchdog import Watchdog
now = [0.0]  # the watchdog's clock, injected: the test decides when time passes, not the machine's load
w = Watchdog(initial_timeout=30, factor=2.0, min_timeout=0.5, log_path={log!r}, poll=0.1,
             on_hang=lambda s, t, r: open({marker!r}, 'w').write(s + " " + r), clock=lambda: now[0],
             progress=lambda: 0.0)
for i in range(4):
    w.beat("step", completed="step" if i else None)
    now[0] += 0.05  # 50 ms steps
now[0] += 10.0  # then 10 s without a beat, and no work: the real thread below is stuck
def stuck_in_collective():
    time.sleep(60)
stuck_in_collective()
"""


def test_watchdog_dumps_stacks_and_exits_75(tmp_path):
    log, marker = str(tmp_path / "hang.log"), str(tmp_path / "marker")
    proc = subprocess.run([sys.executable, "-c", HANG_SCRIPT.format(log=log, marker=marker)],
                          capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == outcome.HANG, proc.stderr
    text = open(log).read()  # text is the contract: the dump is for a person reading the hang
    assert "(timeout 0.5s)" in text  # learned from the beats (min_timeout), not the initial 30 s
    assert "hang detected in section 'step'" in text and "stuck_in_collective" in text
    assert "maxlite-watchdog" in text  # every thread's stack, the watchdog's own included
    assert open(marker).read() == "step hang"


class _Fake:
    """An injected clock and work counter for the watchdog (seconds, CPU seconds)."""

    def __init__(self):
        self.t, self.work = 0.0, 0.0


def _watched(fake, min_span=0.0):
    from maxlite.resilience.watchdog import Watchdog

    w = Watchdog(initial_timeout=30, factor=2.0, min_timeout=1.0, clock=lambda: fake.t,
                 progress=lambda: fake.work, start=False)
    w.min_span = min_span  # judged over the timeout alone; the peers' lag is tested below
    w.beat("step")
    fake.t = 1.0
    w.beat("step", completed="step")  # one 1 s step seen: the timeout is max(1, 2 × 1) = 2 s
    return w


def _poll_until(w, fake, until, work_per_second):
    """Polls every 0.5 s up to time `until` with the work rate given; the first verdict, or None."""
    while fake.t < until:
        fake.t += 0.5
        fake.work += 0.5 * work_per_second
        verdict = w.check()
        if verdict is not None:
            return verdict
    return None


def test_watchdog_tells_a_starved_process_from_a_stuck_one(capsys):
    from maxlite.resilience.watchdog import MIN_WORK_SHARE, SLOW_CAP

    stuck = _Fake()
    w = _watched(stuck)
    assert _poll_until(w, stuck, 10.0, 0.0) == ("step", 2.5, 2.0)  # first look past the 2 s timeout

    starved = _Fake()  # a quarter of a core: slow (compiling, or a loaded machine), not hung
    w = _watched(starved)
    assert _poll_until(w, starved, 12.0, 0.25) is None
    # text is the contract: the console notice a person sees, once per step (no status changes)
    assert capsys.readouterr().err.count("slow, not hung") == 1
    # its work stops at t = 12: hung once a whole timeout (2 s) went by without it, at t = 14
    assert _poll_until(w, starved, 30.0, 0.0) == ("step", 13.0, 2.0)

    barely = _Fake()  # below the share that counts as work
    w = _watched(barely)
    assert _poll_until(w, barely, 10.0, MIN_WORK_SHARE / 2)[0] == "step"

    spinning = _Fake()  # working forever in one step: hung after SLOW_CAP × the timeout all the same
    w = _watched(spinning)
    assert _poll_until(w, spinning, 100.0, 1.0) == ("step", SLOW_CAP * 2.0 + 0.5, 2.0)

    # the peers' work arrives up to 4 s late (published, then read, every 2 s): judged over 6 s, a
    # peer's work is still seen; stopped at t = 12, hung once the 6 s span holds less than 5% of a
    # core (0.3 CPU-s): at t = 17, when it holds only the last second's 0.25
    from maxlite.resilience.progress import SPAN_SECONDS
    assert SPAN_SECONDS == 6.0
    late = _Fake()
    w = _watched(late, SPAN_SECONDS)
    assert _poll_until(w, late, 12.0, 0.25) is None
    assert _poll_until(w, late, 30.0, 0.0) == ("step", 16.0, 2.0)


def test_loss_watch_verdicts():
    """Non-finite at once; a spike only after `patience` steps in a row above factor × the median of
    the good losses (a shorter one passes); nothing judged before the window has enough history."""
    from maxlite.resilience.spikes import MIN_HISTORY, SpikeWatch

    early = SpikeWatch(factor=2.0, patience=2)
    assert early.see(1, 10.0) is None and early.see(2, 100.0) is None and early.see(3, 100.0) is None
    nan = early.see(4, float("nan"))
    assert (nan.first_bad, nan.step) == (4, 4) and "nan" in nan.why
    grad = early.see(5, 10.0, finite=False)
    assert (grad.first_bad, grad.step) == (5, 5) and "gradient is not finite" in grad.why

    w = SpikeWatch(factor=2.0, patience=3)
    losses = [4.0 - 0.01 * i for i in range(MIN_HISTORY)]
    for step, loss in enumerate(losses, 1):
        assert w.see(step, loss) is None
    s = MIN_HISTORY
    assert w.see(s + 1, 9.0) is None and w.see(s + 2, 9.0) is None  # two spiked steps: patience 3
    assert w.see(s + 3, 3.9) is None  # back to normal: the stretch is over
    assert w.see(s + 4, 7.0) is None  # under 2 × median (~3.96)
    assert w.see(s + 5, 8.5) is None and w.see(s + 6, 8.5) is None
    v = w.see(s + 7, 8.5)
    assert (v.first_bad, v.step) == (s + 5, s + 7) and "above 2 × the median" in v.why
    w.rolled_back(s + 4)
    assert w.see(s + 5, 8.5) is None  # the stretch starts over after a rollback
    off = SpikeWatch(factor=0.0, patience=1)
    for step in range(1, 20):
        assert off.see(step, 1e6 * step) is None  # factor 0: only non-finite losses are judged


class _Time:
    """An injected clock: time passes only when the test says (or a fault's sleep does)."""

    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def pass_(self, seconds: float) -> None:
        self.t += seconds


def _step(clock, t: _Time, step: int, own: float, waited: float, faults=None) -> None:
    clock.step_begin()
    t.pass_(own)  # data, dispatch: this process's own work
    with clock.device_wait():
        t.pass_(waited)  # the devices, or a peer in a collective
    clock.step_end(step, faults)


def test_a_slowed_hosts_extra_time_is_its_own_work_and_scores_it_a_straggler(tmp_path):
    """fault_type=slow stretches a step's own work (what a degraded host does); on injected clocks
    the slowed host's median is exactly factor × its work, and the report flags it."""
    from maxlite.resilience.clock import Clock
    from maxlite.resilience.faults import Faults

    medians = []
    for slowed in (False, True):
        t = _Time()
        cfg = C.load(["base.yml", *(["fault_type=slow", "fault_step=0", "fault_slowdown_factor=4"] if slowed else [])])
        faults = Faults(cfg, str(tmp_path), 0, sleep=t.pass_)
        clock = Clock(t(), now=t)
        for step in range(1, 6):
            _step(clock, t, step, own=0.1, waited=0.5, faults=faults)
        medians.append(clock.timer.median())
    assert medians == [pytest.approx(0.1), pytest.approx(0.4)]  # the first (compiling) step left out
    rep = straggler.report(np.array(medians), np.zeros(2), threshold=0.7)
    assert rep["stragglers"] == [1] and rep["relative"] == [1.0, pytest.approx(0.25)]


def test_a_peers_stall_inside_a_step_is_the_steps_time_not_other():
    """A 12 s wait on a peer inside step 3 (its read, the vote, a collective) is that step's time —
    productive — and nothing is left to `other`: wall = productive + every cause."""
    from maxlite.resilience.clock import Clock

    t = _Time()
    clock = Clock(t(), now=t)
    clock.goodput = goodput.Goodput(None, t(), now=t)
    t.pass_(3.0)  # start-up
    clock.setup_end()
    for step, waited in ((1, 0.0), (2, 0.0), (3, 12.0), (4, 0.0)):
        _step(clock, t, step, own=0.25, waited=waited)
    with clock.section("checkpoint"):
        t.pass_(1.0)
    clock.loop_end()
    s = clock.goodput.summary()
    assert s["badput_startup_seconds"] == pytest.approx(3.0)
    assert s["badput_compilation_seconds"] == pytest.approx(0.25)  # the first step of the attempt
    assert s["productive_seconds"] == pytest.approx(3 * 0.25 + 12.0)
    assert s["badput_checkpoint_seconds"] == pytest.approx(1.0) and s["badput_other_seconds"] == pytest.approx(0.0)
    assert s["wall_seconds"] == pytest.approx(3.0 + 4 * 0.25 + 12.0 + 1.0)


def test_a_productive_section_is_watched_and_counted_as_step_work():
    """GRPO's rollout runs in a productive section: its own watchdog section and goodput line
    (`productive_rollout_seconds`), compilation in the attempt's first step."""
    from maxlite.resilience.clock import Clock

    t = _Time()
    clock = Clock(t(), now=t)
    clock.goodput = goodput.Goodput(None, t(), now=t)
    clock.setup_end()
    for step in (1, 2, 3):
        clock.step_begin()
        with clock.section("rollout", productive=True):
            t.pass_(2.0)
        t.pass_(0.5)
        clock.step_end(step)
    clock.loop_end()
    s = clock.goodput.summary()
    assert s["productive_rollout_seconds"] == pytest.approx(4.0)  # steps 2 and 3
    assert s["productive_seconds"] == pytest.approx(2 * 2.5)
    assert s["badput_compilation_seconds"] == pytest.approx(2.5) and s["badput_other_seconds"] == pytest.approx(0.0)


def test_a_later_steps_compiles_are_compilation_and_not_a_slow_step():
    """The rollout engine compiling for a new prompt length inside step 3's rollout (1.5 s of its
    2 s), and step 4 compiling 0.2 s of its own 0.5 s: those seconds are compilation, the rest stays
    productive, and neither step enters the straggler statistics (a new program is not a slow host)."""
    from maxlite.resilience.clock import Clock

    t, compiled = _Time(), [0.0]

    def compile_for(seconds):
        compiled[0] += seconds
        t.pass_(seconds)

    clock = Clock(t(), now=t, compile_seconds=lambda: compiled[0])
    clock.goodput = goodput.Goodput(None, t(), now=t)
    clock.setup_end()
    for step, in_rollout, own in ((1, 0.0, 0.0), (2, 0.0, 0.0), (3, 1.5, 0.0), (4, 0.0, 0.2), (5, 0.0, 0.0)):
        clock.step_begin()
        with clock.section("rollout", productive=True):
            compile_for(in_rollout)
            t.pass_(2.0 - in_rollout)
        compile_for(own)
        t.pass_(0.5 - own)
        clock.step_end(step)
    clock.loop_end()
    s = clock.goodput.summary()
    assert s["badput_compilation_seconds"] == pytest.approx(2.5 + 1.5 + 0.2)  # step 1 whole, then the compiles
    assert s["productive_rollout_seconds"] == pytest.approx(2.0 + 0.5 + 2.0 + 2.0)
    assert s["productive_seconds"] == pytest.approx(4 * 2.5 - 1.5 - 0.2)
    assert s["badput_other_seconds"] == pytest.approx(0.0)
    assert len(clock.timer.window) == 2  # steps 2 and 5: the first and the two that compiled left out


def test_compile_seconds_are_this_threads_own():
    """JAX's backend-compile event, counted for the thread that compiled: a program compiled on
    another thread (an asynchronous rollout's) is not the training loop's."""
    import threading

    import jax
    import jax.numpy as jnp

    from maxlite.resilience import compiles

    before = compiles.on_this_thread()
    other = threading.Thread(target=lambda: jax.jit(lambda x: x * 7 - 3)(jnp.ones(5)).block_until_ready())
    other.start()
    other.join()
    assert compiles.on_this_thread() == before
    jax.jit(lambda x: x * 11 + 2)(jnp.ones(5)).block_until_ready()
    assert compiles.on_this_thread() > before


def test_loss_watch_points_at_a_restored_state_bad_at_its_first_step():
    """A bad loss at the first step after a rollback implicates the state it restored (other
    batches than before went bad from it); one later than that, or before any rollback, does not."""
    from maxlite.resilience.spikes import SpikeWatch

    w = SpikeWatch(factor=0.0, patience=1)
    assert w.see(1, 3.0) is None and w.see(2, 2.9) is None
    assert w.see(3, float("nan")).state_step is None  # no rollback yet: data or state, unknown
    w.rolled_back(2)
    again = w.see(3, float("inf"))
    assert (again.first_bad, again.state_step) == (3, 2)
    w.rolled_back(1)
    assert w.see(2, 2.8) is None
    later = w.see(3, float("nan"))  # good first step from state 1: the data (or training) went bad
    assert later.state_step is None
    spiky = SpikeWatch(factor=2.0, patience=2)
    for step in range(1, 9):
        assert spiky.see(step, 4.0) is None
    spiky.rolled_back(8)
    assert spiky.see(9, 50.0) is None
    assert spiky.see(10, 50.0).state_step == 8  # a spiked stretch that began at the first step


def test_peer_progress_that_cannot_be_read_is_said_once():
    """The coordinator's key-value store gone (a peer's host died): the hang watchdog goes on with
    this process's work and the peers' last figures, and the warning says so once, not per poll."""
    from maxlite.resilience.progress import PUBLISH_SECONDS, Progress

    class Gone:  # jax.distributed's client once the coordinator is unreachable
        def key_value_set(self, *args, **kwargs):
            raise RuntimeError("UNAVAILABLE: failed to connect to the coordination service")

    now, said = [0.0], []
    progress = Progress(clock=lambda: now[0], own=lambda: 5.0, log=said.append)
    progress.client = lambda: Gone()
    for _ in range(4):
        assert progress() == 5.0
        now[0] += PUBLISH_SECONDS
    assert len(said) == 1 and "cannot read the peers' progress" in said[0] and "UNAVAILABLE" in said[0]
