"""A run report: `python -m maxlite.report RUN_DIR [RUN_DIR ...] [--out DIR]`.

Reads each run directory's metrics.jsonl, config.yml and status.json and writes `report.png`
(loss, eval loss, learning rate, tokens/s, MFU, goodput over steps; several runs overlaid) and
`report.html`: one self-contained page (the PNG inlined) with each run's summary and config.
Written by the loop at the end of every run (`write_report`) into the run directory. Needs
matplotlib (`pip install matplotlib`); without it the loop prints one line and goes on.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

import fsspec
import yaml

# (title, y label, how to get the value from a record of the run)
PANELS = (
    ("loss", "train loss", lambda r, run: r.get("loss")),
    ("eval loss", "eval loss", lambda r, run: r.get("eval_loss")),
    ("learning rate", "learning rate", lambda r, run: r.get("learning_rate")),
    ("tokens/s", "tokens/s (all devices)",
     lambda r, run: r["tokens_per_second_per_device"] * run.num_devices
     if "tokens_per_second_per_device" in r else None),
    ("MFU", "MFU", lambda r, run: r["tflops_per_device"] / run.peak
     if run.peak and "tflops_per_device" in r else None),
    ("goodput", "goodput", lambda r, run: r.get("goodput")),
)


class ReportError(ValueError):
    """A run directory the report cannot read: one line for the user."""


@dataclass
class Run:
    path: str
    name: str
    records: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)
    status: dict[str, Any] = field(default_factory=dict)
    config: str = ""
    num_devices: int = 1
    peak: float | None = None  # TFLOP/s per device the summary measured MFU against
    profiles: dict[str, list[str]] = field(default_factory=dict)  # maxlite.profiler.files

    def series(self, get) -> tuple[list[int], list[float]]:
        points = [(r["step"], get(r, self)) for r in self.records]
        points = [(s, v) for s, v in points if v is not None]
        return [s for s, _ in points], [v for _, v in points]


def _read(path: str) -> str | None:
    fs, _, _ = fsspec.get_fs_token_paths(path)
    if not fs.exists(path):
        return None
    with fsspec.open(path, "r") as f:
        return f.read()


def load_run(run_dir: str) -> Run:
    """A run directory's records (the last attempt's summary wins), status and config."""
    from maxlite import config as C

    run_dir = C.resolve_path(run_dir).rstrip("/")
    text = _read(f"{run_dir}/metrics.jsonl")
    if text is None:
        raise ReportError(f"{run_dir}: no metrics.jsonl (is it a maxlite run directory?)")
    records, summary = [], {}
    for line in text.splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        if "summary" in item:
            summary = item["summary"]
        elif "step" in item:
            records.append(item)
    by_step: dict[tuple[int, bool], dict] = {}  # a restarted run repeats steps: keep the latest
    for r in records:
        by_step[(r["step"], "loss" in r)] = r
    records = [by_step[k] for k in sorted(by_step)]
    status = json.loads(_read(f"{run_dir}/status.json") or "{}")
    config = _read(f"{run_dir}/config.yml") or ""
    cfg = (yaml.safe_load(config) or {}) if config else {}
    name = cfg.get("run_name") or run_dir.rsplit("/", 1)[-1]
    peak = summary.get("peak_tflops_per_device") or (status.get("summary") or {}).get("peak_tflops_per_device")
    from maxlite import profiler

    return Run(run_dir, name, records, summary or status.get("summary") or {}, status, config,
               _devices(cfg), peak, profiler.files(run_dir))


def _devices(cfg: dict) -> int:
    """Devices of the run from its resolved parallelism (config.yml holds concrete values)."""
    n = 1
    for key, value in cfg.items():
        if key.endswith("_parallelism") and isinstance(value, int) and value > 0:
            n *= value
    return n


def plot(runs: Sequence[Run]) -> bytes:
    """The six panels, every run overlaid, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(13, 7), dpi=90)
    axes = fig.subplots(2, 3)
    for ax, (title, ylabel, get) in zip(axes.flat, PANELS):
        drawn = False
        for run in runs:
            steps, values = run.series(get)
            if values:
                ax.plot(steps, values, marker="o" if len(values) < 30 else None, markersize=3, label=run.name)
                drawn = True
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if drawn:
            if len(runs) > 1:
                ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.07, top=0.96, wspace=0.28, hspace=0.32)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


SUMMARY_KEYS = ("steps", "final_loss", "tokens", "tokens_per_second", "tflops_per_device", "mfu",
                "goodput", "wall_seconds", "exit_code")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return html.escape(str(value))


