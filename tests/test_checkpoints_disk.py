"""A checkpoint target too small (real processes, a real tmpfs): before the first save, no room
for one checkpoint is one line and exit 2, too little for the retention a warning; a save that
fills the disk is one line, exit 74, no tracebacks, and the previous checkpoint stays intact."""

from __future__ import annotations

import json
import subprocess

import pytest

from maxlite import checkpoints as ck
from maxlite import outcome
from tests.helpers import run_module

# 2 layers of the tiny preset: a 42 MiB checkpoint (parameters and Adam moments, f32)
ARGS = ["base.yml", "model_name=tiny", "base_num_decoder_layers=2", "per_device_batch_size=1", "max_target_length=32",
        "enable_tensorboard=false", "write_report=false", "steps=9", "checkpoint_period=3", "run_name=d"]


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size_mib) → a fresh tmpfs of that size (root); skipped where mounting is not allowed."""
    mounted = []

    def mount(mib: int) -> str:
        path = tmp_path / f"tmpfs{mib}"
        path.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}): a small disk needs one")
        mounted.append(path)
        return str(path)
    yield mount
    for path in mounted:
        subprocess.run(["umount", str(path)], check=False)


def test_a_full_disk_is_one_line_and_the_previous_checkpoint_stays(tmpfs):
    disk = tmpfs(70)  # room for one 42 MiB checkpoint, not two
    codes, outs = run_module("maxlite.train", [*ARGS, f"base_output_directory={disk}"], devices=1)
    out = outs[0]
    assert codes == [outcome.CHECKPOINT_FAILED], out[-3000:]
    assert "Traceback" not in out and "Event loop is closed" not in out
    warning = [line for line in out.splitlines() if line.startswith("maxlite: warning: ")]
    assert len(warning) == 1 and "only 1 fit: a later save will fail (disk full)" in warning[0]
    failed = [line for line in out.splitlines() if "failed" in line and line.startswith("maxlite: ")]
    assert len(failed) == 1, failed
    assert failed[0].startswith(f"maxlite: checkpoint save at step 6 to {disk}/d/checkpoints failed: ")
    assert "No space left on device" in failed[0] and "the previous checkpoint (step 3) is intact" in failed[0]
    with open(f"{disk}/d/status.json") as f:
        status = json.load(f)
    assert status["state"] == "failed" and [f["step"] for f in status["checkpoint_failures"]] == [6]
    assert ck.complete_steps(f"{disk}/d/checkpoints") == [3]
    assert ck.main(["verify", f"{disk}/d/checkpoints"]) == 0


def test_no_room_for_one_checkpoint_is_refused_before_training(tmpfs):
    disk = tmpfs(30)
    codes, outs = run_module("maxlite.train", [*ARGS, f"base_output_directory={disk}"], devices=1)
    assert codes == [outcome.CONFIG_ERROR], outs[0][-3000:]
    errors = [line for line in outs[0].splitlines() if line.startswith("maxlite: error: ")]
    assert len(errors) == 1 and "Traceback" not in outs[0] and "completed step" not in outs[0]
    assert f"{disk}/d/checkpoints has 0.03 GiB free but one checkpoint of this state takes ~0.04 GiB" in errors[0]
