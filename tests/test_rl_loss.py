"""The RL losses (objectives/rl_loss.py through objectives/grpo.py's loss_fn): for every loss_algo ×
loss_agg_mode, the loss and its gradient w.r.t. the policy's log-probabilities on a fixed batch
equal a NumPy implementation written here from the papers' formulas (GRPO, GSPO-token, DAPO,
Dr. GRPO; truncated importance sampling); grpo's default is bitwise main's loss; the host's filters
and advantages; β = 0 keeps no reference; config errors are one line; two steps of gspo-token and
dapo runs log finite losses."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlite import config as C, optim, step as step_lib
from maxlite.build import build
from maxlite.objectives import grpo
from maxlite.train import train
from tests.helpers import SMALL

GRPO = ["base.yml", "train_objective=grpo", "dataset_type=prompts",
        "reward_functions=[maxlite.objectives.rewards:exact_answer]", "max_target_length=16", "grpo_max_new_tokens=6"]
L = 6  # grpo_max_new_tokens: Dr. GRPO's constant

# The documented defaults of each loss_algo (docs/alignment.md): aggregation, β, ε_high (ε_low 0.2).
DEFAULTS = {"grpo": ("token-mean", 0.04, 0.2), "gspo-token": ("sequence-mean-token-mean", 0.04, 0.2),
            "dapo": ("token-mean", 0.0, 0.28), "dr_grpo": ("sequence-sum", 0.04, 0.2)}
MODES = ("token-mean", "sequence-mean-token-mean", "sequence-sum")

# 4 completions × 6 positions: the prompt's positions and the padding after a completion that ended
# carry no weight; lengths 4, 2, 5, 1 (rows 1 and 3 ended early, 0 and 2 ran to the end).
W = np.array([[0, 0, 1, 1, 1, 1],
              [0, 1, 1, 0, 0, 0],
              [0, 1, 1, 1, 1, 1],
              [0, 0, 0, 0, 1, 0]], np.float64)
OLD = np.array([[-1.0, -2.0, -0.5, -1.5, -3.0, -0.8],
                [-2.2, -0.9, -1.1, -4.0, -0.3, -1.0],
                [-0.7, -1.3, -2.6, -0.4, -1.9, -2.1],
                [-1.4, -3.3, -0.6, -1.2, -0.9, -1.7]])
DELTA = np.array([[0.05, 0.0, 0.3, -0.3, 0.22, 0.1],  # logp − old (row 0's tokens: ratios 1.35, 0.74, 1.25, 1.11)
                  [-0.4, 0.35, 0.15, 0.2, 0.0, 0.1],
                  [0.1, -0.25, 0.05, 0.4, -0.1, 0.21],
                  [0.0, 0.2, -0.1, 0.3, -0.35, 0.0]])
LOGP = OLD + DELTA
REF = LOGP + np.array([[0.1, -0.2, 0.3, 0.05, -0.4, 0.2],
                       [0.2, 0.1, -0.3, 0.0, 0.1, -0.1],
                       [-0.15, 0.25, 0.1, -0.2, 0.3, 0.0],
                       [0.05, -0.05, 0.2, 0.1, 0.15, -0.3]])
SAMPLER = OLD + np.array([[0.0, 0.3, -0.9, 0.1, -0.2, 0.4],  # old − sampler: weights e^{−x}, some above 2
                          [0.1, -0.8, 0.2, 0.0, 0.3, -0.1],
                          [-0.3, 0.05, -1.0, 0.2, 0.1, -0.6],
                          [0.2, 0.0, 0.1, -0.2, 0.5, 0.0]])
ADV = np.array([1.0, -1.0, 0.5, -0.7])


def expected(algo, agg, eps_low, eps_high, beta, sampler=None, cap=2.0):
    """(loss, d loss / d logp [R, T], per-token means of kl and clip_ratio) from the formulas, in float64."""
    R, T = W.shape
    n = W.sum(1)
    if algo == "gspo-token":  # GSPO: s_i = (π/π_old)(y_i)^(1/|y_i|), the same for every token of row i
        ratio = np.repeat(np.exp((W * (LOGP - OLD)).sum(1) / n)[:, None], T, 1)
    else:
        ratio = np.exp(LOGP - OLD)
    loss_t, grad_t, clip_t = np.zeros((R, T)), np.zeros((R, T)), np.zeros((R, T))
    for i in range(R):
        for t in range(T):
            r, a = ratio[i, t], ADV[i]
            c = 1.0 if sampler is None else min(np.exp(OLD[i, t] - sampler[i, t]), cap)
            bounded = min(max(r, 1 - eps_low), 1 + eps_high)
            inside = 1 - eps_low < r < 1 + eps_high
            loss_t[i, t] = -c * min(r * a, bounded * a)
            # dρ/dlogp_t = ρ in both ratios (GSPO-token: sg[s] · d exp(logp_t − sg[logp_t]) = s)
            grad_t[i, t] = -c * r * a if (r * a <= bounded * a or inside) else 0.0
            clip_t[i, t] = (r > 1 + eps_high and a > 0) or (r < 1 - eps_low and a < 0)
    d = REF - LOGP
    kl = np.exp(d) - d - 1
    loss_t += beta * kl
    grad_t += beta * (1 - np.exp(d))
    if agg == "token-mean":
        k = W / W.sum()
    elif agg == "sequence-mean-token-mean":
        k = W / n[:, None] / (n > 0).sum()
    else:
        k = W / (L * R)
    return (k * loss_t).sum(), k * grad_t, (W * kl).sum() / W.sum(), (W * clip_t).sum() / W.sum()


def objective(cfg, with_sampler=False):
    """loss_fn(cfg) as a function of the policy's log-probabilities: (loss, metrics)."""
    batch = {"weights": jnp.asarray(W, jnp.float32), "advantages": jnp.asarray(ADV, jnp.float32),
             "ref_logps": jnp.asarray(REF, jnp.float32), "old_logps": jnp.asarray(OLD, jnp.float32)}
    if with_sampler:
        batch["sampler_logps"] = jnp.asarray(SAMPLER, jnp.float32)
    fn = grpo.loss_fn(cfg)

    def loss(logp):
        total, (sums, denominator) = fn(logp, None, batch)
        return total / denominator, {k: v / denominator for k, v in sums.items()}
    return loss


