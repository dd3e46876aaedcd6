"""Where metric records go: sinks behind one small interface.

JSONL (always) and TensorBoard (`enable_tensorboard`) are built in; `loggers: [wandb, mlflow]` adds
Weights & Biases and MLflow. Only the primary process builds sinks (`metrics.MetricsLogger`).

    start(cfg)               the resolved Config, once per attempt
    write(record, group)     one record: group "train" (a step) or "eval"
    finish(summary)          the run's summary, once at the end
    close()

A sink that is `optional` (W&B, MLflow) and fails — package missing, no network, bad credentials —
is dropped with one warning line and training goes on; JSONL and TensorBoard failures are errors.

W&B and MLflow follow their own conventions: a `wandb_*` / `mlflow_*` key left "" lets the library's
environment variable (WANDB_MODE, WANDB_PROJECT, MLFLOW_TRACKING_URI, ...) or its own default decide;
a key the recipe sets overrides the variable (`setting`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

EXTRA_SINKS = ("wandb", "mlflow")  # the values `loggers` accepts


class Sink:
    name = "sink"
    optional = False

    def start(self, cfg) -> None:
        pass

    def write(self, record: dict[str, Any], group: str) -> None:
        pass

    def finish(self, summary: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def scalars(record: dict[str, Any], group: str) -> dict[str, float]:
    """A record's numbers under the tags every dashboard sink uses: train/loss, eval/loss,
    goodput/goodput, straggler/relative_score ... (`step` is the x axis, not a tag)."""
    out = {}
    for key, value in record.items():
        if key == "step" or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if group == "eval":
            tag = f"eval/{key.removeprefix('eval_')}"
        elif key.startswith("straggler_"):
            tag = f"straggler/{key.removeprefix('straggler_')}"
        elif key == "stragglers":
            tag = "straggler/count"
        elif key.startswith("goodput"):
            tag = f"goodput/{key}"
        else:
            tag = f"train/{key}"
        out[tag] = float(value)
    return out


def setting(key_value: str, variable: str, fallback: str | None = None) -> str | None:
    """A logger setting: the recipe's key when set, else the library's environment variable when set
    (None: the library reads it itself), else `fallback` (None: the library's own default)."""
    if key_value:
        return key_value
    return None if os.environ.get(variable) else fallback


def make_sinks(cfg, run_dir: str) -> list[Sink]:
    """The sinks this config asks for, in order; an optional one that cannot start is left out."""
    from maxlite.loggers.jsonl_sink import JsonlSink

    sinks: list[Sink] = [JsonlSink(run_dir)]
    if cfg.enable_tensorboard and "://" not in run_dir:
        from maxlite.loggers.tensorboard_sink import TensorBoardSink

        sinks.append(TensorBoardSink(run_dir))
    elif cfg.enable_tensorboard:  # the event writer writes local files only: say so rather than skip silently
        print(f"maxlite: TensorBoard off: {run_dir} is not a local directory (metrics.jsonl and the loggers "
              f"record every step; enable_tensorboard=false silences this)", flush=True)
    for name in dict.fromkeys(cfg.loggers):  # each once, in order
        sink = guarded(name, lambda name=name: _extra(name, cfg, run_dir))
        if sink is not None:
            sinks.append(sink)
    return sinks


def _extra(name: str, cfg, run_dir: str) -> Sink:
    if name == "wandb":
        from maxlite.loggers.wandb_sink import WandbSink

        return WandbSink(cfg, run_dir)
    from maxlite.loggers.mlflow_sink import MlflowSink

    return MlflowSink(cfg, run_dir)


def warn(name: str, e: BaseException) -> None:
    """The one line an optional sink's failure costs."""
    if isinstance(e, ImportError):
        why = f"{name} is not installed (pip install 'maxlite[{name}]')"
    else:
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    print(f"maxlite: warning: {name} logging is off for this run ({why}); training goes on",
          file=sys.stderr, flush=True)


def guarded(name: str, make) -> Sink | None:
    try:
        return make()
    except Exception as e:  # noqa: BLE001 — an optional logger never stops training
        warn(name, e)
        return None
