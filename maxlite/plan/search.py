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
        detail = _why_not(plan)
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
    """When `base` does not fit: more fsdp, full remat, the layer inputs in host memory, the circular
    schedule's other repeat counts (a pipelined recipe), a smaller per-device batch, more chips."""
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
    if cfg.remat_policy != "offload_layer_inputs":  # MaxText's decoder_layer_input: offload
        out.append(_try("layer inputs in host memory (remat_policy=offload_layer_inputs)", args, topology,
                        ["remat_policy=offload_layer_inputs"], progress))
    stages = cfg.axis_size("stage")
    if stages > 1:  # the circular schedule: fewer layers per iteration hold less
        for repeats in pipeline_repeats(cfg.base_num_decoder_layers, stages):
            if repeats != cfg.pipeline_repeats:
                out.append(_try(f"num_pipeline_repeats={repeats}", args, topology,
                                [f"num_pipeline_repeats={repeats}", "num_layers_per_pipeline_stage=-1"], progress))
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


def sweep_grid(args: list[str], topology: Topology, remats: tuple[str, ...]) -> list[tuple[list[str], str]]:
    """Every mesh within the slice (data × fsdp × context × tensor, tensor up to 8) × remat policy, each
    with "" when the recipe resolves on it, else why not (one line); the context axis stays the
    recipe's, and from LONG_CONTEXT tokens on is also 1, 2 and 4 (the same batch: per_device_batch_size
    counts sequences per device whatever splits them)."""
    n = topology.devices_per_slice
    raw = C.load(args)
    contexts = sorted({raw.ici_context_parallelism} | ({1, 2, 4} if raw.max_target_length >= LONG_CONTEXT else set()))
    meshes = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (2, 4)]  # (data, tensor); fsdp fills the rest
    out = []
    for context in contexts:
        for data, tensor in meshes:
            for remat in remats:
                overrides = [f"ici_data_parallelism={data}", f"ici_context_parallelism={context}",
                             f"ici_tensor_parallelism={tensor}", "ici_fsdp_parallelism=-1", f"remat_policy={remat}"]
                why = (f"data × context × tensor = {data * tensor * context} does not divide the slice's {n} devices"
                       if n % (data * tensor * context) else _valid(args, topology, overrides))
                out.append((overrides, why))
    return out


def sweep_candidates(args: list[str], topology: Topology, remats: tuple[str, ...]) -> list[list[str]]:
    """The meshes × remat policies of `sweep_grid` that resolve."""
    return [overrides for overrides, why in sweep_grid(args, topology, remats) if not why]


PIPELINE_STAGES_IN_SLICE = (2, 4)  # stages the sweep tries inside a slice (and one per slice across slices)
MAX_REPEATS_TRIED = 4               # of the circular schedule's repeat counts (below)
PIPELINE_MICROBATCHES = (1, 2, 4)  # micro-batches per pass, as multiples of the stages


def pipeline_repeats(layers: int, stages: int) -> list[int]:
    """The repeat counts of the circular schedule a person would try, up to layers / stages (one layer
    per stage per repeat: the least held per iteration, the smallest bubble): every one that splits the
    layers evenly when there are at most MAX_REPEATS_TRIED, else 1 (GPipe), the two smallest above
    it and the largest."""
    per_stage = layers // stages if layers % stages == 0 else 0
    counts = [r for r in range(1, per_stage + 1) if per_stage % r == 0] or [1]
    return counts if len(counts) <= MAX_REPEATS_TRIED else [*counts[:3], counts[-1]]


def pipeline_grid(args: list[str], topology: Topology, remat: str,
                  stages_in_slice: tuple[int, ...] = PIPELINE_STAGES_IN_SLICE) -> list[tuple[list[str], str]]:
    """Pipeline layouts × repeats (pipeline_repeats) × micro-batch counts (1, 2 and 4 × the stages), fsdp
    filling the rest of the slice (the recipe's context kept), each with "" when the recipe resolves on
    it, else why not: one stage per slice across slices (no data parallelism over DCN), and
    `stages_in_slice` stages inside each slice. No stages at all: none."""
    raw = C.load(args)
    layouts = [{"ici_pipeline_parallelism": p} for p in stages_in_slice]
    if topology.num_slices > 1 and stages_in_slice:
        layouts.insert(0, {"ici_pipeline_parallelism": 1, "dcn_pipeline_parallelism": topology.num_slices,
                           "dcn_data_parallelism": 1, "dcn_fsdp_parallelism": 1})
    out = []
    for layout in layouts:
        stages = layout["ici_pipeline_parallelism"] * layout.get("dcn_pipeline_parallelism", 1)
        for repeats in pipeline_repeats(raw.base_num_decoder_layers, stages):
            for micro in PIPELINE_MICROBATCHES:
                overrides = [*(f"{k}={v}" for k, v in layout.items()), "ici_data_parallelism=1",
                             f"ici_context_parallelism={raw.ici_context_parallelism}", "ici_tensor_parallelism=1",
                             "ici_fsdp_parallelism=-1", f"num_pipeline_repeats={repeats}",
                             "num_layers_per_pipeline_stage=-1", f"num_pipeline_microbatches={micro * stages}",
                             f"remat_policy={remat}"]
                out.append((overrides, _valid(args, topology, overrides)))
    return out


