"""Checksums on every checkpoint: what a save records (checked against CRC32C computed here from the
arrays themselves), restores onto other meshes, damaged bytes caught on restore, by `verify`, in
`list`, and a resume that falls back to the newest intact checkpoint (real processes)."""

from __future__ import annotations

import itertools
import json
import os
import shutil

import google_crc32c
import jax
import numpy as np
import pytest

from maxlite import checkpoints as ck, state as state_lib
from maxlite.checkpoints import crc
from maxlite.checkpoints.saver import Checkpointer
from tests.helpers import (SMALL, changed, flip, largest_data_file, run_module, start as _start,
                           trained as _trained)


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def test_pieces_of_any_layout_add_up_to_each_saved_shards_crc():
    """A saved shard's CRC32C (google_crc32c over its bytes) is the XOR of what the pieces of any
    other layout contribute: restoring onto another mesh checks the same record."""
    a = np.random.default_rng(0).standard_normal((12, 10, 6)).astype(np.float32)
    shard = ((2, 11), (0, 10), (1, 6))
    want = crc.shard_crc0(google_crc32c.value(a[2:11, 0:10, 1:6].tobytes()), shard, 4)
    for cuts in (((2, 5, 11), (0, 10), (1, 6)), ((2, 11), (0, 3, 10), (1, 6)),
                 ((2, 11), (0, 10), (1, 2, 4, 6)), ((2, 4, 11), (0, 7, 10), (1, 3, 6)), ((2, 11), (0, 10), (1, 6))):
        acc = 0
        for box in itertools.product(*(tuple(zip(c[:-1], c[1:])) for c in cuts)):
            acc ^= crc.piece_crc0(shard, box, a[tuple(slice(s, e) for s, e in box)])
        assert acc == want, cuts
    one = ((0, 12), (0, 10), (0, 6))
    assert crc.piece_crc0(one, ((0, 12), (0, 10), (0, 3)), a[:, :, :3]) != crc.piece_crc0(one, ((0, 12), (0, 10), (3, 6)), a[:, :, 3:])


def test_a_save_records_the_crc_of_every_shard_it_wrote(tmp_path):
    cfg, state, data = _trained(tmp_path, ["async_checkpointing=true"])  # fsdp=4 x tensor=2, writer thread
    saver = Checkpointer(cfg, True, state_lib.nbytes(state))
    assert saver.save(2, state, data)
    saver.close()
    root = saver.path
    with open(f"{root}/2/checksums/process_0") as f:
        record = json.load(f)
    values = {"params": state.params, "optimizer": {"step": state.step, "opt_state": state.opt_state}}
    names = 0
    for item, tree in values.items():
        for name, leaf in ck.checksums.leaves(jax.device_get(tree), item):
            full = np.asarray(leaf)
            shards = record["arrays"][name]["shards"]
            assert sum(crc.volume(tuple(map(tuple, box))) for box, _ in shards) == full.size  # a partition
            for box, value in shards:
                assert value == google_crc32c.value(np.ascontiguousarray(full[tuple(slice(*b) for b in box)]).tobytes())
            names += 1
    assert names == len(record["arrays"]) == len(jax.tree.leaves(state))
    for item in ("data", "meta"):
        with open(f"{root}/2/{item}/metadata") as f:
            content = json.load(f)
        canonical = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
        assert record["items"][item] == google_crc32c.value(canonical)


def test_damage_is_caught_on_restore_onto_any_mesh_and_by_verify(tmp_path, capsys):
    cfg, state, data = _trained(tmp_path, ["async_checkpointing=false"])
    saver = Checkpointer(cfg, True, state_lib.nbytes(state))
    assert saver.save(2, state, data)
    saver.close()
    root = saver.path
    for mesh, devices in ((["ici_fsdp_parallelism=8"], 8), (["ici_tensor_parallelism=2", "ici_fsdp_parallelism=1"], 2),
                          (["ici_fsdp_parallelism=1"], 1)):
        _, restored, _, c = _start(tmp_path, ["run_name=src", *mesh], devices)  # intact: verified on any mesh
        restored = restored.state  # where the run starts (maxlite.resume.Start)
        c.close()
        assert all(np.array_equal(a, b) for a, b in zip(_host(restored), _host(state)))
    before = ck.load_numpy(root, "params", step=2)
    flip(largest_data_file(f"{root}/2", "params"), 64)
    damaged = changed(root, 2, "params", before)
    assert damaged  # the flip reached an array's values
    for mesh, devices in ((["ici_fsdp_parallelism=8"], 8), (["ici_tensor_parallelism=2", "ici_fsdp_parallelism=1"], 2)):
        with pytest.raises(ck.CheckpointCorrupt) as e:
            _start(tmp_path, [f"run_name=other{devices}", f"load_full_state_path={root}", *mesh], devices, ckpt=False)
        assert set(e.value.damaged) == damaged
    with pytest.raises(ck.CheckpointCorrupt) as e:  # the bridge's and generate's reader
        ck.load_params(root)
    assert set(e.value.damaged) == damaged and "is corrupt" in str(e.value)
    capsys.readouterr()
    assert ck.main(["verify", root]) == 1
    out = capsys.readouterr().out
    assert out.startswith("step 2: CORRUPT: ") and all(f"{name} (checksum mismatch)" in out for name in damaged)
    assert ck.main(["list", root]) == 0
    assert "CORRUPT (never restored: " in capsys.readouterr().out


