"""Quantized training (maxlite/quant.py through models/matmul.project): the projection against Qwix's
own reference (`qwix.quantize_model` on an NNX module) in values and gradients; 8-bit dots forward
and backward; remat policies that still see the quantized matmuls; runs of `tiny` that stay within
the seed-to-seed spread of bf16 and resume bitwise; master weights, optimizer state and exports
untouched; a mode the platform cannot run refused in one line."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import SMALL, dot_equations, train_losses
from maxlite import config as C, quant
from maxlite.models.matmul import project

qwix = pytest.importorskip("qwix")

WEIGHT_SPECS = {  # the decoder layers' projections: MLP in, q/k/v, attention out
    "btd,df->btf": ((2, 8, 32), (32, 48)),
    "btd,dnh->btnh": ((2, 8, 32), (32, 4, 8)),
    "btnh,nhd->btd": ((2, 8, 4, 8), (4, 8, 32)),
}
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
EIGHT_BIT = {"int8": {jnp.dtype(jnp.int8)}, "fp8": {E4M3}, "fp8_full": {E4M3, E5M2}, "fp8_gpu": {E4M3, E5M2}}


@pytest.fixture
def quantized(request):
    """The test's mode for the projections it traces (as a model sets its own), reset afterwards."""
    with quant.using(request.param):  # fp8_gpu included: the platform check is tested on its own
        yield request.param


def _operands(spec, seed=0):
    x_shape, w_shape = WEIGHT_SPECS[spec]
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, x_shape, jnp.bfloat16)
    w = 0.05 * jax.random.normal(kw, w_shape, jnp.float32)  # the stored parameter: f32, cast at use
    g = jax.random.normal(kg, jnp.einsum(spec, x, w.astype(jnp.bfloat16)).shape, jnp.bfloat16)
    return x, w, g


def _value_and_grads(fn, x, w, g):
    out, vjp = jax.vjp(fn, x, w)
    return out, vjp(g)


class _Dense(nnx.Module):
    """What Qwix intercepts in a model: an einsum of an activation and a parameter cast to its dtype."""

    def __init__(self, spec, w):
        self.spec, self.w = spec, nnx.Param(w)

    def __call__(self, x):
        return jnp.einsum(self.spec, x, self.w[...].astype(x.dtype))


def _qwix_reference(spec, mode, x, w):
    """Qwix's own quantized training: `qwix.quantize_model` with the mode's QtRule."""
    model = qwix.quantize_model(_Dense(spec, w), qwix.QtProvider([quant.rule(mode)]), x)
    graphdef, state = nnx.split(model)

    def apply(x, w):  # the module with weight `w` (its only parameter)
        return nnx.merge(graphdef, jax.tree.map(lambda _: w, state))(x)
    return apply


# every projection's spec with int8; the other modes (their rules differ, not the specs) on the one
# with two contracted axes
CASES = [(spec, "int8") for spec in sorted(WEIGHT_SPECS)] + [("btnh,nhd->btd", m) for m in ("fp8", "fp8_full", "fp8_gpu")]


@pytest.mark.parametrize("spec,quantized", CASES, indirect=["quantized"])
def test_quantized_projection_equals_qwix_reference_in_values_and_gradients(spec, quantized):
    x, w, g = _operands(spec)
    got = _value_and_grads(lambda x, w: project(spec, x, w), x, w, g)
    want = _value_and_grads(_qwix_reference(spec, quantized, x, w), x, w, g)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # and it is quantized: the plain bf16 projection differs in the value and both gradients
    with quant.using(""):
        plain = _value_and_grads(lambda x, w: project(spec, x, w), x, w, g)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(plain)):
        assert not np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("quantized", sorted(EIGHT_BIT), indirect=True)
def test_forward_and_both_backward_matmuls_take_8_bit_operands(quantized):
    spec = "btd,df->btf"
    x, w, g = _operands(spec)
    jaxpr = jax.make_jaxpr(lambda x, w, g: _value_and_grads(lambda x, w: project(spec, x, w), x, w, g))(x, w, g)
    dots = list(dot_equations(jaxpr.jaxpr))
    assert len(dots) == 3  # forward, d input, d weight
    for eqn in dots:
        assert {v.aval.dtype for v in eqn.invars} <= EIGHT_BIT[quantized], eqn


