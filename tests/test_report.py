"""`python -m maxlite.report`: PNG + one self-contained HTML page from run directories, several runs
overlaid; rendered in headless Chromium when it is installed (the screenshot must show both curves)."""

import base64
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from maxlite import config as C, report

BLUE, ORANGE = (31, 119, 180), (255, 127, 14)  # matplotlib's first two line colours: run 1, run 2


def fake_run(base, name, losses, summary):
    """A run directory as the loop leaves it: config.yml, metrics.jsonl (train + eval + summary), status."""
    path = os.path.join(base, name)
    os.makedirs(path)
    cfg = C.load(["base.yml", f"run_name={name}", f"base_output_directory={base}", "ici_fsdp_parallelism=2"])
    open(os.path.join(path, "config.yml"), "w").write(C.to_yaml(cfg))
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for step, loss in enumerate(losses, 1):
            f.write(json.dumps({"step": step, "seconds": 0.5, "tflops_per_device": 0.25 * step,
                                "tokens_per_second_per_device": 1000.0 * step, "loss": loss,
                                "learning_rate": 1e-3 * step, "goodput": 0.1 * step, "total_weights": 16}) + "\n")
            if step % 2 == 0:
                f.write(json.dumps({"step": step, "eval_loss": loss + 0.5, "eval_perplexity": 9.0}) + "\n")
        f.write(json.dumps({"summary": summary}) + "\n")
    json.dump({"state": "finished", "step": len(losses)}, open(os.path.join(path, "status.json"), "w"))
    return path


def test_report_png_html_overlaid_and_seen_in_a_browser(tmp_path, capsys):
    a = fake_run(str(tmp_path), "run_a", [6.0, 5.0, 4.5, 4.0],
                 {"steps": 4, "final_loss": 4.0, "tokens_per_second": 12345.0, "mfu": 0.125,
                  "peak_tflops_per_device": 4.0, "goodput": 0.875})
    b = fake_run(str(tmp_path), "run_b", [6.5, 5.5, 5.0, 4.75],
                 {"steps": 4, "final_loss": 4.75, "tokens_per_second": 23456.0, "goodput": 0.625})
    out = str(tmp_path / "cmp")
    assert report.main([a, b, "--out", out]) == 0
    png = open(f"{out}/report.png", "rb").read()
    page = open(f"{out}/report.html").read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    inlined = re.search(r'src="data:image/png;base64,([^"]+)"', page).group(1)
    assert base64.b64decode(inlined) == png  # self-contained: the picture is in the page
    table = page[page.index('<table id="summary">'):page.index("</table>")]
    for name, summary in (("run_a", [4, 4.0, 12345, 0.125, 0.875]), ("run_b", [4, 4.75, 23456, 0.625])):
        row = table[table.index(f"<td>{name}</td>"):]
        row = row[:row.index("</tr>")]
        assert [float(x) for x in re.findall(r"<td>([\d.]+)</td>", row)] == summary
    assert "run_name: run_a" in page and "run_name: run_b" in page  # both configs

    # the loop's end-of-run call writes into the run directory; an unreadable directory is one line
    report.at_end(C.load(["base.yml", "run_name=run_a", f"base_output_directory={tmp_path}"]), primary=True)
    assert os.path.exists(f"{a}/report.html") and os.path.exists(f"{a}/report.png")
    assert report.main([str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.strip() == f"maxlite: error: {tmp_path}/nowhere: no metrics.jsonl (is it a maxlite run directory?)"

    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no chromium on this machine: the page was not rendered")
    shot = os.environ.get("MAXLITE_REPORT_SCREENSHOT") or str(tmp_path / "shot.png")  # to look at it
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--screenshot={shot}", "--window-size=1280,1100", f"file://{out}/report.html"],
                   check=True, capture_output=True, timeout=120)
    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(int)

    def count(colour):
        return int((np.abs(pixels - np.array(colour)).max(axis=-1) < 40).sum())
    assert count(BLUE) > 500 and count(ORANGE) > 500  # both runs' curves drawn in the browser


def test_no_matplotlib_costs_one_line_not_the_run(tmp_path, monkeypatch, capsys):
    fake_run(str(tmp_path), "r", [5.0, 4.0], {"steps": 2, "final_loss": 4.0})
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    report.at_end(C.load(["base.yml", "run_name=r", f"base_output_directory={tmp_path}"]), primary=True)
    assert capsys.readouterr().out == "maxlite: no run report: matplotlib is not installed (pip install matplotlib)\n"
    assert not os.path.exists(f"{tmp_path}/r/report.html")
