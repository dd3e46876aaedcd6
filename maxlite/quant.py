"""Quantized training through Qwix (`quantization=`): the one module that knows the library.

The modes are MaxText's names for its Qwix quantized-training rules (`qwix.QtRule`, MaxText's
layers/quantizations.py), and what they quantize is what MaxText's rules match there (the dense
layers of the decoder blocks, `decoder/.*layers.*`):

  int8      int8 weights, activations and gradients; per-channel absmax scales; the weight
            gradient's contraction (the tokens) as one tile (MaxText's default shard count, 1)
  fp8       the same with float8_e4m3fn everywhere
  fp8_full  float8_e4m3fn forward, float8_e5m2 gradients, per-channel absmax scales
  fp8_gpu   float8_e4m3fn forward, float8_e5m2 gradients, one scale per tensor (the form
            cuBLASLt's FP8 GEMMs take); GPUs only. MaxText runs this name with flax's fp8 ops and
            delayed scaling (amax histories kept in the model's state); here Qwix's current
            scaling, so the state, checkpoints and exports stay what they are

Quantized: the decoder layers' weight projections (q, k, v, out, the MLP) in the forward pass and
both backward matmuls, each operand scaled on the fly by Qwix (`maxlite.models.matmul.project` is
the one place they go through). Not quantized: attention's QKᵀ and PV, the output head, norms and
the loss. The master weights (`weight_dtype`), optimizer state, checkpoints and exports are
untouched: each step quantizes the weights cast to the compute dtype, as MaxText's dense layers do
(so a quantized projection's weight gradient comes back in the compute dtype, then accumulates in
the master's).

The model sets its own mode while its layers are traced (`using(cfg.quantization)` in
`Transformer._run_layers` and decoding's `forward`): nothing is process-wide, so two models with
different modes share a process, and a traced program keeps what it was traced with (the model's
config, quantization included, is part of every jit cache key through the graphdef). The mode is
checked against the platform first (`maxlite.config_checks.check_platform`: run where the config is
resolved against its devices, and by `maxlite.api`'s model makers).

Qwix 0.1.8's QT dot (`qwix._src.core.dot_general_qt`) is called directly with the configuration its
`QtProvider` would build for an activation × weight product: the provider finds weights by
inspecting the caller's frames, which maxlite's `project(spec, x, w)` states outright. Pinned
exactly (pyproject.toml); tests/test_quant.py checks values and gradients against
`qwix.quantize_model` on an NNX module, so a Qwix that changes fails there first. No JAX at import
(config.py reads the names in models/names.py); Qwix is imported when a mode is first used.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

from maxlite.models.names import QUANTIZATION

MODES = QUANTIZATION  # the `quantization` choices (maxlite/models/names.py: config validation reads them)
_GPU_ONLY = ("fp8_gpu",)
_mode = contextvars.ContextVar("maxlite_quantization", default="")  # set by using() while tracing


@functools.cache
def rule(mode: str):
    """The Qwix rule for `mode` (None for "")."""
    if not mode:
        return None
    import jax.numpy as jnp
    import qwix

    e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2
    one_tile = 1.0  # MaxText: 1 / quantization_local_shard_count, whose default is 1
    rules = {
        "int8": dict(weight_qtype=jnp.int8, act_qtype=jnp.int8, bwd_qtype=jnp.int8,
                     bwd_weight_grad_tile_size=one_tile),
        "fp8": dict(weight_qtype=e4m3, act_qtype=e4m3, bwd_qtype=e4m3, bwd_weight_grad_tile_size=one_tile),
        "fp8_full": dict(weight_qtype=e4m3, act_qtype=e4m3, bwd_qtype=e5m2),
        "fp8_gpu": dict(weight_qtype=e4m3, act_qtype=e4m3, bwd_qtype=e5m2, disable_channelwise_axes=True),
    }
    return qwix.QtRule(module_path=".*", op_names=("einsum",), **rules[mode])


def precision(mode: str) -> str:
    """What a quantized matmul of `mode` runs in (the planner picks the chip's peak by it)."""
    return "int8" if mode == "int8" else "fp8" if mode else "bf16"


def modes_for(platform: str) -> tuple[str, ...]:
    """The quantized modes a platform runs ("" excluded; config_checks.check_platform refuses the rest)."""
    return tuple(m for m in MODES if m and (platform == "gpu" or m not in _GPU_ONLY))


@contextlib.contextmanager
def using(mode: str):
    """`mode` for the projections traced inside (a model's layers, by the model's own config)."""
    token = _mode.set(mode)
    try:
        yield
    finally:
        _mode.reset(token)


def active() -> str:
    """The quantization mode of the projections being traced ("" = none)."""
    return _mode.get()


def _qt_config(qt_rule):
    """What Qwix's QtProvider builds for activation (lhs) × weight (rhs) under `qt_rule`."""
    from qwix._src.core import dot_general_qt

    fwd = qt_rule.weight_qtype is not None or qt_rule.act_qtype is not None
    bwd = qt_rule.bwd_qtype is not None
    flat = qt_rule.disable_channelwise_axes
    return dot_general_qt.DotGeneralQtConfig(
        lhs_qtype=qt_rule.act_qtype, rhs_qtype=qt_rule.weight_qtype, tile_size=qt_rule.tile_size,
        lhs_calibration_method=qt_rule.act_calibration_method or "absmax",
        rhs_calibration_method=qt_rule.weight_calibration_method,
        lhs_disable_channelwise_axes=flat, rhs_disable_channelwise_axes=flat,
        dlhs_grad_qtype=qt_rule.bwd_qtype, dlhs_grad_calibration_method=qt_rule.bwd_calibration_method,
        dlhs_grad_disable_channelwise_axes=flat,
        drhs_grad_qtype=qt_rule.bwd_qtype, drhs_grad_calibration_method=qt_rule.bwd_calibration_method,
        drhs_tile_size=qt_rule.bwd_weight_grad_tile_size if bwd else None,
        drhs_grad_disable_channelwise_axes=flat,
        use_original_residuals=fwd and not bwd)


def einsum(spec: str, x, w, mode: str | None = None):
    """einsum(spec, x, w) for activation `x` and weight `w` (same dtype), quantized by `mode`
    (default: the one being traced, see using()) in the forward pass and both backward matmuls."""
    from qwix._src.core import dot_general_qt
    from qwix._src.core.einsum_info import EinsumInfo

    info = EinsumInfo.parse(spec)
    out = dot_general_qt.dot_general_qt(x, w, info.dimension_numbers, _qt_config(rule(mode or _mode.get())))
    return out if info.output_perm is None else out.transpose(info.output_perm)