ONE = dict(devices=1, mesh=("ici_fsdp_parallelism=1",))  # where the mesh does not matter: the cheapest


def test_a_user_load_of_a_damaged_checkpoint_is_one_line(tmp_path):
    cfg, state, _ = _trained(tmp_path, steps=0, **ONE)
    where = ck.save_params(str(tmp_path / "export"), cfg, jax.device_get(state.params), step=7)
    with open(f"{where}/meta/metadata") as f:
        meta = json.load(f)
    meta["step"] = 8  # valid JSON, other content
    with open(f"{where}/meta/metadata", "w") as f:
        json.dump(meta, f)
    codes, outs = run_module("maxlite.generate", [str(tmp_path / "export"), "--prompt", "hi"], devices=1)
    assert codes == [2], outs[0][-2000:]
    lines = outs[0].strip().splitlines()
    assert lines[-1].startswith(f"maxlite: error: checkpoint {where} is corrupt: meta failed verification")
    assert "Traceback" not in outs[0]


def _train(run_dir, name, *extra, processes=1, devices=2, code=0):
    args = [*SMALL, f"base_output_directory={run_dir}", f"run_name={name}", "max_num_checkpoints_to_keep=0", *extra]
    codes, outs = run_module("maxlite.train", args, processes=processes, devices=devices)
    assert codes == [code] * processes, outs[0][-3000:]
    return outs


def _status(run_dir, name):
    with open(f"{run_dir}/{name}/status.json") as f:
        return json.load(f)


def _files(step_dir: str) -> dict[str, bytes]:
    """Every file of a step (its corrupt marker aside): what a step kept aside must still hold."""
    return {os.path.relpath(os.path.join(d, f), step_dir): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(step_dir) for f in files if f != ck.checksums.MARKER}


