"""A step-time ESTIMATE from the compiled program and the chip's published figures (a roofline, not a run).

  compute  = hardware FLOPs per device / bf16 peak   (MaxText FLOPs + what remat recomputes);
             with `quantization`, the quantized projections' share / the chip's int8 or fp8 peak
  memory   = HBM bytes per device / HBM bandwidth    (operands + results of every top-level op of
                                                      the compiled program, loops × trip count;
                                                      XLA's own count sees a loop body once)
  ici      = bytes each device sends in collectives / one ring's bandwidth (both neighbours), each
             op's bytes divided by the rings the compiler runs it on at once (maxlite/plan/hlo.py:
             Ironwood's offloaded all-reduces name X, Y and Z; others count one ring)
  dcn      = bytes across slices / the chip's share of the data-centre network: the gradient
             all-reduce (data over DCN), the weights gathered forward and backward and the gradients
             reduce-scattered (fsdp over DCN), one micro-batch's activations and their gradients
             per pipeline iteration (stages over DCN)
  step     = max(compute, memory) / (1 − bubble) + ici + dcn   (no overlap credited: XLA overlaps some;
             the bubble: a pipeline's stages all compute in every iteration, the idle ones' work
             discarded, (P − 1) / (R·M + P − 1) of it); the collectives the compiler offloads to the
             SparseCores (Ironwood) run beside the TensorCores' work: max(that, their ICI time) + the
             rest of ici + dcn

Custom calls (the splash attention kernel) count as one top-level op: they read their operands
(Q, K, V, segment ids) and write their results (O, log-sum-exp) once; no T×T scores reach HBM.
Their extra compute (the backward pass recomputes the scores) is in `hardware_flops`.

Real steps are slower: kernels do not reach peak. The calibrated step is the roofline × one factor,
the geometric mean of MaxText's measured steps ÷ the estimates of the same recipes
(maxlite/plan/calibration.py; the table in docs/plan.md).
"""

from __future__ import annotations

from maxlite.models.flops import forward_flops_by_part
from maxlite.plan import calibration
from maxlite.plan.topology import Chip


def _per_layer_forward(cfg) -> dict[str, float]:
    """Forward FLOPs of all layers by part (maxlite/models/flops.py's terms, not × 3)."""
    parts = forward_flops_by_part(cfg)
    return {part: parts[part] for part in ("qkv", "out", "mlp", "attention")}


_LAYER_PARTS = ("qkv", "out", "mlp", "attention")
_PROJECTIONS = ("qkv", "out", "mlp")  # what `quantization` quantizes (maxlite/quant.py)
RECOMPUTED = {  # the forward parts a remat policy's backward pass runs again
    "none": (), "save_dots": (),
    "full": _LAYER_PARTS, "offload_layer_inputs": _LAYER_PARTS,  # the layer input is all that is kept
    "minimal": ("attention",), "save_attn_mlp_proj": ("attention",),  # QKᵀ, PV re-run
    "save_qkv_proj": ("out", "mlp", "attention"),
    "save_dot_except_mlp": ("mlp", "attention"),
}


def quantized_flops(cfg) -> float:
    """FLOPs of the quantized projections (all devices): forward, both backward matmuls, and what
    remat runs again of them; 0 without `quantization`."""
    if not cfg.quantization:
        return 0.0
    fwd = _per_layer_forward(cfg)
    return sum(3 * fwd[p] + (fwd[p] if p in RECOMPUTED[cfg.remat_policy] else 0.0) for p in _PROJECTIONS)


def hardware_flops(cfg, flops_formula: float) -> float:
    """FLOPs the chips execute: the formula, plus the forward work remat recomputes, plus the
    score recomputation of a flash kernel's backward pass (`cfg.attention` as resolved for the
    target: maxlite.config.resolve)."""
    fwd = _per_layer_forward(cfg)
    recompute = sum(fwd[p] for p in RECOMPUTED[cfg.remat_policy])
    kernel = 0.0
    if cfg.attention in ("flash", "cudnn_flash"):
        # its backward recomputes the scores: S and dP in the dQ and the dK/dV kernels (+3 of the
        # forward's 2 matmuls), or once with the fused backward kernel (+1)
        kernel = fwd["attention"] * (0.5 if cfg.sa_use_fused_bwd_kernel else 1.5)
    return flops_formula + recompute + kernel


