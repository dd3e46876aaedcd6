"""The plan as text for people and as JSON for machines."""

from __future__ import annotations

import collections
import dataclasses
import json

from maxlite.plan.compile import Plan
from maxlite.plan.topology import GIB, Chip


def _gib(x: float | None) -> str:
    if x is None:
        return "?"
    return f"{x / GIB:,.2f} GiB" if abs(x) >= GIB / 10 else f"{x / 2**20:,.2f} MiB"


def _s(x: float) -> str:
    return f"{x:.3f} s" if x >= 0.1 else f"{x * 1e3:.3f} ms"


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:,.2f} {prefix}{unit}"
    return f"{x:,.0f} {unit}"


def _mesh(plan: Plan) -> str:
    axes = " × ".join(f"{a} {n}" for a, n in plan.mesh.items())
    dcn = [f"{a} {n}" for a, n in plan.dcn.items() if n > 1]
    where = f"  (across slices/dcn: {', '.join(dcn)})" if dcn else ""
    return axes + where


def memory_lines(plan: Plan, chip: Chip) -> list[str]:
    lines = [f"  HBM per device     parameters {_gib(plan.param_bytes)}, optimizer state "
             f"{_gib(plan.optimizer_bytes)}, batch {_gib(plan.batch_bytes)}"]
    if plan.fits:
        share = plan.peak_bytes / chip.hbm_bytes
        lines.append(f"                     temporaries at peak {_gib(plan.temp_bytes)} "
                     f"(activations, gradients, gathered weights)")
        lines.append(f"                     peak {_gib(plan.peak_bytes)} of {_gib(chip.hbm_bytes)} "
                     f"{chip.name} HBM ({share:.0%}); headroom {_gib(chip.hbm_bytes - plan.peak_bytes)}")
        if plan.host_bytes:
            lines.append(f"  host memory        {_gib(plan.host_bytes)} per device offloaded (remat_policy="
                         f"{plan.recipe['remat_policy']})")
    else:
        state = plan.state_bytes_total / plan.num_devices
        if plan.peak_bytes is not None:
            lines.append(f"                     compiler needs {_gib(plan.peak_bytes)}, usable "
                         f"{_gib(plan.usable_bytes)}: over by {_gib(plan.over_bytes)}"
                         + (f" ({plan.peak_bytes / plan.usable_bytes:.1f}×)"
                            if plan.peak_bytes and plan.usable_bytes else ""))
        lines.append(f"                     params + gradients + optimizer alone: {_gib(state)} "
                     f"per device ({_si(plan.state_bytes_total, 'B')} in all)")
    return lines


def _attention(r: dict) -> str:
    """The implementation that runs (resolved with the config), and what the recipe asked for."""
    asked = r.get("attention_requested", r["attention"])
    return r["attention"] if asked == r["attention"] else f"{r['attention']} ({asked})"


def _optimizer_dtypes(r: dict) -> str:
    """The first moment's and the gradients' dtypes where they are not the weights' (mu_dtype; grad_dtype
    casts only a float32 weight's gradient)."""
    weights = r["weight_dtype"]
    mu, grads = r.get("mu_dtype", weights), r.get("grad_dtype", weights) if weights == "float32" else weights
    return (f", first moment {mu}" if mu != weights else "") + (f", gradients {grads}" if grads != weights else "")