@pytest.mark.parametrize("quantized", ["int8"], indirect=True)
@pytest.mark.parametrize("spec", ["btd,dv->btv", "btkgh,bskh->bkgts"])
def test_the_output_head_and_attention_stay_in_the_compute_dtype(spec, quantized):
    """MaxText's rules quantize the decoder layers' dense layers: not the logits, not QKᵀ / PV."""
    a = jnp.ones((2, 8, 2, 2, 8) if "k" in spec else (2, 8, 16), jnp.bfloat16)
    b = jnp.ones((2, 8, 2, 8) if "k" in spec else (16, 24), jnp.bfloat16)
    g = jnp.ones(jnp.einsum(spec, a, b).shape, jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda a, b, g: _value_and_grads(lambda a, b: project(spec, a, b), a, b, g))(a, b, g)
    dots = list(dot_equations(jaxpr.jaxpr))
    assert len(dots) == 3 and all(v.aval.dtype == jnp.bfloat16 for eqn in dots for v in eqn.invars)


def _matmuls_of_gradient(remat_policy):
    """dot_general equations in the jaxpr of the logits' gradient (tiny, bf16, unrolled layers)."""
    from maxlite.state import abstract_params

    cfg = C.load(["base.yml", "model_name=tiny", "scan_layers=false", f"remat_policy={remat_policy}"])
    graphdef, params = abstract_params(cfg)
    B, T = 1, 32
    tokens, positions = jnp.zeros((B, T), jnp.int32), jnp.broadcast_to(jnp.arange(T), (B, T))

    def total(params):
        return nnx.merge(graphdef, params)(tokens, positions, jnp.ones((B, T), jnp.int32)).sum()

    return len(list(dot_equations(jax.make_jaxpr(jax.grad(total))(params).jaxpr)))


@pytest.mark.parametrize("quantized", ["int8"], indirect=True)
def test_remat_policies_keep_the_quantized_matmuls_they_name(quantized):
    """`save_dots` keeps every matmul and `minimal` the weight ones, and what they keep of a quantized
    projection is its bf16 result: JAX's dot policies alone would keep the int32 accumulator of
    Qwix's int8 dot (twice the bytes) and redo the scaling."""
    import contextlib
    import io

    from jax.ad_checkpoint import print_saved_residuals  # JAX's public view of what remat keeps

    from maxlite.models import matmul

    layers = C.load(["base.yml", "model_name=tiny"]).base_num_decoder_layers
    none = _matmuls_of_gradient("none")
    assert _matmuls_of_gradient("save_dots") == none
    assert _matmuls_of_gradient("minimal") == none + 2 * layers  # QKᵀ and PV recomputed
    assert _matmuls_of_gradient("full") == none + 8 * layers
    x, w, _ = _operands("btd,df->btf")
    f = lambda x, w: jnp.sum(jax.nn.silu(project("btd,df->btf", x, w)).astype(jnp.float32))  # noqa: E731
    for policy in (matmul.dots_saveable, matmul.dots_with_no_batch_dims_saveable):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print_saved_residuals(jax.checkpoint(f, policy=policy), x, w)
        kept = [line.split(" from ")[0] for line in out.getvalue().splitlines() if "argument" not in line]
        assert kept == ["bf16[2,8,48] named 'weight_matmul'"], kept


def test_each_model_runs_its_own_mode_whatever_was_built_before():
    """Nothing process-wide: a bf16 model made after an int8 one traces bf16 dots (forward and
    decoding), and the int8 model still traces int8 after it."""
    from maxlite import api
    from maxlite.models import decode

    def dot_dtypes(model):
        tokens = jnp.zeros((1, 4), jnp.int32)
        positions, cache = api.default_positions(tokens), decode.empty_cache(model.cfg, 1, 8)
        graphdef, state = nnx.split(model)
        full = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(tokens, positions, jnp.ones_like(tokens)))(state)
        step = jax.make_jaxpr(lambda s: decode.forward(nnx.merge(graphdef, s), tokens, positions,
                                                       jnp.full((1,), 4, jnp.int32), cache)[0])(state)
        return [{v.aval.dtype for eqn in dot_equations(j.jaxpr) for v in eqn.invars} for j in (full, step)]

    argv = ["base.yml", "model_name=tiny", "scan_layers=false"]
    int8 = api.create_model(C.load([*argv, "quantization=int8"]))
    plain = api.create_model(C.load(argv))
    for dtypes in dot_dtypes(plain):
        assert jnp.dtype(jnp.int8) not in dtypes
    for dtypes in dot_dtypes(int8):
        assert jnp.dtype(jnp.int8) in dtypes