def pipeline_bytes(cfg) -> float:
    """Bytes each device sends to the next stage per step: in each of the R·M + P − 1 iterations of
    each accumulation batch, its share of one micro-batch's hidden states [b, T, D] forward and
    their gradient backward; 0 without a pipeline."""
    stages = cfg.axis_size("stage")
    if stages == 1:
        return 0.0
    context, tensor = cfg.axis_size("context"), cfg.axis_size("tensor")
    rows = cfg.per_device_batch_size * stages * context * tensor / cfg.pipeline_microbatches  # per batch shard
    iterations = cfg.pipeline_repeats * cfg.pipeline_microbatches + stages - 1
    size = 2 if cfg.dtype == "bfloat16" else 4
    return (2 * iterations * rows * cfg.max_target_length / context * cfg.base_emb_dim * size
            * cfg.gradient_accumulation_steps)


def estimate(plan, cfg, chip: Chip, num_slices: int) -> dict:
    from maxlite import quant

    n = plan.num_devices
    model_flops = plan.flops_formula / n
    hw_flops = hardware_flops(cfg, plan.flops_formula) / n
    q_flops, q_peak = quantized_flops(cfg) / n, chip.peak(quant.precision(cfg.quantization))
    compute_s = (hw_flops - q_flops) / (chip.peak_tflops * 1e12) + q_flops / (q_peak * 1e12)
    hbm_bytes = plan.hbm_bytes or 0.0
    memory_s = hbm_bytes / (chip.hbm_gbps * 1e9)
    moved = sum(c["moved"] for c in plan.collectives.values())
    ring = chip.ring_gbps * 1e9
    ici_s = sum(c.get("ring_moved", c["moved"]) for c in plan.collectives.values()) / ring
    offloaded_s = sum(c.get("offloaded_ring_moved", 0.0) for c in plan.collectives.values()) / ring
    dcn_bytes, p2p = 0.0, pipeline_bytes(cfg)
    if num_slices > 1 and plan.dcn.get("data", 1) > 1:
        s = plan.dcn["data"]
        dcn_bytes = 2 * (s - 1) / s * plan.param_bytes  # gradients, same shards as the params
    if num_slices > 1 and plan.dcn.get("fsdp", 1) > 1:
        dcn_bytes += 3 * (plan.dcn["fsdp"] - 1) * plan.param_bytes  # the other slices' shards, twice; gradients
    if num_slices > 1 and plan.dcn.get("stage", 1) > 1:
        dcn_bytes += p2p
    dcn_s = dcn_bytes / (chip.dcn_gbps * 1e9)
    bubble = cfg.pipeline_bubble
    step_s = max(max(compute_s, memory_s) / (1 - bubble), offloaded_s) + ici_s - offloaded_s + dcn_s
    tokens = cfg.global_batch_size * cfg.max_target_length
    k = calibration.factor()
    return {
        "is_estimate": True,
        "step_seconds": step_s,
        "compute_seconds": compute_s,
        "memory_seconds": memory_s,
        "ici_seconds": ici_s,
        "ici_offloaded_seconds": offloaded_s,  # of ici_seconds: on the SparseCores, beside the TensorCores' work
        "dcn_seconds": dcn_s,
        # the step's largest term: compute, HBM or the collectives (ICI, with the SparseCores' share)
        "bound": max((("compute", compute_s), ("memory", memory_s), ("ICI", ici_s)), key=lambda kv: kv[1])[0],
        "hardware_flops_per_device": hw_flops,
        "quantized_flops_per_device": q_flops,  # of hardware_flops, run at quantized_peak_tflops
        "quantized_peak_tflops": q_peak,
        "model_flops_per_device": model_flops,
        "hbm_bytes_per_device": hbm_bytes,
        "collective_bytes_per_device": moved,
        "dcn_bytes_per_device": dcn_bytes,
        "pipeline_p2p_bytes_per_device": p2p,
        "bubble_fraction": bubble,
        "mfu": model_flops / step_s / (chip.peak_tflops * 1e12) if step_s else 0.0,  # of the bf16 peak
        "tflops_per_device": model_flops / step_s / 1e12 if step_s else 0.0,
        "tflops_per_chip": model_flops / step_s / 1e12 * chip.devices_per_chip if step_s else 0.0,
        "tokens_per_second_per_device": tokens / n / step_s if step_s else 0.0,
        # what MaxText's measured steps say a real step takes: the roofline × calibration.factor()
        "calibration_factor": k,
        "calibrated_step_seconds": step_s * k,
    }
