"""The XLA flags of every CPU process the tests start (pytest's own, each `python -m` subprocess, each
Ray worker): the simulated device count and a cheaper compile.

The tests compile hundreds of small programs and run each a few steps, so XLA's compile dominates
their time, and its LLVM optimisation most of that. With LLVM at -O0 and XLA:CPU's loop emitters
(not its MLIR fusion emitters) the same programs compile in about 60% of the time: test_step,
test_quant, test_muon and test_presets from an empty cache, one process, idle 2-core machine,
419 s → 252 s; the whole suite from a clean clone 42 → 24 minutes. The programs are ours unchanged;
only XLA's code generation for them differs (some functions, the initialiser's among them, in the
last bits), and a run outside the tests (the README's, the benchmarks') uses XLA's defaults: so the
two lanes that check numbers on the compiler users run, test_family_table (which pins XLA's output
bytes) and test_hf_parity (every family's logits against transformers'), start their subprocess with
`cheap_compile=False`. No jax import here: the conftest reads it before JAX is imported."""

# ... and one LLVM module per program: XLA:CPU splits a module in 32 for parallel code generation, which
# at -O0 on two busy cores costs more (llvm::SplitModule, 4% of a GDN preset's compile) than it
# saves: step + alignment + 4 presets, one process, empty cache, 216 → 201 user CPU-seconds.
CHEAP_COMPILE = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                 "--xla_cpu_parallel_codegen_split_count=1")


# ... and, beside the flags, MLIR locations that hold each operation's innermost user frame only: by
# default JAX writes a traceback of up to ten frames into every operation's location
# (jax_include_full_tracebacks_in_locations), which debug dumps and profiles read and the compiled code
# does not. Three presets' build and two steps (test_presets -k "qwen3-next or kimi or deepseek", one
# process, empty cache): 54.0 and 53.8 → 50.7 and 51.4 user CPU-seconds. Set in the environment of every
# process of the cheaper compile (`process_env`, the Ray clusters' `ray_env`), dropped with it.
CHEAP_TRACE_ENV = {"JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS": "0"}


def cpu_xla_flags(devices: int, cheap_compile: bool = True) -> str:
    """XLA_FLAGS for a CPU test process with `devices` simulated devices; with `cheap_compile=False`
    XLA's default code generation (what users run)."""
    return f"--xla_force_host_platform_device_count={devices}" + (f" {CHEAP_COMPILE}" if cheap_compile else "")