@pytest.fixture
def logps_are_the_params(monkeypatch):
    """The policy's forward replaced by its log-probabilities: loss_fn(params=logp)."""
    monkeypatch.setattr(step_lib, "token_logps_and_stats", lambda params, *a: (params, None))


@pytest.mark.parametrize("agg", ["", *MODES])
@pytest.mark.parametrize("algo", list(DEFAULTS))
def test_loss_and_gradient_equal_the_papers_formulas(logps_are_the_params, algo, agg):
    cfg = C.load([*GRPO, f"loss_algo={algo}", f"loss_agg_mode={agg}"])
    own_agg, beta, eps_high = DEFAULTS[algo]
    assert (cfg.rl_loss_agg_mode, cfg.rl_beta, cfg.rl_epsilon_high) == (agg or own_agg, beta, eps_high)
    want_loss, want_grad, want_kl, want_clip = expected(algo, agg or own_agg, 0.2, eps_high, beta)
    (loss, metrics), grad = jax.value_and_grad(objective(cfg), has_aux=True)(jnp.asarray(LOGP, jnp.float32))
    np.testing.assert_allclose(float(loss), want_loss, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=2e-5, atol=1e-8)
    np.testing.assert_allclose(float(metrics["clip_ratio"]), want_clip, rtol=1e-6)
    assert ("kl" in metrics) == (beta > 0)
    if beta:
        np.testing.assert_allclose(float(metrics["kl"]), want_kl, rtol=1e-5)
    assert 0 < want_clip < 0.5  # the fixture clips some tokens, not most


