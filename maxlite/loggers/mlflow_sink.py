"""MLflow: params (the resolved config), metrics per step, the config as an artifact, the summary.

The tracking URI is `mlflow_tracking_uri` when the recipe sets it, else MLFLOW_TRACKING_URI, else a
file store `{run_dir}/mlruns` (`mlflow ui --backend-store-uri {run_dir}/mlruns`); a local path is
resolved like every maxlite path; http(s)://, databricks, sqlite:/// ... are passed to MLflow as
given. The experiment is `mlflow_experiment`, else MLFLOW_EXPERIMENT_NAME, else MLFLOW_EXPERIMENT_ID,
else MLflow's Default experiment. The MLflow run id is kept in `{run_dir}/mlflow_run_id.txt`: a
resumed maxlite run logs into the same MLflow run.
"""

from __future__ import annotations

import os
import time
from typing import Any

import fsspec

from maxlite import config as C
from maxlite.loggers import Sink, scalars
from maxlite.rundir import write_text

_MAX_PARAMS_PER_BATCH = 100  # MLflow's log_batch limit


def tracking_uri(cfg, run_dir: str) -> str:
    uri = cfg.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"{run_dir}/mlruns"
    if ":" in uri.split("/")[0] or uri.startswith("databricks"):
        return uri  # a scheme: http://, file:, sqlite:///, databricks
    return C.resolve_path(uri)


class MlflowSink(Sink):
    name, optional = "mlflow", True

    def __init__(self, cfg, run_dir: str):
        uri = tracking_uri(cfg, run_dir)
        if "://" not in uri and ":" not in uri.split("/")[0]:
            # a local directory: MLflow 3 keeps its file store only on request
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.id_path = f"{run_dir}/mlflow_run_id.txt"
        self.run_id, self.resumed = self._resume_or_create(cfg)

    def _resume_or_create(self, cfg) -> tuple[str, bool]:
        fs, _, _ = fsspec.get_fs_token_paths(self.id_path)
        if fs.exists(self.id_path):
            with fsspec.open(self.id_path, "r") as f:
                run_id = f.read().strip()
            self.client.update_run(run_id, status="RUNNING")
            return run_id, True
        run_id = self.client.create_run(self._experiment_id(cfg), run_name=cfg.run_name).info.run_id
        write_text(self.id_path, run_id + "\n")
        return run_id, False

    def _experiment_id(self, cfg) -> str:
        """The recipe's experiment, else MLflow's variables', else its Default (created when missing)."""
        name = cfg.mlflow_experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name and os.environ.get("MLFLOW_EXPERIMENT_ID"):
            return os.environ["MLFLOW_EXPERIMENT_ID"]
        from mlflow.entities import Experiment

        name = name or Experiment.DEFAULT_EXPERIMENT_NAME
        experiment = self.client.get_experiment_by_name(name)
        return experiment.experiment_id if experiment is not None else self.client.create_experiment(name)

    def start(self, cfg) -> None:
        from mlflow.entities import Param

        self.client.log_text(self.run_id, C.to_yaml(cfg), "config.yml")
        if self.resumed:
            return  # MLflow refuses to change a logged param; the first attempt's are kept
        params = [Param(k, str(v)[:6000]) for k, v in sorted(C.to_plain_dict(cfg).items())]
        for i in range(0, len(params), _MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + _MAX_PARAMS_PER_BATCH])

    def write(self, record: dict[str, Any], group: str) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(tag, value, now, record["step"])
                                                    for tag, value in scalars(record, group).items()])

    def finish(self, summary: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(summary.get("steps", 0))
        self.client.log_batch(self.run_id, metrics=[
            Metric(f"summary/{k}", float(v), now, step) for k, v in summary.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
