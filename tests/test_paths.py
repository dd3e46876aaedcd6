"""Every path form a user types works the same: relative (from the working directory), `./x`,
`~/x`, absolute and gs:// — for training, resume, listing, HF export and import, params-only
loads and the Python API. And a run whose saves fail never reports success.

Orbax refuses relative paths inside its background threads, so before paths were resolved where
the config is resolved, a default run (`base_output_directory=runs`) wrote no checkpoint and
finished with exit 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from maxlite import checkpoints as ck, config as C
from maxlite.bridge import hf
from maxlite.train import train
from tests import helpers
from tests.gcs_emulator import gcs_emulator, make_bucket  # noqa: F401
from tests.xla_flags import cpu_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = [*helpers.SMALL, "checkpoint_period=1"]


def _steps_logged(run_dir: str) -> list[int]:
    import fsspec
    with fsspec.open(f"{run_dir}/metrics.jsonl", "r") as f:
        return [json.loads(x)["step"] for x in f.read().splitlines() if '"loss"' in x]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of SMALL trained 2 steps (checkpoints 1 and 2), once for every path form: each form
    resumes its own copy (step 3 saved through the form) and starts a fresh run (`ft`) through it."""
    base = tmp_path_factory.mktemp("trained") / "runs"
    assert train(C.load([*SMALL, f"base_output_directory={base}", "run_name=r", "steps=2"]))["exit_code"] == 0
    return base / "r"


@pytest.mark.parametrize("form", ["relative", "dot", "home", "absolute", "gs"])
def test_train_resume_list_export_import_load_with_each_path_form(form, trained, tmp_path, monkeypatch, request):
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    if form == "gs":
        bucket = make_bucket(request.getfixturevalue("gcs_emulator").url, "paths")
    base = {"relative": "runs", "dot": "./runs", "home": "~/runs", "absolute": str(tmp_path / "abs" / "runs"),
            "gs": f"{bucket}/runs" if form == "gs" else ""}[form]
    where = {"relative": work / "runs", "dot": work / "runs", "home": home / "runs",
             "absolute": tmp_path / "abs" / "runs"}.get(form)
    run = [*SMALL, f"base_output_directory={base}", "run_name=r"]
    import fsspec

    fs, path = fsspec.url_to_fs(C.load(run).run_dir)  # the run's first 2 steps, where the form points
    fs.put(f"{trained}/", path, recursive=True)
    ckpts = f"{base}/r/checkpoints"  # as the user types it
    assert [r["step"] for r in ck.list_checkpoints(ckpts) if r["complete"]] == [1, 2]

    summary = train(C.load([*run, "steps=3"]))
    assert summary["exit_code"] == 0 and summary["steps"] == 1  # resumed: this attempt ran step 3 only
    assert _steps_logged(C.load(run).run_dir)[-1] == 3
    if where is not None:  # step 3's checkpoint is where the user meant, complete
        assert sorted(os.listdir(where / "r" / "checkpoints")) == ["1", "2", "3"]
    with fsspec.open(f"{C.load(run).run_dir}/status.json", "r") as f:
        resumed = json.load(f)["resumed_from"]
    assert (resumed["source"], resumed["step"]) == ("checkpoint", 2)
    assert resumed["where"] == f"{C.load(run).run_dir}/checkpoints/2"  # absolute, whatever was typed
    assert [r["step"] for r in ck.list_checkpoints(ckpts) if r["complete"]][-1] == 3

    # the CLIs, as typed: export to a relative HF dir, import into the same path form, load it
    assert ck.main(["list", ckpts]) == 0
    assert hf.main(["export", ckpts, "hf_out"]) == 0
    assert (work / "hf_out" / "model.safetensors").is_file()
    imported = f"{base}/imported"
    assert hf.main(["import", "hf_out", imported]) == 0
    cfg, params = ck.load_params(imported)  # the Python API with the same path
    _, trained = ck.load_params(ckpts)
    assert np.array_equal(np.asarray(params["embedding"][...]), np.asarray(trained["embedding"][...]))

    # a params-only start from the imported checkpoint, path as typed
    summary = train(C.load([*run, "run_name=ft", "steps=1", f"load_parameters_path={imported}"]))
    assert summary["exit_code"] == 0
    with fsspec.open(f"{C.load([*run, 'run_name=ft']).run_dir}/status.json", "r") as f:
        assert json.load(f)["resumed_from"]["source"] == "params"
    assert [r["step"] for r in ck.list_checkpoints(f"{base}/ft/checkpoints") if r["complete"]] == [1]