@pytest.mark.parametrize("algo", ["grpo", "gspo-token"])
def test_truncated_importance_sampling_weights_the_policy_term(logps_are_the_params, algo):
    cfg = C.load([*GRPO, f"loss_algo={algo}", "tis_cap=2.0"])
    _, beta, eps_high = DEFAULTS[algo]
    want_loss, want_grad, _, _ = expected(algo, DEFAULTS[algo][0], 0.2, eps_high, beta, sampler=SAMPLER, cap=2.0)
    (loss, metrics), grad = jax.value_and_grad(objective(cfg, with_sampler=True), has_aux=True)(
        jnp.asarray(LOGP, jnp.float32))
    np.testing.assert_allclose(float(loss), want_loss, rtol=2e-6)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=2e-5, atol=1e-8)
    c = np.minimum(np.exp(OLD - SAMPLER), 2.0)
    np.testing.assert_allclose(float(metrics["tis_ratio"]), (W * c).sum() / W.sum(), rtol=1e-6)
    assert (W * (np.exp(OLD - SAMPLER) > 2.0)).sum() > 0  # the cap binds on some token
    no_tis = objective(cfg)(jnp.asarray(LOGP, jnp.float32))
    assert "tis_ratio" not in no_tis[1] and float(no_tis[0]) != float(loss)


def _main_token_terms(logp, old_logp, ref_logp, adv_B, weights, epsilon, beta):
    """maxlite/objectives/grpo.py's token_terms on main before loss_algo (2839315), verbatim."""
    ratio = jnp.exp(logp - old_logp)
    a = adv_B[:, None]
    unclipped, clipped = ratio * a, jnp.clip(ratio, 1 - epsilon, 1 + epsilon) * a
    per_token = -jnp.minimum(unclipped, clipped)
    diff = ref_logp - logp
    kl = jnp.exp(diff) - diff - 1
    per_token = per_token + beta * kl
    is_clipped = ((ratio < 1 - epsilon) & (a < 0)) | ((ratio > 1 + epsilon) & (a > 0))
    loss = jnp.sum(weights * per_token)
    return {"loss": loss, "kl": jnp.sum(weights * kl), "clip_ratio": jnp.sum(weights * is_clipped)}, loss


def test_grpo_default_is_bitwise_the_loss_before_loss_algo(logps_are_the_params):
    """The default recipe's loss sum, denominator, metrics and gradient are main's, bit for bit; and
    the loss is a float32 NumPy evaluation of the same formula to rounding."""
    cfg = C.load(GRPO)
    assert (cfg.loss_algo, cfg.rl_loss_agg_mode, cfg.rl_beta, cfg.rl_epsilon_high) == ("grpo", "token-mean", 0.04, 0.2)
    f32 = {k: jnp.asarray(v, jnp.float32) for k, v in dict(logp=LOGP, old=OLD, ref=REF, adv=ADV, w=W).items()}
    batch = {"weights": f32["w"], "advantages": f32["adv"], "ref_logps": f32["ref"], "old_logps": f32["old"]}
    fn = grpo.loss_fn(cfg)
    for jit in (False, True):
        new = jax.value_and_grad(lambda lp: fn(lp, None, batch), has_aux=True)
        old = jax.value_and_grad(lambda lp: _main_token_terms(lp, f32["old"], f32["ref"], f32["adv"], f32["w"],
                                                              0.2, 0.04)[::-1], has_aux=True)
        if jit:
            new, old = jax.jit(new), jax.jit(old)
        (total, (sums, denominator)), grad = new(f32["logp"])
        (want_total, want_sums), want_grad = old(f32["logp"])
        assert np.asarray(total).tobytes() == np.asarray(want_total).tobytes()
        assert np.asarray(grad).tobytes() == np.asarray(want_grad).tobytes()
        assert np.asarray(denominator).tobytes() == np.float32(W.sum()).tobytes()
        for k in ("loss", "kl", "clip_ratio"):
            assert np.asarray(sums[k]).tobytes() == np.asarray(want_sums[k]).tobytes(), k
    # the same formula in NumPy float32 (exp may differ from XLA's by an ulp: to rounding, not bitwise)
    lp, o, r, a, w = (np.asarray(f32[k]) for k in ("logp", "old", "ref", "adv", "w"))
    ratio = np.exp(lp - o)
    per_token = -np.minimum(ratio * a[:, None], np.clip(ratio, np.float32(0.8), np.float32(1.2)) * a[:, None])
    d = r - lp
    per_token = per_token + np.float32(0.04) * (np.exp(d) - d - 1)
    np.testing.assert_allclose(float(total), float((w * per_token).sum(dtype=np.float32)), rtol=1e-6)