def test_resume_passes_over_damaged_checkpoints_to_the_newest_intact_one(run_dir):
    """Three checkpoints; in the newest, a parameter file and an optimizer file have flipped bytes
    and the data item other content; the one before has a truncated file. `verify` names what is
    damaged, `list` marks both CORRUPT, and a resume restores the oldest, intact step, saying which
    arrays failed, and trains on from it."""
    _train(run_dir, "r", "steps=6", "checkpoint_period=2")
    root = f"{run_dir}/r/checkpoints"
    before = {(s, item): ck.load_numpy(root, item, step=s) for s in (4, 6) for item in ("params", "optimizer")}
    flip(largest_data_file(f"{root}/6", "params"), 64)
    flip(largest_data_file(f"{root}/6", "optimizer"), 64)
    with open(f"{root}/6/data/metadata") as f:
        position = json.load(f)
    position["position"]["step"] += 1
    with open(f"{root}/6/data/metadata", "w") as f:
        json.dump(position, f)
    truncated = largest_data_file(f"{root}/4", "params")
    with open(truncated, "r+b") as f:
        f.truncate(os.path.getsize(truncated) // 2)
    want6 = changed(root, 6, "params", before[6, "params"]) | changed(root, 6, "optimizer", before[6, "optimizer"])
    assert any(n.startswith("params/") for n in want6) and any(n.startswith("optimizer/") for n in want6)
    shutil.copytree(f"{run_dir}/r", f"{run_dir}/copy")  # verify the copy; resume the original

    codes, outs = run_module("maxlite.checkpoints", ["verify", f"{run_dir}/copy/checkpoints"], devices=1)
    lines = dict(line.split(": ", 1) for line in outs[0].strip().splitlines() if line.startswith("step "))
    assert codes == [1], outs[0][-3000:]
    assert lines["step 2"].startswith("intact")
    assert lines["step 4"].startswith("CORRUPT: params/") and "OUT_OF_RANGE" in lines["step 4"]
    named6 = {part.split(" (")[0] for part in lines["step 6"].removeprefix("CORRUPT: ").split("; ")}
    assert named6 == want6 | {"data"}
    codes, outs = run_module("maxlite.checkpoints", ["list", f"{run_dir}/copy/checkpoints"], devices=1)
    rows = outs[0].strip().splitlines()
    assert [("CORRUPT" in r) for r in rows] == [False, True, True], outs[0]

    damaged6 = _files(f"{root}/6")
    out = _train(run_dir, "r", "steps=8", "checkpoint_period=2")[0]
    st = _status(run_dir, "r")
    assert st["state"] == "finished" and st["step"] == 8
    resumed = st["resumed_from"]
    assert (resumed["step"], resumed["source"]) == (2, "checkpoint")
    found = {c["step"]: set(c["damaged"]) for c in resumed["corrupt"]}
    assert found[6] == want6 | {"data"} and found.keys() == {4, 6}
    assert all(n.startswith("params/") for n in found[4])
    assert sum("is corrupt:" in line for line in out.splitlines()) == 2  # one line per damaged step
    assert ck.complete_steps(root) == [2, 4, 6, 8]  # 4 and 6 saved again, intact
    codes, outs = run_module("maxlite.checkpoints", ["verify", root], devices=1)
    assert codes == [0] and outs[0].count(": intact") == 4, outs[0][-2000:]
    # the damaged ones were kept aside, renamed (the damage could have been in the checksum record
    # alone): listed as such, with their bytes as they were, and removed only by the command
    aside = {r["step"]: r for r in ck.list_checkpoints(root) if r.get("aside")}
    assert aside.keys() == {4, 6} and all(r["corrupt"]["found_by"] == "resume" for r in aside.values())
    assert _files(f"{root}/{aside[6]['dir']}") == damaged6  # as it was found, byte for byte
    codes, outs = run_module("maxlite.checkpoints", ["list", root], devices=1)
    assert sum("KEPT ASIDE" in r for r in outs[0].splitlines()) == 2, outs[0]
    codes, outs = run_module("maxlite.checkpoints", ["remove-corrupt", root], devices=1)
    assert codes == [0] and not any(r.get("aside") for r in ck.list_checkpoints(root)), outs[0]
    assert ck.complete_steps(root) == [2, 4, 6, 8]


def test_checkpoints_without_checksums_restore_unverified_and_a_dtype_change_is_checked_as_saved(tmp_path, capsys):
    """A checkpoint written before checksums restores as it did (list and verify say so); a run
    restoring in another weight_dtype checks the bytes as saved, then casts."""
    cfg, state, data = _trained(tmp_path, ["async_checkpointing=false"], steps=1, **ONE)
    old = Checkpointer(cfg, True, state_lib.nbytes(state), checksums=False)
    assert old.save(2, state, data)
    old.close()
    _, restored, _, c = _start(tmp_path, ["run_name=src", *ONE["mesh"]], 1)
    restored = restored.state  # where the run starts (maxlite.resume.Start)
    c.close()
    assert int(restored.step) == 1
    capsys.readouterr()
    assert ck.main(["list", old.path]) == 0 and "complete (no checksums: written before them)" in capsys.readouterr().out
    assert ck.main(["verify", old.path]) == 0 and "step 2: not verified" in capsys.readouterr().out
    saver = Checkpointer(cfg, True, state_lib.nbytes(state))
    assert saver.save(4, state, data)
    saver.close()
    _, bf16, _, c = _start(tmp_path, ["run_name=src", "weight_dtype=bfloat16", *ONE["mesh"]], 1)
    bf16 = bf16.state  # where the run starts (maxlite.resume.Start)
    c.close()
    assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(bf16.params))
    assert ck.complete_steps(saver.path) == [2, 4] and not ck.checksums.marked(saver.path)  # 4 verified as saved
    assert all(np.array_equal(np.asarray(a), np.asarray(b).astype(a.dtype))
               for a, b in zip(jax.tree.leaves(bf16.params), jax.tree.leaves(state.params)))


def test_a_checkpoint_is_read_twice_before_it_is_called_corrupt(tmp_path, monkeypatch):
    """One bad read (the storage returned wrong bytes once; injected here) does not cost a good
    checkpoint: the second read passes, the run starts from it and nothing is marked."""
    from maxlite import resume

    cfg, state, data = _trained(tmp_path, ["async_checkpointing=false"], steps=1, **ONE)
    saver = Checkpointer(cfg, True, state_lib.nbytes(state))
    for step in (1, 2):
        assert saver.save(step, state, data)
    saver.close()
    real, calls = resume._restore_full, []

    def once_bad(root, step, *args):
        calls.append(step)
        if len(calls) == 1:
            raise ck.CheckpointCorrupt(f"{root}/{step}", ["params/embedding"], "checksum mismatch")
        return real(root, step, *args)
    monkeypatch.setattr(resume, "_restore_full", once_bad)
    _, restored, _, c = _start(tmp_path, ["run_name=src", *ONE["mesh"]], 1)
    restored = restored.state  # where the run starts (maxlite.resume.Start)
    c.close()
    assert calls == [2, 2] and ck.complete_steps(saver.path) == [1, 2] and not ck.checksums.marked(saver.path)
    assert all(np.array_equal(a, b) for a, b in zip(_host(restored), _host(state)))


def test_a_corrupt_marker_that_cannot_be_written_is_said(tmp_path, capsys):
    """The marker is best effort (the storage may refuse it); a refusal is said, not swallowed."""
    err = ck.CheckpointCorrupt(f"{tmp_path}/7", ["params/w"])
    ck.checksums.mark(str(tmp_path), 7, err, by="resume")  # no step 7 here: the write fails
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"maxlite: warning: could not mark checkpoint step 7 in {tmp_path} corrupt")
    assert ck.checksums.marker(str(tmp_path), 7) is None
