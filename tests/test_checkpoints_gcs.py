"""gs:// through the real client stack (Orbax, tensorstore, gcsfs, google-cloud-storage) on fake-gcs-server."""

from __future__ import annotations

import os

import pytest

from maxlite import checkpoints as ck, config as C, state as state_lib
from maxlite.checkpoints.saver import Checkpointer
from tests.gcs_emulator import gcs_emulator, make_bucket  # noqa: F401
from tests.helpers import start as _start, trained as _trained

pytestmark = pytest.mark.gcs


def test_save_list_resume_and_leftovers_on_gcs(tmp_path, gcs_emulator, capsys):  # noqa: F811
    bucket = make_bucket(gcs_emulator.url, "ckpt-basic")
    extra = [f"checkpoint_dir={bucket}/run/ckpt", "async_checkpointing=true"]
    cfg, state, data = _trained(tmp_path, extra, steps=1, devices=1, mesh=("ici_fsdp_parallelism=1",))
    saver = Checkpointer(cfg, True, state_lib.nbytes(state))
    assert saver.save(1, state, data)
    saver.close()
    import gcsfs
    fs = gcsfs.GCSFileSystem()
    # A save killed half-way on GCS: objects written, no commit_success.txt (there is no rename).
    fs.copy(f"{bucket}/run/ckpt/1", f"{bucket}/run/ckpt/5", recursive=True)
    fs.rm(f"{bucket}/run/ckpt/5/commit_success.txt")
    rows = ck.list_checkpoints(f"{bucket}/run/ckpt")
    assert [(r["step"], r["complete"]) for r in rows] == [(1, True), (5, False)]
    assert rows[0]["name"] == "step=1-consumed_samples=1" and rows[0]["bytes"] > 0
    capsys.readouterr()
    _, started, data2, c = _start(tmp_path, extra, 1)
    restored = started.state
    c.close()
    out = capsys.readouterr().out
    assert "removed incomplete checkpoint 5, left by a save whose process ended while writing it" in out
    assert int(restored.step) == 1 and data2.get_state() == {"step": 1}
    assert not fs.exists(f"{bucket}/run/ckpt/5")


def test_missing_bucket_is_a_config_error(gcs_emulator):  # noqa: F811
    with pytest.raises(C.ConfigError, match="gs://no-such-bucket: bucket or path does not exist"):
        ck.check_path("gs://no-such-bucket/x")


class _Data:
    def get_state(self):
        return {"step": 0}


def _kill(emulator) -> None:
    emulator.proc.kill()
    emulator.proc.wait()
    emulator.proc = None


def test_storage_down_fails_the_save_cleanly(tmp_path, gcs_emulator, capsys):  # noqa: F811
    """The endpoint is down when a save starts: the writer thread fails, the next poll prints it, step 1
    stays, training continues, and the next save works once storage is back. (The stop policy's run:
    tests/test_checkpoints_resume.py::test_policy_stop_ends_the_run_cleanly_when_storage_dies.)"""
    bucket = make_bucket(gcs_emulator.url, "ckpt-fail")
    extra = [f"checkpoint_dir={bucket}/c", "checkpoint_error_policy=continue"]
    cfg, state, _ = _trained(tmp_path, extra, steps=0, devices=1, mesh=("ici_fsdp_parallelism=1",))
    saver = Checkpointer(cfg, True, state_lib.nbytes(state))
    assert saver.save(1, state, _Data())
    saver.poll(wait=True)
    _kill(gcs_emulator)
    try:
        assert saver.save(2, state, _Data())  # handed to the writer thread: the loop goes on
        saver.poll(wait=True)  # waits out the client's retries (~35 s), reports, and training continues
    finally:
        gcs_emulator.start()
    err = capsys.readouterr().err
    assert f"checkpoint save at step 2 to {bucket}/c failed" in err
    assert "the previous checkpoint (step 1) is intact; training continues" in err
    assert ck.complete_steps(f"{bucket}/c") == [1]
    assert saver.save(3, state, _Data())  # storage is back: the next save works
    saver.close()
    assert ck.complete_steps(f"{bucket}/c") == [1, 3]