def text(plan: Plan, chip: Chip, shardings: bool = False) -> str:
    r = plan.recipe
    verdict = "FITS" if plan.fits else ("DOES NOT FIT" if plan.peak_bytes is not None else "NOT COMPILED")
    lines = [f"maxlite plan: {r['model_name']} on {plan.topology}: {verdict}",
             f"  mesh               {_mesh(plan)}",
             f"  batch              {r['global_batch_size']} sequences × {r['max_target_length']} tokens "
             f"(per_device_batch_size={r['per_device_batch_size']:g}, gradient_accumulation_steps="
             f"{r['gradient_accumulation_steps']}); remat_policy={r['remat_policy']}, "
             f"weights {r['weight_dtype']}, compute {r['dtype']}" + _optimizer_dtypes(r)
             + (f", quantization={r['quantization']}" if r.get("quantization") else ""),
             f"  attention          {_attention(r)}; loss over {r['loss_chunks']} sequence chunk(s) "
             f"(num_vocab_tiling={r['num_vocab_tiling']})",
             f"  parameters         {plan.param_count / 1e9:,.3f} B = {_si(plan.param_bytes_total, 'B')}"
             f" ({r['weight_dtype']})"]
    lines += memory_lines(plan, chip)
    per_device = plan.flops_formula / plan.num_devices
    flops = f"  FLOPs per step     {_si(plan.flops_formula, 'FLOP')} (MaxText formula) = " \
            f"{_si(per_device, 'FLOP')} per device"
    if plan.flops_compiler is not None:
        flops += f"; XLA counts {_si(plan.flops_compiler, 'FLOP')} per device (a scanned layer body once)"
    lines.append(flops)
    if plan.custom_calls.get("tpu_custom_call"):  # the others are XLA's own helpers (in --json)
        lines.append(f"  kernels/step       {plan.custom_calls['tpu_custom_call']}× Pallas kernel "
                     f"(splash attention: forward, dQ, dK/dV per layer; remat re-runs the forward); "
                     f"in the HBM term as operands in, results out, no T×T scores")
    if plan.collectives:
        parts = [f"{k} {c['count']}× {_si(c['bytes'], 'B')}" for k, c in plan.collectives.items()
                 if c["count"]]
        lines.append(f"  collectives/step   {', '.join(parts) or 'none'} (per device, loops unrolled)")
    e = plan.estimate
    if e:
        lines.append(f"  ESTIMATE (roofline from {chip.name}'s published peak and bandwidths; a real step is slower)")
        bubble = f" / (1 − bubble {e['bubble_fraction']:.1%})" if e.get("bubble_fraction") else ""
        dcn = f" ({_si(e['dcn_bytes_per_device'], 'B')} per device)" if e.get("dcn_bytes_per_device") else ""
        off = e.get("ici_offloaded_seconds", 0.0)
        work = f"max(compute {_s(e['compute_seconds'])}, HBM {_s(e['memory_seconds'])}){bubble}"
        if off:  # the SparseCores' collectives run beside the TensorCores' work
            work = f"max({work}, ICI on the SparseCores {_s(off)})"
        lines.append(f"                     step ≈ {_s(e['step_seconds'])} = {work} + ICI "
                     f"{_s(e['ici_seconds'] - off)} + DCN {_s(e['dcn_seconds'])}{dcn}; {e['bound']}-bound")
        lines.append(f"                     calibrated ≈ {_s(e['calibrated_step_seconds'])} (× {e['calibration_factor']:.2f}: "
                     f"MaxText's measured steps ÷ the estimates of its recipes, docs/plan.md)")
        if e.get("quantized_flops_per_device"):
            lines.append(f"                     of compute: {_si(e['quantized_flops_per_device'], 'FLOP')} per device "
                         f"in {r['quantization']} projections at {e['quantized_peak_tflops']:,.0f} TFLOP/s, "
                         f"the rest at {chip.peak_tflops:,.0f} (bf16)")
        per_chip = (f" ({e['tflops_per_chip']:,.0f} per chip of {chip.devices_per_chip} devices)"
                    if chip.devices_per_chip > 1 else "")
        lines.append(f"                     MFU ≤ {e['mfu']:.0%}, {e['tflops_per_device']:,.0f} TFLOP/s/device{per_chip}, "
                     f"{e['tokens_per_second_per_device']:,.0f} tokens/s/device")
    if not plan.fits and plan.error:
        lines.append(f"  compiler           {plan.error}")
    if not plan.fits and plan.largest_buffers:
        lines.append("  largest buffers    (the compiler's buffer assignment: an allocation, the values that share it)")
        rows = collections.Counter((b["bytes"], b["shapes"]) for b in plan.largest_buffers)  # alike ones once
        lines += [f"                     {(f'{n} × ' if n > 1 else '') + _gib(size):>14}  {shapes}"
                  for (size, shapes), n in rows.items()]
    if shardings:
        lines.append("  parameter shardings (shape, mesh axes per dim)")
        lines += [f"    {name:32s} {spec}" for name, spec in plan.param_shardings.items()]
    lines.append(f"  compiled in {plan.compile_seconds:.1f} s on this machine, nothing allocated")
    return "\n".join(lines)


def suggestion_lines(suggestions: list[dict]) -> list[str]:
    if not suggestions:
        return []
    lines = ["suggestions (each checked by compiling it):"]
    for s in suggestions:
        mark = "fits" if s["fits"] else ("skipped" if s.get("skipped") else
                                          "not compiled" if s.get("peak_bytes") is None else "does not fit")
        lines.append(f"  [{mark:12s}] {s['change']}: {s['detail']}")
    best = next((s for s in suggestions if s["fits"]), None)
    if best:
        lines.append(f"→ try: {best['command']}")
    else:
        lines.append("→ none of these fits alone; combine them or pick a larger topology")
    return lines


def sweep_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["sweep: meshes × remat policies, pipeline stages × repeats × micro-batches, vocabulary tiles, then "
             "quantization on the fastest (estimated step time; fitting ones ranked first, then why each other was "
             "rejected)",
             f"  {'rank':>4}  {'data':>4} {'stage':>5} {'fsdp':>4} {'context':>7} {'tensor':>6}  {'R×M':>5}  {'remat':9s}  "
             f"{'quant':8s}  {'loss':>4}  {'peak':>10}  {'est. step':>9}  {'MFU≤':>5}  why not"]
    for i, r in enumerate((r for r in rows if not r["skipped"]), 1):
        rank = str(i) if r["fits"] else "-"
        step = _s(r["step_seconds"]) if r["fits"] else "no fit"
        mfu = f"{r['mfu']:.0%}" if r["fits"] else ""
        m, pipe = r["mesh"], r.get("pipeline")
        schedule = f"{pipe['repeats']}×{pipe['microbatches']}" if pipe else "-"
        lines.append(f"  {rank:>4}  {m['data']:>4} {m.get('stage', 1):>5} {m['fsdp']:>4} {m.get('context', 1):>7} "
                     f"{m['tensor']:>6}  {schedule:>5}  {r['remat_policy']:9s}  {r['quantization'] or '-':8s}  "
                     f"{r.get('loss_chunks') or '':>4}  {_gib(r['peak_bytes']):>10}  {step:>9}  {mfu:>5}  {r.get('why', '')}")
    refused = [r for r in rows if r["skipped"]]
    if refused:
        lines.append(f"  not compiled ({len(refused)}: the recipe refuses the layout):")
        lines += [f"    {' '.join(r['overrides'])}: {r['why']}" for r in refused]
    return lines


def to_json(plan: Plan, suggestions: list[dict] | None = None, sweep: list[dict] | None = None) -> str:
    out = {"plan": dataclasses.asdict(plan), "over_bytes": plan.over_bytes}
    if suggestions is not None:
        out["suggestions"] = suggestions
    if sweep is not None:
        out["sweep"] = sweep
    return json.dumps(out, indent=1)
