"""Published figures of accelerator chips, as data (no JAX): the metrics' MFU, the peak probe and the
TPU planner read them here."""

# Published dense peak TFLOP/s per chip for bf16 (per device as JAX sees it; keys are prefixes of
# jax's `device_kind`).
PEAK_TFLOPS = {
    "TPU v4": 275.0, "TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v5p": 459.0, "TPU v5": 459.0,
    "TPU v6 lite": 918.0, "TPU v6e": 918.0, "NVIDIA H100 80GB HBM3": 989.0, "NVIDIA H200": 989.0,
    "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA A100-SXM4-40GB": 312.0,
}
