"""Checkpoints in process: restore onto other meshes, params-only load, best-k retention, listing, errors."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

from maxlite import checkpoints as ck, config as C, state as state_lib
from maxlite.checkpoints import offload
from maxlite.checkpoints.saver import Checkpointer
from maxlite.data.synthetic import make_synthetic_iterator
from tests.helpers import SMALL, build, start as _start, trained as _trained


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]

def test_restore_onto_other_meshes_bitwise(tmp_path):
    cfg, state, data = _trained(tmp_path)
    saver = Checkpointer(cfg, True, state_lib.nbytes(state))
    assert saver.save(2, state, data)
    saver.close()
    assert [(r["name"], r["complete"]) for r in ck.list_checkpoints(saver.path)] == [
        ("step=2-consumed_samples=16", True)]
    want = _host(state)
    for mesh, devices in ((["ici_fsdp_parallelism=8"], 8), (["ici_fsdp_parallelism=1"], 1)):
        _, started, data2, c = _start(tmp_path, ["run_name=src", *mesh], devices)
        c.close()
        restored = started.state
        assert (started.step, started.source) == (2, "checkpoint")
        assert int(restored.step) == 2 and data2.get_state() == {"step": 2}
        leaf = jax.tree.leaves(restored.params)[0]
        assert len(leaf.sharding.device_set) == devices
        got = _host(restored)
        assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))


def test_params_only_load_and_bridge_api(tmp_path, capsys):
    cfg, state, _ = _trained(tmp_path, steps=1)
    where = ck.save_params(str(tmp_path / "export"), cfg, jax.device_get(state.params), step=7)
    assert where.endswith("/7")
    # The bridge's reader: saved config back, host numpy arrays, equal values.
    cfg2, params = ck.load_params(str(tmp_path / "export"))
    assert cfg2.base_emb_dim == 64 and cfg2.mesh_shape == cfg.mesh_shape
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(params))
    assert all(np.array_equal(a, b) for a, b in zip(_host(params), _host(state.params)))
    # load_parameters_path: weights only, fresh optimizer, step 0, on a different mesh.
    _, started, _, _ = _start(tmp_path, ["run_name=ft", f"load_parameters_path={tmp_path}/export/7"], 2,
                              ckpt=False)
    fresh = started.state
    assert (started.step, started.source) == (0, "params") and int(fresh.step) == 0
    assert all(np.array_equal(a, b) for a, b in zip(_host(fresh.params), _host(state.params)))
    mu = fresh.opt_state[1][0].mu  # clip, then adamw's scale_by_adam state
    assert all(not np.any(x) for x in _host(mu))
    # A params-only checkpoint cannot serve as a full state.
    with pytest.raises(C.ConfigError, match="parameters only"):
        _start(tmp_path, ["run_name=x", f"load_full_state_path={tmp_path}/export"], 1, ckpt=False)


def test_incompatible_model_names_the_parameter(tmp_path):
    cfg, state, _ = _trained(tmp_path, steps=0, devices=1, mesh=("ici_fsdp_parallelism=1",))
    ck.save_params(str(tmp_path / "export"), cfg, jax.device_get(state.params))
    with pytest.raises(C.ConfigError, match=r"parameter '\S+' is \(.*\) there but \(.*\) here"):
        _start(tmp_path, ["run_name=y", "base_emb_dim=128", f"load_parameters_path={tmp_path}/export"], 1,
               ckpt=False)


def test_best_k_plus_latest_retention_survives_restart(tmp_path, capsys):
    extra = ["checkpoint_keep_best_k=2", "max_num_checkpoints_to_keep=1", "eval_interval=1",
             "async_checkpointing=false"]
    cfg, state, data = _trained(tmp_path, extra, steps=0, devices=1, mesh=("ici_fsdp_parallelism=1",))
    saver = Checkpointer(cfg, True, state_lib.nbytes(state))
    for step, loss in zip((1, 2, 3, 4), (3.0, 1.0, 2.0, 5.0)):
        saver.note_eval(loss)
        saver.save(step, state, data)
    assert ck.complete_steps(saver.path) == [2, 3, 4]  # best two (1.0, 2.0) + the latest
    saver.close()
    saver = Checkpointer(cfg, True, state_lib.nbytes(state))  # metrics are re-read after a restart
    saver.note_eval(1.5)
    saver.save(5, state, data)
    saver.close()
    assert ck.complete_steps(saver.path) == [2, 5]
    rows = ck.list_checkpoints(saver.path)
    assert [r["name"] for r in rows] == ["step=2-consumed_samples=2-val_loss=1.00",
                                         "step=5-consumed_samples=5-val_loss=1.50"]


def test_a_failed_save_is_not_tried_again_by_the_schedule(tmp_path, monkeypatch):
    """The last step is due twice (its period and the run's completion): once its async save has
    failed and been reported, the completion save does not write it again and fail a second time."""
    cfg, state, data = _trained(tmp_path, ["checkpoint_period=2", "steps=2", "checkpoint_error_policy=continue"],
                                steps=0, devices=1, mesh=("ici_fsdp_parallelism=1",))

    def refuse(self, step, args, metrics):
        raise OSError(f"injected: storage refuses step {step}")

    monkeypatch.setattr(Checkpointer, "_write", refuse)
    saver = Checkpointer(cfg, True, state_lib.nbytes(state))
    assert saver.maybe_save(2, state, data)
    saver.poll(wait=True)  # the writer's failure, reported
    assert [f["step"] for f in saver.failures] == [2]
    assert not saver.maybe_save(2, state, data)
    saver.poll(wait=True)
    assert [f["step"] for f in saver.failures] == [2]
    saver.close()


def test_listing_and_leftovers_of_a_killed_save(tmp_path, capsys):
    cfg, state, data = _trained(tmp_path, ["async_checkpointing=false"], steps=0, devices=1,
                                mesh=("ici_fsdp_parallelism=1",))
    saver = Checkpointer(cfg, True, state_lib.nbytes(state))
    saver.save(3, state, data)
    saver.close()
    root = saver.path
    # What a SIGKILL during the local save of step 6 leaves (the write goes to a tmp dir, renamed last).
    shutil.copytree(f"{root}/3", f"{root}/6.orbax-checkpoint-tmp-1234")
    capsys.readouterr()
    assert ck.main(["list", root]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step=3-consumed_samples=3 ") and " complete " in out[0] + " "
    assert "iB " in out[0] and "INCOMPLETE" in out[1] and "6.orbax-checkpoint-tmp-1234" in out[1]
    _, started, _, c = _start(tmp_path, ["run_name=src"], 1)
    c.close()
    out = capsys.readouterr().out
    assert ("removed incomplete checkpoint 6.orbax-checkpoint-tmp-1234, left by a save whose process "
            "ended while writing it (killed or crashed)") in out
    assert (started.step, started.source) == (3, "checkpoint") and not os.path.exists(f"{root}/6.orbax-checkpoint-tmp-1234")
    # A save that failed (and could not clean up after itself) is named as such at the next start:
    # status.json of the earlier attempt lists it.
    shutil.copytree(f"{root}/3", f"{root}/9.orbax-checkpoint-tmp-77")
    with open(f"{cfg.run_dir}/status.json", "w") as f:
        json.dump({"state": "failed", "checkpoint_failures": [{"step": 9, "error": "OSError: disk full"}]}, f)
    _, _, _, c = _start(tmp_path, ["run_name=src"], 1)
    c.close()
    assert ("removed incomplete checkpoint 9.orbax-checkpoint-tmp-77, left by a save that failed "
            "(OSError: disk full)") in capsys.readouterr().out


def test_user_errors_are_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = C.resolve(C.load([*SMALL, f"checkpoint_dir={blocker}/ckpt"]), 1)
    with pytest.raises(C.ConfigError, match="cannot write checkpoints to"):
        Checkpointer(cfg, True, 0)
    with pytest.raises(C.ConfigError, match="no such checkpoint directory"):
        ck.load_params(str(tmp_path / "nothing"))
    assert ck.main(["list", str(tmp_path / "nothing")]) == 2
    assert "maxlite: error:" in capsys.readouterr().err
    with pytest.raises(C.ConfigError, match="checkpoint_error_policy"):
        C.load([*SMALL, "checkpoint_error_policy=maybe"])


def test_every_process_of_a_run_checks_one_shared_directory_at_once(tmp_path):
    """Each process of a several-host import (each host of a shared filesystem) checks that the
    checkpoint directory is writable as it starts; they do it at the same moment, and none may be told
    it cannot write because a peer's check removed its probe (threads: the same race on the same files)."""
    import concurrent.futures

    from maxlite.checkpoints.storage import check_path

    def checks(_):
        for _ in range(200):
            check_path(str(tmp_path / "shared"))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(checks, range(8)))  # a failed check raises ConfigError here
    assert os.listdir(tmp_path / "shared") == []  # and no probe is left behind


