"""The CPU matmul path (maxlite/cpu_matmul.py): kept by measured timings (injected here: which path
wins is the machine's), cached per CPU model and shapes, forced by `cpu_matmul`, and the same
training either way."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from helpers import SMALL, build, dot_equations, train_losses
from maxlite import build as build_lib, config as C, cpu_matmul, mesh as mesh_lib
from maxlite.data.synthetic import make_synthetic_iterator
from maxlite.models import matmul

@pytest.fixture(autouse=True)
def _process_path_restored():
    """Building sets this process's CPU path (maxlite.build): put the one before back after each test."""
    with matmul.cpu_path("bf16"):
        yield


F32_WINS, BF16_WINS = {"bf16": 0.002, "f32": 0.001}, {"bf16": 0.001, "f32": 0.002}


def _timer(seconds, calls):
    def time_paths(cfg):
        calls.append(cfg.base_emb_dim)
        return dict(seconds)
    return time_paths


@pytest.mark.parametrize("seconds, path", [(F32_WINS, "f32"), (BF16_WINS, "bf16")])
def test_the_faster_path_is_kept(seconds, path, tmp_path):
    cfg = C.load(SMALL + [f"jax_cache_dir={tmp_path}/jax"])
    choice = cpu_matmul.choose(cfg, _timer(seconds, []))
    assert (choice.path, choice.how, choice.seconds) == (path, "measured", seconds)


def test_the_answer_is_cached_beside_the_compile_cache_per_cpu_and_shapes(tmp_path):
    calls = []
    cfg = C.load(SMALL + [f"jax_cache_dir={tmp_path}/jax"])
    assert cpu_matmul.choose(cfg, _timer(F32_WINS, calls)).how == "measured"
    again = cpu_matmul.choose(cfg, _timer(BF16_WINS, calls))  # a second timing would pick bf16
    assert (again.path, again.how, again.seconds) == ("f32", "cached", F32_WINS) and len(calls) == 1
    entries = json.loads((tmp_path / "cpu_matmul.json").read_text())
    [key] = entries
    assert key.startswith(cpu_matmul.cpu_identity()) and jax.__version__ in key
    wider = C.load(SMALL + [f"jax_cache_dir={tmp_path}/jax", "base_emb_dim=128"])  # other shapes: measured
    assert cpu_matmul.choose(wider, _timer(BF16_WINS, calls)).path == "bf16" and len(calls) == 2
    off = C.load(SMALL + ["jax_cache_dir="])  # no compile cache: nothing written, measured every time
    assert cpu_matmul.choose(off, _timer(F32_WINS, calls)).how == "measured"
    assert cpu_matmul.choose(off, _timer(F32_WINS, calls)).how == "measured" and len(calls) == 4


def test_a_recipe_forces_a_path_and_a_float32_model_has_none_to_choose(tmp_path):
    calls = []
    for path in ("bf16", "f32"):
        cfg = C.load(SMALL + [f"jax_cache_dir={tmp_path}/jax", f"cpu_matmul={path}"])
        assert cpu_matmul.choose(cfg, _timer(F32_WINS if path == "bf16" else BF16_WINS, calls)) == \
            cpu_matmul.Choice(path, "forced", {})
    cfg = C.load(SMALL + [f"jax_cache_dir={tmp_path}/jax", "dtype=float32"])
    assert cpu_matmul.choose(cfg, _timer(BF16_WINS, calls)).path == "f32"
    assert calls == [] and not os.path.exists(tmp_path / "cpu_matmul.json")
    with pytest.raises(C.ConfigError, match="cpu_matmul='fast': choose one of auto, bf16, f32"):
        C.load(SMALL + ["cpu_matmul=fast"])


def test_the_probe_times_both_paths_at_the_models_shapes():
    seconds = cpu_matmul.probe(C.load(SMALL), repeats=1)
    assert sorted(seconds) == ["bf16", "f32"] and all(0 < s < float("inf") for s in seconds.values())


def _step_dots(argv):
    """The forced choice as built, and the operand dtypes of every matmul of its train step."""
    cfg, mesh, state, step, sharding = build(argv, 1)
    batch = {k: jax.device_put(v, sharding) for k, v in next(make_synthetic_iterator(cfg, "train", 0, 1)).items()}
    with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        jaxpr = jax.make_jaxpr(step)(state, batch)
    return cfg.cpu_matmul, {tuple(v.aval.dtype for v in eqn.invars) for eqn in dot_equations(jaxpr.jaxpr)}


def test_both_paths_train_the_same_and_each_runs_its_own_dots():
    """Three steps of a small bf16 model agree to well within a bf16 rounding of the loss (2^-8): each
    path forms the products exactly and sums them in float32, in different orders."""
    losses = {path: train_losses(SMALL + [f"cpu_matmul={path}"], 1, 3)[0] for path in ("bf16", "f32")}
    np.testing.assert_allclose(losses["f32"], losses["bf16"], rtol=2.0**-8)
    bf16, f32 = (_step_dots(SMALL + [f"cpu_matmul={path}"]) for path in ("bf16", "f32"))
    bf, f = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
    assert bf16[0] == "bf16" and (bf, bf) in bf16[1]
    assert f32[0] == "f32" and f32[1] == {(f, f)}
    built = build_lib.build(C.load(SMALL + ["cpu_matmul=f32"]), jax.devices()[:1], num_processes=1)
    assert built.cpu_matmul == cpu_matmul.Choice("f32", "forced", {}) and built.cfg.cpu_matmul == "f32"


@pytest.mark.parametrize("path, dtype", [("bf16", "bfloat16"), ("f32", "float32")])
def test_the_mfu_peak_is_the_running_paths(path, dtype):
    from maxlite.peak import peak_tflops_per_device
    peak, source = peak_tflops_per_device("bfloat16", path)
    assert peak > 0 and source.startswith(f"measured XLA {dtype} matmul"), source


def test_the_mfu_peak_is_measured_once_per_cpu_and_product(tmp_path, monkeypatch):
    """The end of every run asked for the peak; with the cache beside the compile cache a CPU model
    measures each product (the model's dtype, or float32 on the upcast path) once."""
    from maxlite import peak as peak_lib

    measured = []

    def measure(dtype, size, device):
        measured.append(dtype)
        return {"bfloat16": 0.5, "float32": 0.25}[dtype]

    monkeypatch.setattr(peak_lib, "measure_matmul_tflops", measure)
    cache_file = str(tmp_path / "cpu_matmul.json")
    first = peak_lib.peak_tflops_per_device("bfloat16", "bf16", cache_file)
    again = peak_lib.peak_tflops_per_device("bfloat16", "bf16", cache_file)
    upcast = peak_lib.peak_tflops_per_device("bfloat16", "f32", cache_file)
    assert measured == ["bfloat16", "float32"]
    assert (first[0], again[0], upcast[0]) == (0.5, 0.5, 0.25)
    assert "cached" not in first[1] and again[1].endswith("(cached in cpu_matmul.json)")
    peak_lib.peak_tflops_per_device("bfloat16", "bf16")  # no cache file: measured each time
    assert measured == ["bfloat16", "float32", "bfloat16"]
