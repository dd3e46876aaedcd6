"""Per-step metrics: MaxText's stdout line, a progress bar, the summary; records go to the sinks in
maxlite/loggers/ (JSONL, TensorBoard, W&B, MLflow)."""

from __future__ import annotations

import sys
from typing import Any

from maxlite.loggers import Sink, make_sinks, warn
from maxlite.models.flops import train_flops_per_step


def step_line(step: int, seconds: float, tflops_per_device: float, tokens_per_device: float,
              total_weights: float, loss: float) -> str:
    """MaxText's per-step line, character for character."""
    return (f"completed step: {step}, seconds: {seconds:.3f}, TFLOP/s/device: {tflops_per_device:.3f}, "
            f"Tokens/s/device: {tokens_per_device:.3f}, total_weights: {int(total_weights)}, "
            f"loss: {loss:.3f}")


class MetricsLogger:
    """Writes what the loop measured; only the primary process prints and writes files."""

    def __init__(self, cfg, run_dir: str, primary: bool, first_step: int = 0):
        self.cfg, self.primary = cfg, primary
        self.flops_per_step = train_flops_per_step(cfg)
        self.tokens_per_step = cfg.tokens_per_step
        self.num_devices = cfg.num_devices
        self.history: list[dict[str, Any]] = []
        self.sinks: list[Sink] = []
        self.bar = None
        if not primary:
            return
        self.sinks = make_sinks(cfg, run_dir)
        self._each("start", cfg)
        if cfg.enable_progress_bar and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.steps, initial=first_step, unit="step", dynamic_ncols=True)

    def log_step(self, step: int, seconds: float, values: dict[str, float]) -> None:
        """`step` is 1-based count of completed steps; `values` already on the host."""
        tflops = self.flops_per_step / self.num_devices / seconds / 1e12
        tokens = self.tokens_per_step / self.num_devices / seconds
        record = {"step": step, "seconds": seconds, "tflops_per_device": tflops,
                  "tokens_per_second_per_device": tokens, **values}
        if not self._record(record, "train"):
            return
        if step % self.cfg.log_period == 0 or step == self.cfg.steps:
            self._print(step_line(step, seconds, tflops, tokens, values["total_weights"], values["loss"]))
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{values['loss']:.3f}")

    def log_eval(self, step: int, values: dict[str, float]) -> None:
        if not self._record({"step": step, **{f"eval_{k}": v for k, v in values.items()}}, "eval"):
            return
        self._print(f"eval at step {step}: " + ", ".join(f"{k}: {v:.4f}" for k, v in values.items()))

    def _record(self, record: dict[str, Any], group: str) -> bool:
        """Keep the record; on the primary also hand it to every sink."""
        self.history.append(record)
        if not self.primary:
            return False
        self._each("write", record, group)
        return True

    def _each(self, method: str, *args) -> None:
        """Call `method` on every sink; an optional sink that fails is dropped with one line."""
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as e:  # noqa: BLE001 — only optional sinks get here without re-raising
                if not sink.optional:
                    raise
                self.sinks.remove(sink)
                warn(sink.name, e)
                try:
                    sink.close()
                except Exception:  # noqa: BLE001 — already reported; it is being dropped
                    pass

    def _print(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def summary(self, wall_seconds: float, peak_tflops: float | None) -> dict[str, Any]:
        """Steady-state figures: the first step of this process (compilation) is left out."""
        steps = [r for r in self.history if "tokens_per_second_per_device" in r]
        steady = steps[1:] if len(steps) > 1 else steps
        out: dict[str, Any] = {"steps": len(steps), "tokens": len(steps) * self.tokens_per_step,
                               "wall_seconds": wall_seconds}
        if steady:
            seconds = sum(r["seconds"] for r in steady)
            out["tokens_per_second"] = len(steady) * self.tokens_per_step / seconds
            out["tokens_per_second_per_device"] = out["tokens_per_second"] / self.num_devices
            out["tflops_per_device"] = len(steady) * self.flops_per_step / self.num_devices / seconds / 1e12
            out["final_loss"] = steps[-1]["loss"]
            if peak_tflops:
                out["peak_tflops_per_device"] = peak_tflops
                out["mfu"] = out["tflops_per_device"] / peak_tflops
        return out

    def print_summary(self, summary: dict[str, Any]) -> None:
        if not self.primary:
            return
        mfu = f"{100 * summary['mfu']:.1f}%" if "mfu" in summary else "n/a"
        lines = [
            "=" * 60,
            f"maxlite summary: {summary['steps']} steps, {summary['tokens']:,} tokens "
            f"in {summary['wall_seconds']:.1f} s",
        ]
        if "tokens_per_second" in summary:
            lines.append(
                f"  mean tokens/s: {summary['tokens_per_second']:,.0f} "
                f"({summary['tokens_per_second_per_device']:,.0f}/device), "
                f"TFLOP/s/device: {summary['tflops_per_device']:.3f}, MFU: {mfu}"
                + (f" of {summary['peak_tflops_per_device']:.2f} TFLOP/s peak"
                   if "peak_tflops_per_device" in summary else ""))
            lines.append(f"  final loss: {summary['final_loss']:.4f}")
        for key in ("goodput", "pipeline"):
            if key in summary:
                lines.append(f"  {key}: {summary[key]}")
        lines.append("=" * 60)
        self._print("\n".join(lines))
        self._each("finish", summary)

    def close(self) -> None:
        self._each("close")
        if self.bar is not None:
            self.bar.close()
        self.sinks, self.bar = [], None