def _env() -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(1),
                PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")


def test_default_relative_run_killed_resumes_and_exports_from_the_cli(tmp_path):
    """The issue's own session, in an empty directory with the default base_output_directory and
    the default run_name: the same command run again resumes, and a higher `steps` extends the run."""
    def cli(*args, kill_on=None):
        proc = subprocess.Popen([sys.executable, "-m", *args], cwd=tmp_path, env=_env(), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1)
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if kill_on and kill_on in line:
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(timeout=600)
        return proc.returncode, "".join(lines)

    run = ["maxlite.train", *SMALL, "steps=4"]  # run_name unset: runs/base_tiny (recipe_model)
    code, out = cli(*run, kill_on="saved checkpoint step 2")
    assert code == -signal.SIGKILL, out[-3000:]
    code, out = cli(*run)
    assert code == 0, out[-3000:]
    status = tmp_path / "runs" / "base_tiny" / "status.json"
    resumed = json.load(open(status))["resumed_from"]
    assert (resumed["source"], resumed["step"]) == ("checkpoint", 2)
    assert "Traceback" not in out and "ERROR:absl" not in out
    assert _steps_logged(str(tmp_path / "runs" / "base_tiny"))[-2:] == [3, 4]
    code, out = cli(*run[:-1], "steps=5")  # the finished run, run again for longer: it goes on
    assert code == 0, out[-3000:]
    resumed = json.load(open(status))["resumed_from"]
    assert (resumed["source"], resumed["step"]) == ("checkpoint", 4)
    assert _steps_logged(str(tmp_path / "runs" / "base_tiny"))[-3:] == [3, 4, 5]
    assert os.listdir(tmp_path / "runs") == ["base_tiny"]
    code, out = cli("maxlite.checkpoints", "list", "runs/base_tiny/checkpoints")
    assert code == 0 and "step=5-consumed_samples=5 " in out and "INCOMPLETE" not in out, out
    code, out = cli("maxlite.bridge.hf", "export", "runs/base_tiny/checkpoints", "hf_llama/")
    assert code == 0 and (tmp_path / "hf_llama" / "config.json").is_file(), out
    assert "WARNING" not in out


def test_a_run_whose_saves_all_fail_exits_non_zero(tmp_path, monkeypatch, capsys):
    """Policy continue: training goes on, but the run ends failed (exit 74) and says which saves."""
    def refuse(self, step, args, metrics):
        raise OSError(f"injected: storage refuses step {step}")

    from maxlite.checkpoints.saver import Checkpointer
    monkeypatch.setattr(Checkpointer, "_write", refuse)
    monkeypatch.chdir(tmp_path)
    summary = train(C.load([*SMALL, "steps=2", "run_name=f", "checkpoint_error_policy=continue"]))
    captured = capsys.readouterr()
    assert summary["exit_code"] == 74 and summary["checkpoint_saves_failed"] == 2
    status = json.load(open(tmp_path / "runs" / "f" / "status.json"))
    assert status["state"] == "failed" and status["exit_code"] == 74
    assert [f["step"] for f in status["checkpoint_failures"]] == [1, 2]
    assert "2 checkpoint save(s) failed" in captured.out
    errors = [x for x in captured.err.splitlines() if "checkpoint save(s) failed with no complete save" in x]
    assert len(errors) == 1 and "step(s) 1, 2" in errors[0]


def test_a_later_successful_save_recovers_the_run(tmp_path, monkeypatch):
    from maxlite.checkpoints.saver import Checkpointer
    real = Checkpointer._write

    def flaky(self, step, args, metrics):
        if step == 1:
            raise OSError("injected: a transient storage error")
        return real(self, step, args, metrics)

    monkeypatch.setattr(Checkpointer, "_write", flaky)
    monkeypatch.chdir(tmp_path)
    summary = train(C.load([*SMALL, "steps=2", "run_name=g", "checkpoint_error_policy=continue"]))
    assert summary["exit_code"] == 0 and summary["checkpoint_saves_failed"] == 1
    status = json.load(open(tmp_path / "runs" / "g" / "status.json"))
    assert status["state"] == "finished" and [f["step"] for f in status["checkpoint_failures"]] == [1]
    assert ck.complete_steps(str(tmp_path / "runs" / "g" / "checkpoints")) == [2]
