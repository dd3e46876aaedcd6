"""Metric sinks: W&B (offline files read back), MLflow (a local file store read back with its client),
TensorBoard (EventAccumulator), all against metrics.jsonl of one real run and its resumed attempt;
a failing optional sink warns once and training goes on."""

import glob
import json
import os
import struct
import sys

import pytest

from maxlite import config as C
from maxlite.train import train
from tests.helpers import SMALL

wandb = pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")


def read_wandb_records(path: str) -> list:
    """Every protobuf Record of a `.wandb` transaction log: a 7-byte W&B header (':W&B', magic
    0xBEE1, version), then LevelDB log framing (32 KiB blocks; 7-byte chunk headers: crc32c,
    length, type FULL/FIRST/MIDDLE/LAST)."""
    import wandb
    from wandb.proto import wandb_internal_pb2 as pb

    # W&B's service process writes this file; run.finish() can return before it has flushed the file
    # (CI once read a log without its run record). teardown() waits for the service to exit.
    wandb.teardown()
    data = open(path, "rb").read()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1
    records, pos, parts, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is zero padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def wandb_history(records) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            out.setdefault(int(items["_step"]), {}).update(items)
    return out


def jsonl(run_dir):
    return [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]


def test_wandb_mlflow_tensorboard_match_metrics_jsonl_across_a_resume(tmp_path, capsys):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    argv = [*SMALL, "enable_tensorboard=true", "run_name=obs", f"base_output_directory={tmp_path}",
            "eval_interval=2", "eval_steps=1", "checkpoint_period=0", "straggler_report_interval=0",
            "loggers=[wandb, mlflow]", "wandb_mode=offline", "wandb_project=maxlite-test"]
    train(C.load([*argv, "steps=4"]))
    train(C.load([*argv, "steps=6"]))  # resumes from the final checkpoint at step 4
    run_dir = f"{tmp_path}/obs"
    records = jsonl(run_dir)
    steps = {r["step"]: r for r in records if "loss" in r}
    evals = {r["step"]: r for r in records if "eval_loss" in r}
    assert sorted(steps) == [1, 2, 3, 4, 5, 6] and sorted(evals) == [2, 4, 6]
    assert "straggler_relative_score" in steps[6] and "goodput" in steps[6]
    err = capsys.readouterr().err
    assert "logging is off" not in err, err

    # W&B: both attempts log into one run (the id kept in the run dir), offline files under it
    run_id = open(f"{run_dir}/wandb_id.txt").read().strip()
    files = sorted(glob.glob(f"{run_dir}/wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.endswith(f"run-{run_id}.wandb") for f in files)
    history: dict[int, dict] = {}
    for f in files:
        recs = read_wandb_records(f)
        runs = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
        assert runs[0].run_id == run_id and runs[0].display_name == "obs" and runs[0].project == "maxlite-test"
        config = {i.key: json.loads(i.value_json) for i in runs[0].config.update}  # logged once, at init
        assert config["run_name"] == "obs" and config["eval_interval"] == 2 and config["loggers"] == ["wandb", "mlflow"]
        for step, items in wandb_history(recs).items():
            history.setdefault(step, {}).update(items)
    assert [s for s in sorted(history) if "train/loss" in history[s]] == [1, 2, 3, 4, 5, 6]
    for s, r in steps.items():
        assert history[s]["train/loss"] == pytest.approx(r["loss"], rel=1e-6)
        assert history[s]["train/learning_rate"] == pytest.approx(r["learning_rate"], rel=1e-6)
        assert history[s]["goodput/goodput"] == pytest.approx(r["goodput"], rel=1e-6)
    for s, r in evals.items():
        assert history[s]["eval/loss"] == pytest.approx(r["eval_loss"], rel=1e-6)

    # MLflow: one run across both attempts, params, metrics, the config artifact
    client = MlflowClient(tracking_uri=f"{run_dir}/mlruns")
    mlflow_id = open(f"{run_dir}/mlflow_run_id.txt").read().strip()
    run = client.get_run(mlflow_id)
    assert run.info.run_name == "obs" and run.info.status == "FINISHED"
    assert run.data.params["eval_interval"] == "2" and run.data.params["steps"] == "4"  # first attempt's
    loss = {m.step: m.value for m in client.get_metric_history(mlflow_id, "train/loss")}
    assert loss == pytest.approx({s: r["loss"] for s, r in steps.items()}, rel=1e-6)
    eval_loss = {m.step: m.value for m in client.get_metric_history(mlflow_id, "eval/loss")}
    assert eval_loss == pytest.approx({s: r["eval_loss"] for s, r in evals.items()}, rel=1e-6)
    art = client.download_artifacts(mlflow_id, "config.yml", str(tmp_path))
    assert C.load([*argv, "steps=6"]).eval_interval == 2 and "steps: 6" in open(art).read()  # the latest attempt's

    # TensorBoard: config text + hparams, train, eval, goodput and straggler scalars
    acc = EventAccumulator(f"{run_dir}/tensorboard", size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    assert {"train/loss", "eval/loss", "goodput/goodput", "straggler/relative_score",
            "train/learning_rate"} <= set(tags["scalars"])
    tb_loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert tb_loss == pytest.approx({s: r["loss"] for s, r in steps.items()}, rel=1e-6)
    assert {e.step for e in acc.Scalars("eval/loss")} == set(evals)
    text = [t for t in tags["tensors"] if t.startswith("config")]
    assert text and b"run_name: obs" in acc.Tensors(text[0])[0].tensor_proto.string_val[0]
    start = plugin_data_pb2.HParamsPluginData.FromString(
        acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["run_name"].string_value == "obs" and start.hparams["eval_interval"].number_value == 2


def test_a_failing_logger_warns_once_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """No network for MLflow mid-run, W&B not installed: one line each; JSONL keeps every record."""
    from maxlite.loggers.mlflow_sink import MlflowSink
    from maxlite.metrics import MetricsLogger

    def no_network(self, record, group):
        raise ConnectionError("HTTPConnectionPool(host='mlflow.example', port=443): Max retries exceeded\nmore")

    monkeypatch.setattr(MlflowSink, "write", no_network)
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    cfg = C.load([*SMALL, "run_name=f", f"base_output_directory={tmp_path}", "loggers=[wandb, mlflow]",
                  "wandb_mode=offline", "log_period=100"])
    os.makedirs(cfg.run_dir)
    logger = MetricsLogger(C.resolve(cfg, 8), cfg.run_dir, primary=True)
    for step in (1, 2, 3):
        logger.log_step(step, 0.5, {"loss": 5.0 - step, "total_weights": 16.0})
    logger.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "maxlite: warning: wandb logging is off for this run (wandb is not installed "
        "(pip install 'maxlite[wandb]')); training goes on",
        "maxlite: warning: mlflow logging is off for this run (ConnectionError: "
        "HTTPConnectionPool(host='mlflow.example', port=443): Max retries exceeded); training goes on"]
    assert [r["loss"] for r in jsonl(cfg.run_dir)] == [4.0, 3.0, 2.0]


@pytest.fixture
def fresh_wandb():
    """W&B reads its environment once per process (wandb.setup); each of these tests is a new process's view."""
    wandb.teardown()
    yield
    wandb.teardown()


def _log_three_steps(argv):
    """A MetricsLogger of this recipe (its sinks as a run builds them) logging steps 1-3."""
    from maxlite.metrics import MetricsLogger

    cfg = C.load(argv)
    os.makedirs(cfg.run_dir, exist_ok=True)
    logger = MetricsLogger(C.resolve(cfg, 8), cfg.run_dir, primary=True)
    for step in (1, 2, 3):
        logger.log_step(step, 0.5, {"loss": 5.0 - step, "total_weights": 16.0})
    logger.close()
    return cfg


def _wandb_run(wandb_dir):
    """(run record, history) of the one offline W&B run under `wandb_dir`."""
    (path,) = glob.glob(f"{wandb_dir}/wandb/offline-run-*/run-*.wandb")
    records = read_wandb_records(path)
    return next(r.run for r in records if r.WhichOneof("record_type") == "run"), wandb_history(records)


def test_wandb_and_mlflow_follow_their_environment_variables(tmp_path, monkeypatch, fresh_wandb, capsys):
    """As cluster manifests and Slurm scripts set them, with no key in the recipe: W&B's mode, project,
    group and directory, MLflow's tracking URI and experiment."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")  # with the old default (online) this needed an API key
    monkeypatch.setenv("WANDB_PROJECT", "env-project")
    monkeypatch.setenv("WANDB_RUN_GROUP", "env-group")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-files"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "store"))
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "env-experiment")
    cfg = _log_three_steps([*SMALL, "run_name=env", f"base_output_directory={tmp_path}/runs",
                            "loggers=[wandb, mlflow]"])
    assert "logging is off" not in capsys.readouterr().err

    run, history = _wandb_run(tmp_path / "wandb-files")
    assert (run.project, run.run_group, run.display_name) == ("env-project", "env-group", "env")
    assert {s: h["train/loss"] for s, h in history.items() if "train/loss" in h} == {1: 4.0, 2: 3.0, 3: 2.0}
    assert not os.path.exists(f"{cfg.run_dir}/wandb")

    client = MlflowClient(tracking_uri=str(tmp_path / "store"))
    experiment = client.get_experiment_by_name("env-experiment")
    (mlrun,) = client.search_runs([experiment.experiment_id])
    assert mlrun.info.run_name == "env" and mlrun.data.metrics["train/loss"] == 2.0
    assert not os.path.exists(f"{cfg.run_dir}/mlruns")


def test_a_key_the_recipe_sets_overrides_the_environment(tmp_path, monkeypatch, fresh_wandb):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_PROJECT", "env-project")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "env-store"))
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "env-experiment")
    cfg = _log_three_steps([*SMALL, "run_name=keys", f"base_output_directory={tmp_path}/runs",
                            "loggers=[wandb, mlflow]", "wandb_mode=offline", "wandb_project=key-project",
                            "wandb_group=key-group", f"mlflow_tracking_uri={tmp_path}/key-store",
                            "mlflow_experiment=key-experiment"])
    run, _ = _wandb_run(cfg.run_dir)  # no WANDB_DIR, no wandb_dir: the run directory
    assert (run.project, run.run_group) == ("key-project", "key-group")
    client = MlflowClient(tracking_uri=str(tmp_path / "key-store"))
    (mlrun,) = client.search_runs([client.get_experiment_by_name("key-experiment").experiment_id])
    assert mlrun.info.run_name == "keys"
    assert not os.path.exists(tmp_path / "env-store")


def test_without_keys_or_variables_the_libraries_defaults_and_the_run_directory(tmp_path, monkeypatch, fresh_wandb):
    """No group, W&B's default project (outside a git checkout: "uncategorized"; inside one it names
    the project after the checkout, so the test leaves ours), MLflow's Default experiment; the files
    in the run directory as before."""
    from mlflow.tracking import MlflowClient

    for name in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_RUN_GROUP", "WANDB_DIR", "WANDB_ENTITY",
                 "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "lab_notes").mkdir()
    monkeypatch.chdir(tmp_path / "lab_notes")  # not the checkout: a clone named maxlite gave W&B "maxlite"
    cfg = _log_three_steps([*SMALL, "run_name=plain", f"base_output_directory={tmp_path}/runs",
                            "loggers=[wandb, mlflow]", "wandb_mode=offline"])
    run, _ = _wandb_run(cfg.run_dir)
    assert run.run_group == "" and run.project == "uncategorized"
    client = MlflowClient(tracking_uri=f"{cfg.run_dir}/mlruns")
    (mlrun,) = client.search_runs([client.get_experiment_by_name("Default").experiment_id])
    assert mlrun.info.run_name == "plain"


def test_the_tensorboard_sink_starts_without_importing_torch_or_the_gcs_client(tmp_path):
    """tensorboardX's writer imports torch when it is installed (1.2 CPU-seconds of a run's start, for
    tensors this sink never writes) and its record writer google-cloud-storage (0.44 CPU-seconds, for
    gs:// only): a local run's sink imports tensorboardX without either, and both still import after;
    a gs:// run directory's keeps the GCS client tensorboardX writes through."""
    import subprocess

    script = ("import sys\n"
              "from maxlite.loggers.tensorboard_sink import TensorBoardSink, _summary_writer\n"
              f"sink = TensorBoardSink({str(tmp_path)!r})\n"
              "sink.write({'step': 1, 'loss': 2.5}, 'train'); sink.close()\n"
              "print('torch' in sys.modules, 'google.cloud.storage' in sys.modules)\n"
              "import torch; print(torch.ones(1).item())\n"
              "from google.cloud import storage; print(storage.Blob.__name__)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False", "1.0", "Blob"]
    assert glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))

    script = ("from maxlite.loggers.tensorboard_sink import _summary_writer\n"
              "_summary_writer('gs://bucket/runs/r')\n"
              "from tensorboardX import record_writer; print(record_writer.GCS_ENABLED)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True"]