def test_endpoint_stalls_during_an_async_save_and_the_retries_finish_it(tmp_path, gcs_emulator, capsys):  # noqa: F811
    """The endpoint stops answering while a save writes its arrays (its process frozen: what an
    overloaded or partitioned endpoint does) and answers again 3 s later with its state intact: the
    clients' retries finish the save, which is complete, verified and restores bit for bit; training
    goes on meanwhile. (An endpoint that dies and stays down: test_storage_down_fails_the_save_cleanly.)"""
    import signal
    import threading
    import time
    bucket = make_bucket(gcs_emulator.url, "ckpt-outage")
    from tests.helpers import build
    argv = ["base.yml", "model_name=tiny", "ici_fsdp_parallelism=1", f"checkpoint_dir={bucket}/c",
            "per_device_batch_size=1", "max_target_length=16", "checkpoint_error_policy=continue"]
    cfg, _, state, _, _ = build(argv, 1)  # 60 MiB of state: the write is still running at the stall
    saver = Checkpointer(cfg, True, state_lib.nbytes(state))
    assert saver.save(1, state, _Data())
    saver.poll(wait=True)
    step2 = gcs_emulator.root / "ckpt-outage" / "c" / "2"
    stalled = threading.Event()

    def stall_when_arrays_are_being_written():
        # tensorstore writes array chunks (under .../d/) only in the background part of a save.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if any("/d/" in str(p) for p in step2.rglob("*") if p.is_file()):
                os.kill(gcs_emulator.proc.pid, signal.SIGSTOP)
                stalled.set()
                time.sleep(3)
                os.kill(gcs_emulator.proc.pid, signal.SIGCONT)
                return
            time.sleep(0.005)
    watcher = threading.Thread(target=stall_when_arrays_are_being_written)
    watcher.start()
    try:
        saver.save(2, state, _Data())  # handed to the writer thread: the loop goes on
        watcher.join()
    finally:
        os.kill(gcs_emulator.proc.pid, signal.SIGCONT)
    assert stalled.is_set(), "the save never wrote array data"
    saver.poll(wait=True)
    captured = capsys.readouterr()
    assert "saved checkpoint step 2" in captured.out and "failed" not in captured.err, captured.err
    assert ck.complete_steps(f"{bucket}/c") == [1, 2]
    assert ck.resolve_step_dir(f"{bucket}/c")[1] == 2  # what a restart resumes from
    saver.close()
    _, params = ck.load_params(f"{bucket}/c")  # verified against the checksums written with it
    import jax
    import numpy as np
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state.params)))


def _damage_object(fs, prefix: str, how: str) -> None:
    """The biggest object under `prefix`, bytes flipped (or cut in half), written back."""
    path = max(fs.find(prefix), key=lambda p: fs.size(p))
    data = bytearray(fs.cat_file(path))
    if how == "flip":
        data[64:68] = bytes(b ^ 0xFF for b in data[64:68])
    else:
        data = data[:len(data) // 2]
    fs.pipe_file(path, bytes(data))


def test_damaged_checkpoints_on_gcs_are_caught_and_passed_over(tmp_path, gcs_emulator, capsys):  # noqa: F811
    """Flipped bytes in the newest of three gs:// checkpoints, a truncated object in the one before:
    `verify` names them, `list` marks them, a resume restores the oldest, intact one."""
    import gcsfs
    from tests.helpers import changed

    bucket = make_bucket(gcs_emulator.url, "ckpt-damage")
    extra = [f"checkpoint_dir={bucket}/c", "async_checkpointing=false"]
    cfg, state, data = _trained(tmp_path, extra, steps=1, devices=1, mesh=("ici_fsdp_parallelism=1",))
    saver = Checkpointer(cfg, True, state_lib.nbytes(state))
    for step in (1, 2, 3):
        saver.save(step, state, data)
    saver.close()
    root = f"{bucket}/c"
    before = ck.load_numpy(root, "params", step=3)
    fs = gcsfs.GCSFileSystem()
    _damage_object(fs, f"{root}/3/params/ocdbt.process_0/d", "flip")
    _damage_object(fs, f"{root}/2/optimizer/ocdbt.process_0/d", "truncate")
    damaged = changed(root, 3, "params", before)
    assert damaged
    capsys.readouterr()
    assert ck.main(["verify", root]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 1: intact")
    assert out[1].startswith("step 2: CORRUPT: optimizer/")
    assert {part.split(" (")[0] for part in out[2].removeprefix("step 3: CORRUPT: ").split("; ")} == damaged
    assert ck.main(["list", root]) == 0
    assert [("CORRUPT" in line) for line in capsys.readouterr().out.splitlines()] == [False, True, True]
    for step in (2, 3):  # as if found by a resume: no marker, the restore itself must catch them
        fs.rm(f"{root}/{step}/corrupt.json")
    _, restored, data2, c = _start(tmp_path, extra, 1)
    c.close()
    out = capsys.readouterr().out
    assert "checkpoint step 3 in" in out and "is corrupt: " in out and "resumed from step 1 " in out
    assert int(restored.step) == 1 and data2.get_state() == {"step": 1}
    assert ck.complete_steps(root) == [1]  # the corrupt ones are gone: the run saves them again