def _link(path: str, out_dir: str | None) -> str:
    """A link to `path` from a page in `out_dir`: relative when both are local, else as given."""
    import os

    href = path if "://" in path or out_dir is None or "://" in out_dir else os.path.relpath(path, out_dir)
    return f'<a href="{html.escape(href)}">{html.escape(path)}</a>'


def _profiles(runs: Sequence[Run], out_dir: str | None) -> str:
    """Each run's traces (TensorBoard's profile plugin or xprof open them) and memory profiles."""
    items = []
    for r in runs:
        traces, memory = r.profiles.get("traces", []), r.profiles.get("memory", [])
        if traces:
            items.append(f"<li>{html.escape(r.name)}: traces {', '.join(_link(t, out_dir) for t in traces)}; "
                         f"open with <code>tensorboard --logdir {html.escape(r.path)}</code> (Profile tab) or "
                         f"<code>xprof --logdir={html.escape(r.path)}</code></li>")
        if memory:
            items.append(f"<li>{html.escape(r.name)}: device memory when a step ran out of it "
                         f"{', '.join(_link(m, out_dir) for m in memory)}; open with "
                         f"<code>pprof -http=: FILE</code></li>")
    return f"<h2>Profiles</h2><ul>{''.join(items)}</ul>" if items else ""


def page(runs: Sequence[Run], png: bytes, out_dir: str | None = None) -> str:
    """One self-contained HTML page: the plot inlined, a summary table, profiles, each run's config
    (`out_dir`: where the page goes, for relative links)."""
    keys = [k for k in SUMMARY_KEYS if any(k in r.summary for r in runs)]
    head = "".join(f"<th>{html.escape(k)}</th>" for k in ["run", "state", *keys])
    rows = "".join(
        "<tr>" + f"<td>{html.escape(r.name)}</td><td>{html.escape(str(r.status.get('state', '?')))}</td>"
        + "".join(f"<td>{_fmt(r.summary[k]) if k in r.summary else ''}</td>" for k in keys) + "</tr>"
        for r in runs)
    configs = "".join(
        f"<details><summary>config of {html.escape(r.name)} ({html.escape(r.path)})</summary>"
        f"<pre>{html.escape(r.config)}</pre></details>" for r in runs)
    title = "maxlite report: " + ", ".join(r.name for r in runs)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}} td:first-child{{text-align:left}}
img{{max-width:100%}} pre{{background:#f6f6f6;padding:1em}}</style></head>
<body><h1>{html.escape(title)}</h1>
<h2>Summary</h2><table id="summary"><tr>{head}</tr>{rows}</table>
<h2>Curves</h2><img alt="loss, eval loss, learning rate, tokens/s, MFU and goodput over steps"
 src="data:image/png;base64,{base64.b64encode(png).decode()}">
{_profiles(runs, out_dir)}
<h2>Config</h2>{configs}
</body></html>
"""


def write(run_dirs: Sequence[str], out_dir: str | None = None) -> tuple[str, str]:
    """report.png and report.html for these runs into `out_dir` (default: the first run directory);
    returns their paths."""
    from maxlite import config as C
    from maxlite.rundir import write_text

    runs = [load_run(d) for d in run_dirs]
    out = C.resolve_path(out_dir) if out_dir else runs[0].path
    fs, _, _ = fsspec.get_fs_token_paths(out)
    fs.makedirs(out, exist_ok=True)
    png = plot(runs)
    with fsspec.open(f"{out}/report.png", "wb") as f:
        f.write(png)
    write_text(f"{out}/report.html", page(runs, png, out))
    return f"{out}/report.png", f"{out}/report.html"


def at_end(cfg, primary: bool) -> None:
    """The loop's call after a run: the report into the run directory; never fails the run."""
    if not (primary and cfg.write_report):
        return
    try:
        _, page_path = write([cfg.run_dir])
        print(f"maxlite: report → {page_path}", flush=True)
    except ImportError:
        print("maxlite: no run report: matplotlib is not installed (pip install matplotlib)", flush=True)
    except Exception as e:  # noqa: BLE001 — the run itself is done; the report is a courtesy
        print(f"maxlite: warning: no run report ({type(e).__name__}: {e})", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maxlite.report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--out", help="directory for report.png and report.html (default: the first RUN_DIR)")
    args = parser.parse_args(argv)
    try:
        png, page_path = write(args.run_dirs, args.out)
    except ReportError as e:
        print(f"maxlite: error: {e}", file=sys.stderr)
        return 2
    except ImportError:
        print("maxlite: error: the report needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    print(f"{png}\n{page_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
