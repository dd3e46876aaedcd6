"""What would fit (suggestions, each compiled) and which mesh × remat is fastest (the sweep)."""

from __future__ import annotations

import shlex
import sys
from typing import Callable

from maxlite import config as C, quant
from maxlite.plan.compile import Plan, compile_plan, resolve
from maxlite.plan.topology import GIB, Topology, bigger

Progress = Callable[[str], None]
# from the most recomputation to the least memory saved; offloading trades HBM for host memory
SWEEP_REMATS = ("full", "offload_layer_inputs", "save_qkv_proj", "save_dot_except_mlp",
                "save_attn_mlp_proj", "minimal", "save_dots")
# maxlite/quant.py's modes a TPU runs ("" too: a quantized recipe's sweep tries it without)
SWEEP_QUANTIZATIONS = tuple(m for m in quant.MODES if not m or m in quant.modes_for("tpu"))


def stderr_progress(message: str) -> None:
    print(f"maxlite plan: {message}", file=sys.stderr, flush=True)


def command(args: list[str], overrides: list[str], topology: Topology) -> str:
    """The planner command for that change, naming only the keys that differ from the recipe."""
    raw = C.load(args)

    def same(key: str, text: str) -> bool:
        value = getattr(raw, key)
        return text in (str(value), f"{value:g}" if isinstance(value, float) else str(value))

    changed = [item for item in overrides if not same(*item.split("=", 1))]
    keys = {item.split("=", 1)[0] for item in changed}
    args = [a for a in args if a.split("=", 1)[0] not in keys]
    slices = f" --num-slices {topology.num_slices}" if topology.num_slices > 1 else ""
    return shlex.join(["python", "-m", "maxlite.plan", *args, *changed]) + \
        f" --topology {topology.name}{slices}"


def _row(change: str, plan: Plan | None, args, overrides, topology, detail: str = "") -> dict:
    if plan is None:
        return {"change": change, "overrides": overrides, "topology": topology.name,
                "num_slices": topology.num_slices, "fits": False, "skipped": True, "detail": detail,
                "command": command(args, overrides, topology)}
    if plan.fits:
        e = plan.estimate
        detail = (f"peak {plan.peak_bytes / GIB:.2f} GiB per device; est. step {e['step_seconds']:.3f} s, "
                  f"MFU ≤ {e['mfu']:.0%}")
    else:
        detail = f"needs {(plan.peak_bytes or 0) / GIB:.2f} GiB of {(plan.usable_bytes or 0) / GIB:.2f} GiB"
    return {"change": change, "overrides": overrides, "topology": topology.name,
            "num_slices": topology.num_slices, "fits": plan.fits, "skipped": False, "detail": detail,
            "peak_bytes": plan.peak_bytes, "usable_bytes": plan.usable_bytes,
            "step_seconds": plan.estimate.get("step_seconds"), "command": command(args, overrides, topology)}


def _valid(args, topology, overrides) -> str:
    """"" when the recipe resolves on that topology, else why not (one line)."""
    try:
        resolve(args, topology, overrides)
        return ""
    except C.ConfigError as e:
        return str(e)


def _try(change, args, topology, overrides, progress) -> dict:
    why = _valid(args, topology, overrides)
    if why:
        return _row(change, None, args, overrides, topology, f"not possible: {why}")
    where = "" if change.startswith("topology") else f" on {topology.describe()}"
    progress(f"checking {change}{where} ...")
    return _row(change, compile_plan(args, topology, overrides), args, overrides, topology)


def _mesh_overrides(ici: dict, dcn: dict, **changes) -> list[str]:
    values = {C.parallelism_key("ici", a): v for a, v in ici.items()}
    values |= {C.parallelism_key("dcn", a): v for a, v in dcn.items()}
    values |= changes
    return [f"{k}={v}" for k, v in values.items()]