def test_a_mode_the_platform_cannot_run_is_refused_in_one_line(tmp_path, capsys):
    from maxlite.train import main

    code = main([*SMALL, "quantization=fp8_gpu", f"base_output_directory={tmp_path}", "steps=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["maxlite: error: quantization=fp8_gpu runs on GPUs only (one scale per "
                                 "tensor for cuBLASLt's FP8 GEMMs); on cpu use one of int8, fp8, fp8_full"]
    assert not os.listdir(tmp_path)  # refused before anything was written


# tiny with short sequences: 2 devices × 4 rows × 32 tokens (benchmarks/bench_quant_losses.py's recipe);
# 20 steps in the default run, the 50 of the issue marked slow.
TINY = ["base.yml", "model_name=tiny", "max_target_length=32", "per_device_batch_size=4",
        "enable_tensorboard=false", "write_report=false", "steps=50"]
# The smallest per-step standard deviation of this recipe's loss across 8 bf16 seeds (0-7): 0.0131
# at step 1 (median over the 50 steps 0.063), measured with benchmarks/bench_quant_losses.py
# (benchmarks/results/quant_losses_tiny.json). A quantized run must stay closer than that to the
# bf16 run of its own seed at every step. Measured over 50 steps, seeds 0 and 4: int8 within 0.0030,
# fp8 within 0.012 (seed 4, step 27; seed 0: 0.0039), fp8_full within 0.0126.
DISTANCE = 0.013


@pytest.mark.parametrize("steps", [20, pytest.param(50, marks=pytest.mark.slow)])
def test_quantized_runs_of_tiny_stay_within_the_bf16_seed_spread(steps):
    bf16, _ = train_losses([*TINY, "quantization="], 2, steps)
    for mode in ("int8", "fp8"):
        losses, _ = train_losses([*TINY, f"quantization={mode}"], 2, steps)
        assert np.max(np.abs(losses - bf16)) < DISTANCE, (mode, np.abs(losses - bf16))
        assert not np.array_equal(losses, bf16)  # quantized, not bf16 under another name
    assert bf16[-1] < bf16[0] - 0.5  # and training makes progress (8.36 → 7.68 at step 20, 6.85 at 50)


def _final(run_dir, steps):
    """(params, optimizer state as host arrays, the last step's loss) of a run directory."""
    from maxlite import checkpoints as ck

    root, _ = ck.resolve_step_dir(f"{run_dir}/checkpoints", steps)
    _, params = ck.load_params(root, step=steps)
    opt = ck.load_numpy(root, "optimizer", step=steps)
    records = [json.loads(x) for x in open(f"{run_dir}/metrics.jsonl")]
    loss = [r["loss"] for r in records if r.get("step") == steps and "loss" in r][-1]
    return params, opt, loss


def _resume_argv(out) -> list[str]:
    return [*SMALL, f"base_output_directory={out}", "checkpoint_period=0", "straggler_report_interval=0",
            "ici_fsdp_parallelism=2", "ici_data_parallelism=4",
            "learning_rate_schedule_steps=8"]  # the same schedule for the run cut at step 4


@pytest.fixture(scope="module")
def plain_optimizer_dtypes(tmp_path_factory) -> list:
    """The optimizer state's dtypes after a step of the unquantized recipe (one run for both modes)."""
    from maxlite.train import train

    out = tmp_path_factory.mktemp("plain")
    train(C.load([*_resume_argv(out), "quantization=", "run_name=plain", "steps=1"]))
    return [np.asarray(x).dtype for x in jax.tree.leaves(_final(f"{out}/plain", 1)[1])]


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_a_quantized_run_resumes_bitwise_and_keeps_master_weights_and_exports(mode, tmp_path, plain_optimizer_dtypes):
    from maxlite.bridge import hf
    from maxlite.train import train

    argv = [*_resume_argv(tmp_path), f"quantization={mode}"]
    train(C.load([*argv, "run_name=whole", "steps=8"]))
    train(C.load([*argv, "run_name=resumed", "steps=4"]))
    train(C.load([*argv, "run_name=resumed", "steps=8"]))  # resumes from the final save of step 4
    (pa, oa, la), (pb, ob, lb) = _final(f"{tmp_path}/whole", 8), _final(f"{tmp_path}/resumed", 8)
    assert la == lb
    for a, b in ((pa, pb), (oa, ob)):
        a, b = jax.tree.leaves(a), jax.tree.leaves(b)
        assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    # master weights and optimizer moments in their own dtype, as a bf16 run keeps them
    assert {np.asarray(x).dtype for x in jax.tree.leaves(pa)} == {np.dtype("float32")}
    assert [np.asarray(x).dtype for x in jax.tree.leaves(oa)] == plain_optimizer_dtypes
    # an export of these weights is the same whatever the recipe's quantization
    cfg = C.load([*argv, "run_name=whole"])
    for name, q in (("q", mode), ("plain", "")):
        hf.export_hf(C.load([*argv, f"quantization={q}"]), pa, str(tmp_path / f"export_{name}"))
    files = sorted(os.listdir(tmp_path / "export_q"))
    assert files == sorted(os.listdir(tmp_path / "export_plain")) and cfg.quantization == mode
    for f in files:
        assert (tmp_path / "export_q" / f).read_bytes() == (tmp_path / "export_plain" / f).read_bytes(), f
