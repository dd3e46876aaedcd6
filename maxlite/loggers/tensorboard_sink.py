"""TensorBoard event files (tensorboardX: no TensorFlow): scalars per group, the config as text and
as hparams (the HPARAMS tab lists the run with its scalar keys)."""

from __future__ import annotations

from typing import Any

from maxlite.loggers import Sink, scalars


def _summary_writer(run_dir: str):
    """tensorboardX's SummaryWriter, imported without what this run does not use: its writer module
    imports torch (when installed) only to accept torch tensors, 1.2 CPU-seconds of every run's
    start (this sink writes floats); its record writer imports google-cloud-storage, 0.44 CPU-seconds,
    which only a gs:// run directory writes through. A module already imported stays as it is."""
    import sys

    unused = ["torch"] + ([] if run_dir.startswith("gs://") else ["google.cloud.storage"])
    block = [name for name in unused if name not in sys.modules]
    for name in block:
        sys.modules[name] = None  # its import raises ImportError, which tensorboardX handles
    try:
        from tensorboardX import SummaryWriter
    finally:
        for name in block:
            del sys.modules[name]
    return SummaryWriter


class TensorBoardSink(Sink):
    name = "tensorboard"

    def __init__(self, run_dir: str):
        SummaryWriter = _summary_writer(run_dir)
        self.writer = SummaryWriter(f"{run_dir}/tensorboard", flush_secs=10)

    def start(self, cfg) -> None:
        from tensorboardX.summary import hparams

        from maxlite import config as C

        self.writer.add_text("config", "```\n" + C.to_yaml(cfg) + "```", 0)  # markdown: keep it verbatim
        flat = {k: v for k, v in C.to_plain_dict(cfg).items() if isinstance(v, (int, float, str, bool))}
        for summary in hparams(flat, {"train/loss": 0.0, "eval/loss": 0.0}):
            self.writer.file_writer.add_summary(summary)

    def write(self, record: dict[str, Any], group: str) -> None:
        for tag, value in scalars(record, group).items():
            self.writer.add_scalar(tag, value, record["step"])

    def finish(self, summary: dict[str, Any]) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
