"""maxlite/lease.py: one writer per run directory — the takeover rule, and the lease on local disk
and on gs:// (the GCS emulator: generation preconditions)."""

import json
import os
import subprocess
import sys

import pytest

from maxlite.outcome import TransientError
from maxlite.lease import FILE, Holder, Lease, takeover_reason
from tests.gcs_emulator import gcs_emulator, make_bucket  # noqa: F401


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_takeover_rule():
    me = Holder("", "python -m maxlite.train", host="h1", pid=os.getpid(), since=1000.0)
    alive = {"job": "", "host": "h1", "pid": os.getpid(), "since": 900.0, "heartbeat": 995.0}
    assert takeover_reason(alive, me, timeout=60, now=1000.0) is None  # a live launch of this host
    assert "gone" in takeover_reason({**alive, "pid": _dead_pid()}, me, 60, 1000.0)  # killed -9
    elsewhere = {**alive, "host": "h2"}
    assert takeover_reason(elsewhere, me, 60, 1000.0) is None  # another host, fresh heartbeat
    assert "no heartbeat for 65 s" in takeover_reason({**elsewhere, "heartbeat": 935.0}, me, 60, 1000.0)
    requeued = Holder("slurm:7", "Slurm job 7 attempt 1", host="h1", since=1000.0)
    assert "same job" in takeover_reason({**elsewhere, "job": "slurm:7"}, requeued, 60, 1000.0)
    assert takeover_reason({**elsewhere, "job": "slurm:8"}, requeued, 60, 1000.0) is None
    assert takeover_reason({**elsewhere, "job": "slurm:7", "since": 2000.0}, requeued, 60, 1000.0) is None


def _lease(run_dir, job="", timeout=60.0, **holder):
    return Lease(str(run_dir), Holder(job, "test", **holder), timeout, log=lambda line: None)


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_one_holder_refusal_takeover_and_loss(tmp_path, where, request):
    if where == "gcs":
        emulator = request.getfixturevalue("gcs_emulator")
        run_dir = f"{make_bucket(emulator.url, 'lease-bucket')}/runs/r"
    else:
        run_dir = str(tmp_path / "runs" / "r")
    first = _lease(run_dir, host="a", pid=os.getpid())
    first.acquire()
    second = _lease(run_dir, host="b", pid=os.getpid())
    with pytest.raises(TransientError, match=r"is in use by test on host a, pid \d+, since .*last heartbeat \d+ s ago"):
        second.acquire()
    assert first.heartbeat() and first.lost is None
    if where == "gcs":  # two launches at the same moment: the object's generation decides
        assert not second.store.write({"token": "race"}, 0)
        held, generation = second.store.read()
        assert held["token"] == first.me.token and not second.store.write({"token": "race"}, generation - 1)
    # the same job's later attempt (a requeue) takes it over; the first holder sees it at its next beat
    first_job = _lease(run_dir + "2", job="slurm:1", host="a")
    first_job.acquire()
    later = _lease(run_dir + "2", job="slurm:1", host="b")
    later.acquire()
    assert later.took_over["host"] == "a" and "same job" in later.took_over["why"]
    assert not first_job.heartbeat() and "taken over by test on host b" in first_job.lost
    first_job.release()  # no longer its own: left to the new holder
    assert later.heartbeat()
    later.release()
    first.release()
    assert _lease(run_dir, host="c").acquire() is None  # released: free again


def test_a_stale_lease_of_another_host_is_taken_over(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / FILE).write_text(json.dumps({"job": "", "launcher": "python -m maxlite.train", "host": "vanished",
                                            "pid": 1, "token": "x", "since": 0.0, "heartbeat": 0.0}))
    taker = _lease(run_dir, timeout=120)
    taker.acquire()
    assert taker.took_over["host"] == "vanished" and "no heartbeat for" in taker.took_over["why"]
    assert json.loads((run_dir / FILE).read_text())["token"] == taker.me.token
    taker.release()
    assert not (run_dir / FILE).exists()
