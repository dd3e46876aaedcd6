"""mu_dtype and grad_dtype (MaxText's keys): the optimizer's first moment in mu_dtype (weight_dtype
when unset), float32 gradients cast to grad_dtype before the optimizer, a checkpoint resumed across
a change of either (its moments cast), and an unknown dtype refused in one line."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlite import build as build_lib, config as C, optim, state as state_lib, step as step_lib
from maxlite.checkpoints.saver import Checkpointer
from tests.helpers import SMALL, start_built, train_losses, trained

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(np.float32)


def _moments(opt_state, name: str) -> list:
    """The leaves of an optimizer state under a field called `name` (optax's Adam/Muon `mu`, `nu`)."""
    return [x for path, x in jax.tree_util.tree_leaves_with_path(opt_state)
            if any(getattr(k, "name", None) == name for k in path)]


def _abstract(*extra):
    cfg = C.load([*SMALL, *extra])
    return cfg, state_lib.abstract_train_state(cfg, optim.make_optimizer(cfg))


@pytest.mark.parametrize("extra, mu", [
    ((), F32),  # float32 weights: the moment inherits float32
    (("mu_dtype=bfloat16",), BF16),
    (("weight_dtype=bfloat16",), BF16),  # "" follows the weights
    (("weight_dtype=bfloat16", "mu_dtype=float32"), F32),
    (("opt_type=muon", "mu_dtype=bfloat16"), BF16),  # Muon's momentum and its AdamW half's mu
])
def test_the_first_moment_is_kept_in_mu_dtype_else_weight_dtype(extra, mu):
    cfg, abstract = _abstract(*extra)
    mus, nus = _moments(abstract.opt_state, "mu"), _moments(abstract.opt_state, "nu")
    n_params = sum(x.size for x in jax.tree.leaves(abstract.params))
    assert sum(x.size for x in mus) == n_params  # every parameter's moment: none left out
    assert {np.dtype(x.dtype) for x in mus} == {mu}
    assert {np.dtype(x.dtype) for x in nus} == {np.dtype(cfg.weight_dtype)}  # the second moment: the weights'


class _Spy:
    """An optax transformation that notes the dtypes of the gradients it is given, then defers to `tx`."""

    def __init__(self, tx):
        self.seen, self.tx = [], tx

    def init(self, params):
        return self.tx.init(params)

    def update(self, grads, state, params=None):
        self.seen.append({np.dtype(g.dtype) for g in jax.tree.leaves(grads)})
        return self.tx.update(grads, state, params)


@pytest.mark.parametrize("extra, grads", [
    ((), F32),
    (("grad_dtype=bfloat16",), BF16),
    (("grad_dtype=bfloat16", "gradient_accumulation_steps=2", "per_device_batch_size=2"), BF16),
    (("weight_dtype=bfloat16",), BF16),  # a bfloat16 weight's gradient is never widened
])
def test_the_optimizer_is_given_gradients_in_grad_dtype(extra, grads):
    """The real step, traced (not compiled): what the optimizer receives."""
    built = build_lib.build(C.load([*SMALL, *extra]), jax.devices()[:1], num_processes=1)
    spy = _Spy(built.tx)
    fn = step_lib.jit_step(built.cfg, built.graphdef, spy, built.schedule, built.shardings, built.batch_sharding,
                           step_lib.lm_loss())
    B, T = built.cfg.global_batch_size, built.cfg.max_target_length
    batch = {k: jax.ShapeDtypeStruct((B, T), jnp.float32 if k == "weights" else jnp.int32)
             for k in ("inputs", "targets", "positions", "segment_ids", "weights")}
    jax.eval_shape(fn, built.abstract, batch)
    assert spy.seen == [{grads}]
    assert state_lib.grad_nbytes(built.cfg, built.abstract.params) == sum(
        x.size * grads.itemsize for x in jax.tree.leaves(built.abstract.params))  # what check_fits and the planner count


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def test_a_float32_run_resumes_with_bfloat16_moments_and_back(tmp_path):
    cfg, state, data = trained(tmp_path, steps=1, devices=1, mesh=("ici_fsdp_parallelism=1",))
    saver = Checkpointer(cfg, True, state_lib.nbytes(state))
    assert saver.save(1, state, data)
    saver.close()
    low = ["run_name=src", "mu_dtype=bfloat16", "grad_dtype=bfloat16"]
    built, started, data, c = start_built(tmp_path, low, 1)
    assert started.source == "checkpoint" and int(started.state.step) == 1
    saved_mu, got_mu = _host(_moments(state.opt_state, "mu")), _host(_moments(started.state.opt_state, "mu"))
    assert {a.dtype for a in got_mu} == {BF16}
    assert all(np.array_equal(a, b.astype(BF16)) for a, b in zip(got_mu, saved_mu))  # cast, not reset
    assert any(np.any(a) for a in got_mu)
    assert all(np.array_equal(a, b) for a, b in zip(_host(_moments(started.state.opt_state, "nu")),
                                                     _host(_moments(state.opt_state, "nu"))))
    assert all(np.array_equal(a, b) for a, b in zip(_host(started.state.params), _host(state.params)))
    # a bfloat16 step from it, saved, resumed as float32 again
    on, metrics = built.train_step(started.state, {k: jax.device_put(v, built.batch_sharding)
                                                   for k, v in next(data).items()})
    assert bool(metrics["finite"]) and {np.dtype(x.dtype) for x in _moments(on.opt_state, "mu")} == {BF16}
    assert c.save(2, on, data)
    c.close()
    _, back, _, c = start_built(tmp_path, ["run_name=src"], 1)
    c.close()
    assert int(back.state.step) == 2
    back_mu, on_mu = _host(_moments(back.state.opt_state, "mu")), _host(_moments(on.opt_state, "mu"))
    assert {a.dtype for a in back_mu} == {F32}
    assert all(np.array_equal(a, b.astype(F32)) for a, b in zip(back_mu, on_mu))


@pytest.mark.parametrize("key", ["mu_dtype", "grad_dtype"])
def test_an_unknown_dtype_is_refused_in_one_line(key):
    with pytest.raises(C.ConfigError) as e:
        C.load([*SMALL, f"{key}=float16"])
    message = str(e.value)
    assert len(message.splitlines()) == 1 and key in message and "float16" in message and "bfloat16" in message


def test_bfloat16_moments_and_gradients_train_like_float32():
    """Three steps from the same start on the same batches: the first loss is the same (no update
    yet), the next ones close to float32's and lower than the first."""
    runs = {}
    for name, extra in (("f32", ()), ("bf16", ("mu_dtype=bfloat16", "grad_dtype=bfloat16"))):
        runs[name], final = train_losses([*SMALL, "learning_rate=0.01", "warmup_steps_fraction=0", *extra], 1, 3)
        assert {np.dtype(x.dtype) for x in _moments(final.opt_state, "mu")} == ({BF16} if extra else {F32})
    assert runs["bf16"][0] == runs["f32"][0]
    np.testing.assert_allclose(runs["bf16"], runs["f32"], rtol=2e-2)
    assert runs["bf16"][-1] < runs["bf16"][0]
