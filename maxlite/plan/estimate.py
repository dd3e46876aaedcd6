"""A step-time ESTIMATE from the compiled program and the chip's published figures (a roofline, not a run).

  compute  = hardware FLOPs per device / bf16 peak   (MaxText FLOPs + what remat recomputes)
  memory   = HBM bytes per device / HBM bandwidth    (operands + results of every top-level op of
                                                      the compiled program, loops × trip count;
                                                      XLA's own count sees a loop body once)
  ici      = bytes each device sends in collectives / one ring's bandwidth (both neighbours)
  dcn      = gradient all-reduce across slices / the chip's share of the data-centre network
  step     = max(compute, memory) + ici + dcn         (no overlap credited: XLA overlaps some)

Real steps are slower: kernels do not reach peak. One calibration point: MaxText's llama3-8b,
per_device_batch_size=1, max_target_length=4096, fsdp 4 × tensor 4 on v6e-16 (the GKE + Ray
tutorial) measures 1.1 s/step.
"""

from __future__ import annotations

from maxlite.plan.topology import Chip


def hardware_flops(cfg, flops_formula: float) -> float:
    """FLOPs the chips execute: rematerialisation re-runs (part of) the forward pass of each layer."""
    if cfg.remat_policy in ("none", "save_dots"):
        return flops_formula
    B, T, V, D = cfg.global_batch_size, cfg.max_target_length, cfg.vocab_size, cfg.base_emb_dim
    if cfg.remat_policy == "full":
        layers = flops_formula - 3.0 * 2 * B * T * D * V  # everything but the unembedding
        return flops_formula + layers / 3  # one more forward of every layer
    # minimal: attention's batched dots (QKᵀ, PV) are not saved, so they run forward twice
    attention = 3.0 * cfg.base_num_decoder_layers * 2 * B * T * T * cfg.base_num_query_heads * cfg.head_dim
    return flops_formula + attention / 3


def estimate(plan, cfg, chip: Chip, num_slices: int) -> dict:
    n = plan.num_devices
    model_flops = plan.flops_formula / n
    hw_flops = hardware_flops(cfg, plan.flops_formula) / n
    compute_s = hw_flops / (chip.peak_tflops * 1e12)
    hbm_bytes = plan.hbm_bytes or 0.0
    memory_s = hbm_bytes / (chip.hbm_gbps * 1e9)
    moved = sum(c["moved"] for c in plan.collectives.values())
    ici_s = moved / (chip.ring_gbps * 1e9)
    dcn_bytes = 0.0
    if num_slices > 1 and plan.dcn.get("data", 1) > 1:
        s = plan.dcn["data"]
        dcn_bytes = 2 * (s - 1) / s * plan.param_bytes  # gradients, same shards as the params
    dcn_s = dcn_bytes / (chip.dcn_gbps * 1e9)
    step_s = max(compute_s, memory_s) + ici_s + dcn_s
    tokens = cfg.global_batch_size * cfg.max_target_length
    return {
        "is_estimate": True,
        "step_seconds": step_s,
        "compute_seconds": compute_s,
        "memory_seconds": memory_s,
        "ici_seconds": ici_s,
        "dcn_seconds": dcn_s,
        "bound": "compute" if compute_s >= memory_s else "memory",
        "hardware_flops_per_device": hw_flops,
        "model_flops_per_device": model_flops,
        "hbm_bytes_per_device": hbm_bytes,
        "collective_bytes_per_device": moved,
        "dcn_bytes_per_device": dcn_bytes,
        "mfu": model_flops / step_s / (chip.peak_tflops * 1e12) if step_s else 0.0,
        "tflops_per_device": model_flops / step_s / 1e12 if step_s else 0.0,
        "tokens_per_second_per_device": tokens / n / step_s if step_s else 0.0,
    }