def test_async_save_keeps_its_step_while_the_loop_donates_the_state_at_once(tmp_path, monkeypatch):
    """save() returns before the host copy is made; the steps that follow donate (overwrite) the
    very buffers being copied. The checkpoint must still hold the saved step's values, with the
    writer thread (pinned host memory) and with Orbax's own async save (no pinned host memory)."""
    mesh = ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]
    for writer in (True, False):
        monkeypatch.setattr(offload, "host_kind_available", lambda: writer)
        run = f"run_name=w{writer}"
        cfg, _, state, step, sharding = build([*SMALL, *mesh, f"base_output_directory={tmp_path}/runs", run], 8)
        data = make_synthetic_iterator(cfg, "train", 0, 1)
        batches = [{k: jax.device_put(v, sharding) for k, v in next(data).items()} for _ in range(4)]
        state, _ = step(state, batches[0])
        want, want_params = _host(state), _host(state.params)
        saver = Checkpointer(cfg, True, state_lib.nbytes(state))
        assert (saver.writer is not None) == writer
        assert saver.save(1, state, data)
        for batch in batches[1:]:
            state, _ = step(state, batch)  # donates the buffers being saved, right away
        saver.close()
        assert not any(np.array_equal(a, b) for a, b in zip(_host(state.params), want_params))  # moved on
        _, started, _, c = _start(tmp_path, [run, *mesh], 8)
        c.close()
        restored = started.state
        assert int(restored.step) == 1 and all(np.array_equal(a, b) for a, b in zip(_host(restored), want))


def test_async_save_compiles_nothing_while_the_loop_waits(tmp_path):
    """Replicated leaves (norm scales, step) are not split between replicas with jitted slices: those
    compiles cost ~0.6 s of the first save's blocking part. A model size no other test uses, so no
    earlier test has the programs cached."""
    cfg, state, data = _trained(tmp_path, ["base_emb_dim=96"], steps=0)
    assert any(x.sharding.is_fully_replicated and x.size > 1 for x in jax.tree.leaves(state))
    saver = Checkpointer(cfg, True, state_lib.nbytes(state))
    compiles = []

    def listener(event, seconds, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        assert saver.save(1, state, data)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        saver.close()
    assert compiles == []
    assert ck.complete_steps(saver.path) == [1]


def test_the_data_position_is_global_and_processes_that_disagree_are_refused():
    from maxlite.checkpoints.saver import data_record

    position = {"fingerprint": {"dataset_type": "indexed"}, "grain": {"next_index": 7}}
    assert data_record([position, dict(position)]) == {"process_count": 2, "position": position}
    with pytest.raises(RuntimeError, match="process 1's data position"):
        data_record([position, {**position, "grain": {"next_index": 6}}])
