"""The planner's calibration table → maxlite/plan/calibration.json (the factor the planner applies).

    python benchmarks/plan_calibration.py            # rows from the plans in benchmarks/results
    python benchmarks/plan_calibration.py --markdown # and the table docs/plan.md shows

One row per figure MaxText publishes for a recipe the planner compiles: MaxText's measured step,
or the step its published tokens/s or TFLOP/s imply for the same batch and FLOP formula; the
planner's estimate of that recipe, read from the plan's JSON in benchmarks/results (each JSON holds
the command that compiled it); measured ÷ estimated. The factor (maxlite/plan/calibration.py) is the
geometric mean of the ratios; a row is left out only with its reason, a fault of the estimate
that is open in the issues.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from maxlite.plan import calibration  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TILES = "AI-Hypercomputer/maxtext docs/reference/models/tiering.md"

# MaxText's figure for each recipe, where it is published, and where our plan of it lies. `figure`:
# ("step_seconds", s) | ("tokens_per_second_per_device", t) | ("tflops_per_chip", f); `estimate`:
# the keys that lead to the plan's estimate inside its JSON.
SOURCES = [
    dict(recipe="Llama 3.1-8B, 3 × 8192", topology="v6e-8", json="plan_llama3.1-8b_v6e-2x4_quantization.json",
         estimate=("modes", "bf16", "estimate"), figure=("step_seconds", 3.416),
         source="AI-Hypercomputer/tpu-recipes training/trillium/Llama3.1-8B-MaxText (v6e-8): its README's log line",
         differs="maxlite's defaults (remat full, splash attention)"),
    dict(recipe="Llama 3.1-8B, 4 × 8192", topology="v6e-256", json="plan_llama3.1-8b_v6e-256_calibration.json",
         estimate=("plan", "estimate"), figure=("tokens_per_second_per_device", 7207),
         source=f"{TILES} (Trillium, Gold: 45.46% MFU, 7,207 tokens/s/device); recipe llama3_1_8b_8192 in "
                "benchmarks/maxtext_trillium_model_configs.py",
         differs="MaxText also offloads the q/k/v/out projections; maxlite recomputes them"),
    dict(recipe="Llama 3.1-70B, 5 × 8192", topology="v6e-256", json="plan_llama3.1-70b_v6e-256_calibration.json",
         estimate=("plan", "estimate"), figure=("step_seconds", 42.656),
         source="AI-Hypercomputer/tpu-recipes training/trillium/Llama3.1-70B-MaxText (tpu-recipes-v0.1.4): its "
                f"README's log line, 462 TFLOP/s/device; {TILES}: 50.33% MFU, 960 tokens/s/device",
         differs="MaxText also offloads the q/k/v projections; maxlite recomputes them"),
    dict(recipe="Llama 3.1-405B, 1 × 8192", topology="2 × v6e-256", json="plan_llama3.1-405b_2x_v6e-256_fsdp_dcn_offload.json",
         estimate=("plan", "estimate"), figure=("step_seconds", 54.803),
         source="AI-Hypercomputer/tpu-recipes training/trillium/Llama3.1-405B-MaxText (tpu-recipes-v0.1.2, "
                "llama3_1_405b_8192_pure_fsdp_ici): its README's log line on 2 × v6e-256",
         differs="none in the keys the planner reads"),
    dict(recipe="Mixtral 8x7B, 12 × 4096, capacity 1.25", topology="v6e-256", json="plan_mixtral-8x7b_v6e-256_calibration.json",
         estimate=("plan", "estimate"), figure=("step_seconds", 13.484),
         source="AI-Hypercomputer/tpu-recipes training/trillium/Mixtral-8x7B-MaxText (tpu-recipes-v0.1.2, "
                f"mixtral_8x7b_dropped): its README's log line, 302.3 TFLOP/s/device; {TILES}: 35.23% MFU",
         differs="MaxText also offloads the q/k/v/out projections; maxlite recomputes them"),
    dict(recipe="Mixtral 8x22B, 8 × 4096, capacity 1.25", topology="v6e-256",
         json="plan_mixtral-8x22b_v6e-256_calibration.json", estimate=("plan", "estimate"),
         figure=("tokens_per_second_per_device", 1326),
         source=f"{TILES} (Trillium, Silver: 36.2% MFU, 1,326 tokens/s/device); recipe mixtral_8x22b_dropped "
                "(fsdp 64 x expert 4) in benchmarks/maxtext_trillium_model_configs.py",
         differs="MaxText also offloads the q/k/v/out projections; maxlite recomputes them"),
    dict(recipe="DeepSeek-V3, 4 × 8192", topology="v5p-1024", json="plan_deepseek-v3_v5p-8x8x8_8192.json",
         estimate=("plan", "estimate"), figure=("tflops_per_chip", 152.4),
         source="MaxText benchmarks/maxtext_v5p_model_configs.py deepseek_v3_ep_256_v5p_512 on v5p-1024: "
                "152.4 TFLOP/s per chip published",
         differs="fsdp 128 × expert 4 (MaxText's expert -1 does not divide 256 experts on 512 chips)"),
    dict(recipe="DeepSeek-V3, 8 × 4096", topology="tpu7x-256", json="plan_deepseek-v3_tpu7x-4x8x8_4096_rings.json",
         estimate=("estimate_vs_maxtext",), figure=("step_seconds", 26.79),
         source="AI-Hypercomputer/tpu-recipes training/ironwood/deepseek3-671b/4k-bf16-tpu7x-4x8x8: "
                "training/ironwood/README.md, 612.66 TFLOP/s per chip",
         differs="mtp_num_layers=0 (MaxText's deepseek3-671b has none)"),
]


def _estimate(src: dict) -> tuple[dict, int]:
    """(the plan's estimate, devices per chip)."""
    node = whole = json.loads((RESULTS / src["json"]).read_text())
    for key in src["estimate"]:
        node = node[key]
    plan = whole.get("plan", {})
    return node, plan.get("num_devices", 1) // plan.get("num_chips", 1)


def _row(src: dict) -> dict:
    e, devices_per_chip = _estimate(src)
    est = e.get("step_seconds", e.get("estimated_step_seconds"))
    kind, value = src["figure"]
    if kind == "step_seconds":
        measured = value
    elif kind == "tokens_per_second_per_device":
        measured = e["tokens_per_second_per_device"] * est / value  # the same tokens per device per step
    else:  # tflops_per_chip: the same FLOP formula (MaxText's) per step
        measured = e["tflops_per_device"] * devices_per_chip * est / value
    row = {"recipe": src["recipe"], "topology": src["topology"], "maxtext_figure": {kind: value},
           "maxtext_step_seconds": measured, "estimated_step_seconds": est, "plan_json": src["json"],
           "source": src["source"], "differs": src["differs"]}
    if src.get("left_out"):
        row["left_out"] = src["left_out"]
    return row


def markdown(rows) -> str:
    lines = ["| recipe | topology | MaxText measured | maxlite estimate | measured ÷ estimate | plan |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        kind, value = next(iter(r["maxtext_figure"].items()))
        given = {"step_seconds": f"{value:g} s", "tokens_per_second_per_device": f"{value:,} tokens/s/device → "
                 f"{r['maxtext_step_seconds']:.2f} s", "tflops_per_chip": f"{value:g} TFLOP/s/chip → "
                 f"{r['maxtext_step_seconds']:.2f} s"}[kind]
        ratio = f"{calibration.ratio(r):.2f}" + (" (left out)" if r.get("left_out") else "")
        lines.append(f"| {r['recipe']} | {r['topology']} | {given} | {r['estimated_step_seconds']:.2f} s | "
                     f"{ratio} | {r['plan_json']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--markdown", action="store_true", help="also print the table docs/plan.md shows")
    args = p.parse_args()
    rows = [_row(s) for s in SOURCES]
    out = {"command": "python benchmarks/plan_calibration.py", "rows": rows}
    calibration.TABLE.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {calibration.TABLE.relative_to(ROOT)}: factor {calibration.factor(tuple(rows)):.3f} over "
          f"{sum(not r.get('left_out') for r in rows)} of {len(rows)} rows")
    if args.markdown:
        print(markdown(rows))


if __name__ == "__main__":
    main()
