"""Published figures of accelerator chips, as data (no JAX): the metrics' MFU, the peak probe and the
TPU planner read them here."""

# Published dense peak TFLOP/s per chip for bf16 (per device as JAX sees it; keys are prefixes of
# jax's `device_kind`).
PEAK_TFLOPS = {
    "TPU v4": 275.0, "TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v5p": 459.0, "TPU v5": 459.0,
    "TPU v6 lite": 918.0, "TPU v6e": 918.0, "NVIDIA H100 80GB HBM3": 989.0, "NVIDIA H200": 989.0,
    "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA A100-SXM4-40GB": 312.0,
    # Ironwood: each chip is two JAX devices (one per TensorCore), so half the chip's 2307 (Cloud TPU
    # docs, "TPU7x (Ironwood)": peak compute per chip 2307 TFLOPs BF16, 4614 FP8)
    "TPU7x": 1153.5,
}

# Published dense peaks of 8-bit matmuls (TOP/s for int8, TFLOP/s for fp8), same keys: what a
# `quantization=` matmul runs at. A chip with no fp8 matrix units has no fp8 entry: XLA converts fp8
# operands to bf16 there, so its bf16 peak applies.
#   TPU v4   275 int8 (Cloud TPU docs, "TPU v4": 275 TFLOPs bf16 or int8)
#   TPU v5e  393 int8 (Cloud TPU docs, "TPU v5e": Peak compute per chip (Int8) 393 TOPs)
#   TPU v5p  918 int8 (Google Cloud blog, "Introducing Cloud TPU v5p", Dec 2023: 918 TOPs int8)
#   TPU v6e  1836 int8 (Cloud TPU docs, "TPU v6e": Peak compute per chip (Int8) 1836 TOPs)
#   H100 SXM, H200  1979 fp8 and int8 (NVIDIA datasheets list 3958 "with sparsity"; dense is half)
#   A100     624 int8 (NVIDIA A100 datasheet: 1248 with sparsity); no fp8 units
#   TPU7x    2307 fp8 per device (4614 per chip of two; Cloud TPU docs "TPU7x (Ironwood)"); no int8
#            figure published, so int8 goes at the bf16 peak
PEAK_TFLOPS_8BIT = {
    "int8": {"TPU v4": 275.0, "TPU v5 lite": 393.0, "TPU v5e": 393.0, "TPU v5p": 918.0, "TPU v5": 918.0,
             "TPU v6 lite": 1836.0, "TPU v6e": 1836.0, "NVIDIA H100 80GB HBM3": 1979.0,
             "NVIDIA H200": 1979.0, "NVIDIA A100-SXM4-80GB": 624.0, "NVIDIA A100-SXM4-40GB": 624.0},
    "fp8": {"NVIDIA H100 80GB HBM3": 1979.0, "NVIDIA H200": 1979.0, "TPU7x": 2307.0},
}


def peak_tflops(name: str, precision: str = "bf16") -> float:
    """The published dense peak of chip `name` (a key above) for `precision`: bf16, int8 or fp8."""
    return PEAK_TFLOPS_8BIT.get(precision, {}).get(name, PEAK_TFLOPS[name])