def suggest(args: list[str], topology: Topology, base: Plan, progress: Progress = stderr_progress,
            max_topologies: int = 3) -> list[dict]:
    """When `base` does not fit: more fsdp, full remat, a smaller per-device batch, more chips."""
    cfg = resolve(args, topology)
    out = []
    if base.ici["data"] > 1 or base.ici["tensor"] > 1:
        overrides = _mesh_overrides(base.ici, base.dcn, ici_data_parallelism=1, ici_tensor_parallelism=1,
                                    ici_fsdp_parallelism=-1)
        out.append(_try("more fsdp (all of the slice)", args, topology, overrides, progress))
    else:
        out.append(_row("more fsdp", None, args, [], topology, "already fsdp over the whole slice"))
    if cfg.remat_policy != "full":
        out.append(_try("remat_policy=full", args, topology, ["remat_policy=full"], progress))
    else:
        out.append(_row("remat_policy=full", None, args, [], topology, "already recomputing everything"))
    pdbs, accumulation = cfg.per_device_batch_size, cfg.gradient_accumulation_steps
    for _ in range(3):  # halve the micro-batch, accumulate more to keep the global batch
        pdbs, accumulation = pdbs / 2, accumulation * 2
        overrides = [f"per_device_batch_size={pdbs:g}", f"gradient_accumulation_steps={accumulation}"]
        row = _try(f"per_device_batch_size={pdbs:g} × accumulation {accumulation}", args, topology,
                   overrides, progress)
        if row["skipped"] or row["fits"]:
            break
    out.append(row)
    usable = base.usable_bytes or topology.chip.hbm_bytes
    if any(r["fits"] for r in out):
        max_topologies = 1  # something cheaper already fits: one look at more chips is enough
    tried, too_small = 0, None
    for candidate in bigger(topology):
        if candidate.num_devices * usable < base.state_bytes_total:
            too_small = candidate  # params + gradients + optimizer alone cannot fit: no need to compile
            continue
        if too_small is not None and tried == 0:
            need = base.state_bytes_total / too_small.num_devices / GIB
            out.append(_row(f"topology {too_small.describe()}", None, args, [], too_small,
                            f"params + gradients + optimizer alone need {need:.2f} GiB per device"))
        overrides = _mesh_overrides(base.ici, base.dcn, ici_fsdp_parallelism=-1, dcn_data_parallelism=-1)
        row = _try(f"topology {candidate.describe()}", args, candidate, overrides, progress)
        out.append(row)
        tried += 1
        if row["fits"] or tried >= max_topologies:
            break
    return out


LONG_CONTEXT = 16384  # from this sequence length on the sweep tries splitting it (context 1, 2, 4) too


def sweep_candidates(args: list[str], topology: Topology, remats: tuple[str, ...]) -> list[list[str]]:
    """Meshes within the slice (data × fsdp × context × tensor, tensor up to 8) × remat policies that
    resolve; the context axis stays the recipe's, and from LONG_CONTEXT tokens on also 1, 2 and 4
    (the same batch: per_device_batch_size counts sequences per device whatever splits them)."""
    n = topology.devices_per_slice
    raw = C.load(args)
    contexts = sorted({raw.ici_context_parallelism} | ({1, 2, 4} if raw.max_target_length >= LONG_CONTEXT else set()))
    meshes = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (2, 4)]  # (data, tensor); fsdp fills the rest
    out = []
    for context in contexts:
        for data, tensor in meshes:
            if n % (data * tensor * context) or data * tensor * context > n:
                continue
            for remat in remats:
                overrides = [f"ici_data_parallelism={data}", f"ici_context_parallelism={context}",
                             f"ici_tensor_parallelism={tensor}", "ici_fsdp_parallelism=-1", f"remat_policy={remat}"]
                if not _valid(args, topology, overrides):
                    out.append(overrides)
    return out


PIPELINE_STAGES_IN_SLICE = (2, 4)  # stages the sweep tries inside a slice (and one per slice across slices)
PIPELINE_REPEATS = (1, 2)          # GPipe, and the circular schedule going round twice
PIPELINE_MICROBATCHES = (1, 2, 4)  # micro-batches per pass, as multiples of the stages


