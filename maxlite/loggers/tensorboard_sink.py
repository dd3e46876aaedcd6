"""TensorBoard event files (tensorboardX: no TensorFlow): scalars per group, the config as text and
as hparams (the HPARAMS tab lists the run with its scalar keys)."""

from __future__ import annotations

from typing import Any

from maxlite.loggers import Sink, scalars


def _summary_writer():
    """tensorboardX's SummaryWriter, imported without torch: its writer module imports torch (when
    installed) only to accept torch tensors, 1.2 CPU-seconds of every run's start; this sink writes floats."""
    import sys

    block = "torch" not in sys.modules
    if block:
        sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX handles
    try:
        from tensorboardX import SummaryWriter
    finally:
        if block:
            del sys.modules["torch"]
    return SummaryWriter


class TensorBoardSink(Sink):
    name = "tensorboard"

    def __init__(self, run_dir: str):
        SummaryWriter = _summary_writer()
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