def test_host_filters_and_advantages():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.2, 0.9, 0.4, 0.4]])
    ended = np.array([1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 1], bool)
    keep, dropped = grpo.kept_rows(rewards, ended, dynamic=True, overlong=True)
    np.testing.assert_array_equal(keep, [1, 1, 0, 1, 0, 0, 0, 0, 0, 1, 1, 1])
    assert dropped == pytest.approx(1 / 3)
    keep, dropped = grpo.kept_rows(rewards, ended, dynamic=True, overlong=False)
    np.testing.assert_array_equal(keep, [1] * 4 + [0] * 4 + [1] * 4)
    keep, dropped = grpo.kept_rows(rewards, ended, dynamic=False, overlong=True)
    np.testing.assert_array_equal(keep, ended.astype(np.float32))
    assert dropped == 0
    mean = rewards.mean(1, keepdims=True)
    np.testing.assert_allclose(grpo.advantages(rewards, scale=False), rewards - mean, rtol=1e-6)  # Dr. GRPO
    np.testing.assert_allclose(grpo.advantages(rewards), (rewards - mean) / (rewards.std(1, keepdims=True) + 1e-4),
                               rtol=1e-6)


@pytest.mark.parametrize("extra, keeps", [([], True), (["grpo_beta=0"], False), (["loss_algo=dapo"], False),
                                          (["loss_algo=dapo", "grpo_beta=0.01"], True)])
def test_beta_zero_keeps_no_reference(extra, keeps):
    cfg = C.load([*SMALL, *GRPO[1:], "vocab_size=4096", *extra])
    state = build(cfg, jax.devices()[:1], num_processes=1).init_state()
    assert isinstance(state.opt_state, optim.WithReference) == keeps


@pytest.mark.parametrize("argv, words", [
    (["loss_algo=ppo"], "loss_algo"),
    (["loss_agg_mode=seq-mean-token-sum-norm"], "loss_agg_mode"),
    (["epsilon_high=-0.5"], "epsilon_high=-0.5: give a value ≥ 0, or -1"),
    (["grpo_beta=-0.1"], "grpo_beta=-0.1: give a value ≥ 0, or -1"),
    (["tis_cap=0"], "tis_cap")])
def test_bad_rl_loss_keys_fail_in_one_line(argv, words):
    with pytest.raises(C.ConfigError, match=words) as e:
        C.load([*GRPO, *argv])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("algo, extra", [("gspo-token", []),
                                         ("dapo", ["dynamic_sampling=true", "overlong_filtering=true"])])
def test_two_steps_of_each_loss_log_finite_losses(tmp_path, algo, extra):
    argv = [*SMALL, "vocab_size=4096", "dtype=float32", "train_objective=grpo", "dataset_type=prompts",
            "max_target_length=52", "grpo_max_new_tokens=10", "grpo_num_generations=4", "per_device_batch_size=2",
            "grpo_temperature=1.5", "grpo_iterations=2",
            "reward_functions=[maxlite.objectives.rewards:exact_answer, maxlite.objectives.rewards:brevity]",
            f"loss_algo={algo}", *extra, "learning_rate=1e-2", "lr_schedule_type=constant", "warmup_steps_fraction=0",
            "steps=2", "checkpoint_period=0", "log_period=1", "eval_interval=0", f"base_output_directory={tmp_path}",
            "run_name=r"]
    train(C.load(argv))
    rows = [json.loads(line) for line in open(f"{tmp_path}/r/metrics.jsonl")]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
    assert all(np.isfinite(r["reward"]) and 0 <= r["clip_ratio"] <= 1 for r in rows)
    assert all(("kl" in r) == (algo != "dapo") for r in rows)  # dapo: β = 0, no reference
    assert all(("groups_dropped" in r) == (algo == "dapo") for r in rows)