def pipeline_candidates(args: list[str], topology: Topology, remat: str,
                        stages_in_slice: tuple[int, ...] = PIPELINE_STAGES_IN_SLICE) -> list[list[str]]:
    """Pipeline layouts × repeats × micro-batch counts that resolve, fsdp filling the rest of the
    slice (the recipe's context kept): one stage per slice across slices (no data parallelism over
    DCN), and `stages_in_slice` stages inside each slice. No stages at all: none."""
    raw = C.load(args)
    layouts = [{"ici_pipeline_parallelism": p} for p in stages_in_slice]
    if topology.num_slices > 1 and stages_in_slice:
        layouts.insert(0, {"ici_pipeline_parallelism": 1, "dcn_pipeline_parallelism": topology.num_slices,
                           "dcn_data_parallelism": 1, "dcn_fsdp_parallelism": 1})
    out = []
    for layout in layouts:
        stages = layout["ici_pipeline_parallelism"] * layout.get("dcn_pipeline_parallelism", 1)
        for repeats in PIPELINE_REPEATS:
            for micro in PIPELINE_MICROBATCHES:
                overrides = [*(f"{k}={v}" for k, v in layout.items()), "ici_data_parallelism=1",
                             f"ici_context_parallelism={raw.ici_context_parallelism}", "ici_tensor_parallelism=1",
                             "ici_fsdp_parallelism=-1", f"num_pipeline_repeats={repeats}",
                             "num_layers_per_pipeline_stage=-1", f"num_pipeline_microbatches={micro * stages}",
                             f"remat_policy={remat}"]
                if not _valid(args, topology, overrides):
                    out.append(overrides)
    return out


def sweep(args: list[str], topology: Topology, remats: tuple[str, ...] = SWEEP_REMATS,
          quantizations: tuple[str, ...] = SWEEP_QUANTIZATIONS, progress: Progress = stderr_progress,
          stages_in_slice: tuple[int, ...] = PIPELINE_STAGES_IN_SLICE) -> list[dict]:
    """Compile every mesh × remat candidate, then the pipeline layouts (pipeline_candidates), then
    each of `quantizations` on the fastest that fits
    (a quantized matmul changes the compute term, not which mesh or policy fits); fitting rows
    ranked by estimated step time, then the rest."""
    def row(overrides: list[str]) -> dict:
        plan = compile_plan(args, topology, overrides)
        return {"mesh": plan.mesh, "remat_policy": plan.recipe["remat_policy"],
                "quantization": plan.recipe["quantization"], "pipeline": plan.recipe["pipeline"], "fits": plan.fits,
                "peak_bytes": plan.peak_bytes, "usable_bytes": plan.usable_bytes,
                "step_seconds": plan.estimate.get("step_seconds"), "mfu": plan.estimate.get("mfu"),
                "overrides": overrides, "command": command(args, overrides, topology)}

    def ranked(rows: list[dict]) -> list[dict]:
        return sorted(rows, key=lambda r: (not r["fits"], r["step_seconds"] or 0.0, (r["peak_bytes"] or 0.0)))

    rows = []
    candidates = sweep_candidates(args, topology, remats)
    for i, overrides in enumerate(candidates, 1):
        progress(f"sweep {i}/{len(candidates)}: {' '.join(overrides)}")
        rows.append(row(overrides))
    # pipeline layouts with the remat policy of the fastest mesh that fits (else full recomputation):
    # stages change the bytes between slices and the bubble, not which policy is fastest
    fastest = ranked(rows)[0] if any(r["fits"] for r in rows) else None
    staged = pipeline_candidates(args, topology, fastest["remat_policy"] if fastest else "full", stages_in_slice)
    for i, overrides in enumerate(staged, 1):
        progress(f"sweep pipeline {i}/{len(staged)}: {' '.join(overrides)}")
        rows.append(row(overrides))
    best = ranked(rows)[0] if any(r["fits"] for r in rows) else None
    for mode in (m for m in quantizations if best is not None and m != best["quantization"]):
        overrides = [*best["overrides"], f"quantization={mode}"]
        progress(f"sweep {overrides[-1]} on the fastest: {' '.join(best['overrides'])}")
        rows.append(row(overrides))
    return ranked(rows)