def pipeline_candidates(args: list[str], topology: Topology, remat: str,
                        stages_in_slice: tuple[int, ...] = PIPELINE_STAGES_IN_SLICE) -> list[list[str]]:
    """The layouts of `pipeline_grid` that resolve."""
    return [overrides for overrides, why in pipeline_grid(args, topology, remat, stages_in_slice) if not why]


VOCAB_TILE_FACTORS = (2, 4)  # the sweep's vocabulary tiles: these multiples of the plan's loss chunks


def _why_not(plan: Plan) -> str:
    """Why a compiled plan does not fit, in one line ("" when it fits)."""
    if plan.fits:
        return ""
    if plan.peak_bytes is not None and plan.usable_bytes:
        return (f"needs {plan.peak_bytes / GIB:.2f} GiB of {plan.usable_bytes / GIB:.2f} "
                f"(over by {(plan.peak_bytes - plan.usable_bytes) / GIB:.2f})")
    return plan.error or "the compiler refused it"


def sweep(args: list[str], topology: Topology, remats: tuple[str, ...] = SWEEP_REMATS,
          quantizations: tuple[str, ...] = SWEEP_QUANTIZATIONS, progress: Progress = stderr_progress,
          stages_in_slice: tuple[int, ...] = PIPELINE_STAGES_IN_SLICE) -> list[dict]:
    """Compile every mesh × remat candidate, then the pipeline layouts (pipeline_grid) with the remat
    policy of the fastest that fits, then finer vocabulary tiles (VOCAB_TILE_FACTORS × its loss chunks)
    on the fastest that fits or, when none does, on the nearest to fitting, then each of
    `quantizations` on the fastest that fits (a quantized matmul changes the compute term, not which
    mesh or policy fits). Fitting rows ranked by estimated step time, then the compiled ones that do not
    fit, then the layouts the recipe refuses; every row that is not a plan says why (`why`)."""
    def row(overrides: list[str]) -> dict:
        plan = compile_plan(args, topology, overrides)
        return {"mesh": plan.mesh, "remat_policy": plan.recipe["remat_policy"],
                "quantization": plan.recipe["quantization"], "pipeline": plan.recipe["pipeline"],
                "loss_chunks": plan.recipe["loss_chunks"], "fits": plan.fits, "skipped": False,
                "why": _why_not(plan), "peak_bytes": plan.peak_bytes, "usable_bytes": plan.usable_bytes,
                "step_seconds": plan.estimate.get("step_seconds"), "mfu": plan.estimate.get("mfu"),
                "overrides": overrides, "command": command(args, overrides, topology)}

    def refused(overrides: list[str], why: str) -> dict:
        return {"mesh": None, "remat_policy": None, "quantization": None, "pipeline": None, "loss_chunks": None,
                "fits": False, "skipped": True, "why": f"not possible: {why}", "peak_bytes": None,
                "usable_bytes": None, "step_seconds": None, "mfu": None, "overrides": overrides,
                "command": command(args, overrides, topology)}

    def ranked(rows: list[dict]) -> list[dict]:
        return sorted(rows, key=lambda r: (r["skipped"], not r["fits"], r["step_seconds"] or 0.0,
                                           r["peak_bytes"] or 0.0))

    def compile_all(grid, label: str) -> list[dict]:
        out = [refused(overrides, why) for overrides, why in grid if why]
        todo = [overrides for overrides, why in grid if not why]
        for i, overrides in enumerate(todo, 1):
            progress(f"{label} {i}/{len(todo)}: {' '.join(overrides)}")
            out.append(row(overrides))
        return out

    rows = compile_all(sweep_grid(args, topology, remats), "sweep")
    # pipeline layouts with the remat policy of the fastest mesh that fits (else full recomputation):
    # stages change the bytes between slices and the bubble, not which policy is fastest
    fastest = ranked(rows)[0] if any(r["fits"] for r in rows) else None
    rows += compile_all(pipeline_grid(args, topology, fastest["remat_policy"] if fastest else "full", stages_in_slice),
                        "sweep pipeline")
    compiled = [r for r in rows if not r["skipped"]]
    base = (ranked(rows)[0] if any(r["fits"] for r in rows) else
            min(compiled, key=lambda r: (r["peak_bytes"] or float("inf")) / (r["usable_bytes"] or 1), default=None))
    if base is not None and base["peak_bytes"] is not None:  # the output head's share of the peak, tiled finer
        tiles = [[*base["overrides"], f"num_vocab_tiling={factor * base['loss_chunks']}"] for factor in VOCAB_TILE_FACTORS]
        rows += compile_all([(o, _valid(args, topology, o)) for o in tiles], f"sweep vocabulary tiles on {' '.join(base['overrides'])}:")
    best = ranked(rows)[0] if any(r["fits"] for r in rows) else None
    for mode in (m for m in quantizations if best is not None and m != best["quantization"]):
        overrides = [*best["overrides"], f"quantization={mode}"]
        progress(f"sweep {overrides[-1]} on the fastest: {' '.join(best['overrides'])}")
        rows.append(row(overrides))
    return ranked(rows)
