"""Alignment objectives (maxlite/objectives/): DPO's loss and gradients against the published
formula computed in torch from the torch twin's log-probabilities; GRPO's advantages, clipping and
KL against a small numpy reference, and its reduction to the policy gradient; the preference
rows' masks; a GRPO run stopped and resumed ends at the uninterrupted run's parameters."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from maxlite import checkpoints, config as C, data, optim, step as step_lib
from maxlite.bridge import params as P
from maxlite.bridge import torch_model as TM
from maxlite.build import build
from maxlite.data import chat, preference
from maxlite.data.tokenizer import load_tokenizer
from maxlite.objectives import dpo, grpo, rl_loss, view
from maxlite.train import train
from tests.helpers import SMALL
from tests.xla_flags import cpu_xla_flags

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TINY = [*SMALL, "vocab_size=4096", "dtype=float32"]  # the bundled tokenizer's vocabulary


def _batch(argv, split="train"):
    cfg = build(C.load(argv), jax.devices()[:1], num_processes=1).cfg
    it = data.make_iterator(cfg, split, 0, 1)
    try:
        return next(it)
    finally:
        it.close()


def test_preference_rows_supervise_the_response_only():
    argv = [*TINY, "train_objective=dpo", "dataset_type=preference", "max_target_length=64",
            "per_device_batch_size=4"]
    cfg = C.load(argv)
    tok = load_tokenizer(cfg.tokenizer_path, cfg.bos_id, cfg.eos_id)
    template = chat.ChatTemplate.for_config(cfg, tok)
    pair = preference.parse_pair({"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"})
    for side, answer in (("chosen", "5"), ("rejected", "6")):
        ids, mask = preference.encode_response(template, pair["prompt"], pair[side])
        assert tok.decode(ids[mask].tolist()) == f"{answer}<|im_end|>"  # ChatML: the answer and its end
    batch = _batch(argv)
    for side in ("chosen", "rejected"):
        w = batch[f"{side}_weights"]
        assert w.shape == (4, 64) and np.all(w.sum(1) == 8)  # one number token + the 7 of <|im_end|>
        assert np.all(batch[f"{side}_segment_ids"][w > 0] == 1)
    assert preference.parse_pair({"prompt": "q", "chosen": 3, "rejected": "x"}).startswith("'chosen' must")


def test_dpo_loss_and_gradients_equal_the_formula_on_the_torch_twin():
    argv = [*TINY, "train_objective=dpo", "dataset_type=preference", "max_target_length=64",
            "per_device_batch_size=4", "dpo_beta=0.3", "dpo_label_smoothing=0.1", "scan_layers=false"]
    built = build(C.load(argv), jax.devices()[:1], num_processes=1)
    cfg = built.cfg
    policy = built.init_state().params
    ref = jax.tree.map(lambda x: x + 0.01 * jnp.sin(jnp.arange(x.size, dtype=x.dtype).reshape(x.shape)), policy)
    batch = {k: jnp.asarray(v) for k, v in _batch(argv).items()}
    fn = dpo.loss_fn(cfg)
    full = {**batch, **dpo.reference_logps(ref, built.graphdef, batch)}
    grads, means, pairs = step_lib.gradients(policy, built.graphdef, full, 1, fn)

    def logps(model, side):  # the twin's Σ log p over the response tokens
        b = {k: torch.as_tensor(np.array(v)) for k, v in view(batch, side + "_").items()}
        logp = torch.log_softmax(model(b["inputs"].long(), b["positions"].long(), b["segment_ids"]), -1)
        return (logp.gather(-1, b["targets"].long()[..., None])[..., 0] * b["weights"]).sum(-1)

    twin, twin_ref = TM.from_maxlite(cfg, P.to_pure(policy)), TM.from_maxlite(cfg, P.to_pure(ref))
    with torch.no_grad():
        ref_w, ref_l = logps(twin_ref, "chosen"), logps(twin_ref, "rejected")
    z = 0.3 * ((logps(twin, "chosen") - ref_w) - (logps(twin, "rejected") - ref_l))
    loss = (-(0.9) * torch.nn.functional.logsigmoid(z) - 0.1 * torch.nn.functional.logsigmoid(-z)).mean()
    loss.backward()
    assert float(pairs) == 4
    np.testing.assert_allclose(float(means["loss"]), loss.item(), rtol=1e-4)
    np.testing.assert_allclose(float(means["rewards/accuracies"]), float((z > 0).float().mean()), atol=1e-6)
    ours = dict(P.leaves(P.to_pure(grads)))
    for name, path in TM._leaf_names(twin).items():
        want = twin.get_parameter(name).grad.numpy()
        got = np.asarray(P.layer_leaf(P.to_pure(grads), cfg, path[1], path[2:]) if path[0] == "layers"
                         else ours[tuple(path)])
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-3, err_msg=name)


def test_grpo_terms_equal_a_numpy_reference():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    adv = grpo.advantages(rewards)
    want = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-4)
    np.testing.assert_allclose(adv, want, rtol=1e-6)
    assert np.all(adv[1] == 0)  # a group whose completions all score alike teaches nothing

    rng = np.random.default_rng(0)
    logp, old, ref = (rng.normal(-2, 0.3, (3, 5)) for _ in range(3))
    a = np.array([1.5, -0.7, 0.2])
    w = (rng.random((3, 5)) > 0.3).astype(np.float64)
    eps, beta = 0.2, 0.05
    ratio = np.exp(logp - old)
    loss = np.zeros_like(logp)
    clipped = np.zeros_like(logp)
    for i in range(3):
        for t in range(5):
            r = ratio[i, t]
            loss[i, t] = -min(r * a[i], min(max(r, 1 - eps), 1 + eps) * a[i])
            loss[i, t] += beta * (np.exp(ref[i, t] - logp[i, t]) - (ref[i, t] - logp[i, t]) - 1)
            clipped[i, t] = (r > 1 + eps and a[i] > 0) or (r < 1 - eps and a[i] < 0)
    sums, total, _ = rl_loss.token_terms(*(jnp.asarray(x, jnp.float32) for x in (logp, old, ref, a, w)),
                                         eps_low=eps, eps_high=eps, beta=beta)
    np.testing.assert_allclose(float(total), (w * loss).sum(), rtol=1e-5)
    np.testing.assert_allclose(float(sums["clip_ratio"]), (w * clipped).sum())
    assert 0 < (w * clipped).sum() < w.sum()  # the fixture exercises both sides of the clip


def test_grpo_without_kl_in_one_iteration_is_the_policy_gradient():
    argv = [*TINY, "train_objective=grpo", "dataset_type=prompts", "reward_functions=[maxlite.objectives.rewards:exact_answer]",
            "grpo_beta=0", "max_target_length=24", "grpo_max_new_tokens=4"]
    built = build(C.load(argv), jax.devices()[:1], num_processes=1)
    params = built.init_state().params
    rng = np.random.default_rng(1)
    rows = {"inputs": rng.integers(0, 4096, (4, 24)), "targets": rng.integers(0, 4096, (4, 24)),
            "positions": np.tile(np.arange(24), (4, 1)), "segment_ids": np.ones((4, 24)),
            "weights": (np.arange(24) >= 16) * np.ones((4, 1))}
    rows = {k: jnp.asarray(v, jnp.float32 if k == "weights" else jnp.int32) for k, v in rows.items()}
    adv = jnp.asarray([1.0, -1.0, 0.5, -0.5])
    batch = {**rows, "advantages": adv, "ref_logps": jnp.zeros((4, 24))}
    grads, _, n = step_lib.gradients(params, built.graphdef, batch, 1, grpo.loss_fn(built.cfg))
    pg = jax.grad(lambda p: -jnp.sum(rows["weights"] * adv[:, None] * step_lib.token_logps(p, built.graphdef, rows))
                  / jnp.sum(rows["weights"]))(params)
    assert float(n) == 32
    for (path, g), (_, want) in zip(P.leaves(P.to_pure(grads)), P.leaves(P.to_pure(pg))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), atol=1e-7, rtol=1e-4, err_msg=str(path))


def test_dpo_and_grpo_on_a_moe_model_add_its_auxiliary_losses():
    """What DPO and GRPO differentiate on a mixture of experts includes the router's auxiliary losses
    (load balance + z) of the policy's forward pass: per pair / per completion token exactly what the
    lm objective adds per token over the same rows (DPO: chosen and rejected together, as TRL's
    concatenated forward); and their metrics (what the step reports, divided by the denominator)."""
    argv = [*TINY, "model_name=tiny-moe", "base_moe_mlp_dim=32", "num_experts=4", "load_balance_loss_weight=0.5",
            "router_z_loss_weight=0.1", "train_objective=dpo", "dataset_type=preference", "max_target_length=64",
            "per_device_batch_size=4"]
    built = build(C.load(argv), jax.devices()[:1], num_processes=1)
    batch = {k: jnp.asarray(v) for k, v in _batch(argv).items()}
    pairs = {**batch, "ref_chosen_logps": jnp.zeros(4), "ref_rejected_logps": jnp.zeros(4)}
    rows = {k: jnp.concatenate([batch["chosen_" + k], batch["rejected_" + k]]) for k in view(batch, "chosen_")}
    sampled = {**rows, "advantages": jnp.linspace(-1.0, 1.0, 8), "ref_logps": jnp.zeros((8, 64))}  # GRPO's rows

    def losses(params):
        g = built.graphdef
        return (dpo.loss_fn(built.cfg)(params, g, pairs), grpo.loss_fn(built.cfg)(params, g, sampled),
                step_lib.loss_sums(params, g, rows))

    *objectives, (lm, (lm_sums, tokens)) = jax.jit(losses)(built.init_state().params)
    aux = (lm - lm_sums["loss"]) / tokens  # the lm objective's auxiliary terms per token
    assert float(aux) > 0.3  # 0.5 × a load-balancing loss near 1 (+ z)
    for name, (loss, (sums, denominator)) in zip(("dpo", "grpo"), objectives):
        np.testing.assert_allclose(float((loss - sums["loss"]) / denominator), float(aux), rtol=1e-5, err_msg=name)
        for key in ("moe_lb_loss", "moe_z_loss", "moe_load_max/0"):
            np.testing.assert_allclose(float(sums[key] / denominator), float(lm_sums[key] / tokens), rtol=1e-5,
                                       err_msg=f"{name} {key}")


@pytest.mark.parametrize("opt_type", ["adamw", "muon"])
def test_reference_is_the_start_and_moves_only_in_warm_up(opt_type):
    argv = [*TINY, "train_objective=dpo", "dataset_type=preference", "max_target_length=64",
            "per_device_batch_size=4", "alignment_sft_steps=1", "learning_rate=1e-2", "warmup_steps_fraction=0",
            f"opt_type={opt_type}"]
    built = build(C.load(argv), jax.devices()[:1], num_processes=1)
    state = built.init_state()
    start = P.to_pure(state.params)
    assert isinstance(state.opt_state, optim.WithReference)
    batch = {k: jax.device_put(v, built.batch_sharding) for k, v in _batch(argv).items()}
    with jax.set_mesh(built.mesh):
        state, warm = built.objective(state, batch, 0)  # warm-up: lm loss on the chosen side
        after_warm = P.to_pure(state.params)
        np.testing.assert_array_equal(P.to_pure(state.opt_state.ref)["embedding"], after_warm["embedding"])
        state, m = built.objective(state, batch, 1)  # DPO: policy = reference at its first step
    assert "rewards/margins" in m and "rewards/margins" not in warm
    # the same weights through two programs (the reference's forward, the policy's with its gradient):
    # equal up to float32 rounding
    assert float(m["rewards/margins"]) == pytest.approx(0.0, abs=1e-6)
    assert float(m["loss"]) == pytest.approx(np.log(2), rel=1e-6)
    assert not np.array_equal(after_warm["embedding"], start["embedding"])
    np.testing.assert_array_equal(P.to_pure(state.opt_state.ref)["embedding"], after_warm["embedding"])
    np.testing.assert_array_equal(P.to_pure(state.opt_state.ref)["layers"]["mlp"]["up"], after_warm["layers"]["mlp"]["up"])
    now = P.to_pure(state.params)
    for path in (("embedding",), ("layers", "mlp", "up")):  # AdamW's part and (with muon) Muon's both move
        before, after = after_warm, now
        for key in path:
            before, after = before[key], after[key]
        assert not np.array_equal(after, before), path


def _metrics(run_dir):
    return [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]


def test_grpo_run_stopped_and_resumed_ends_at_the_uninterrupted_parameters(tmp_path):
    argv = [*TINY, "train_objective=grpo", "dataset_type=prompts", "max_target_length=52",
            "reward_functions=[maxlite.objectives.rewards:exact_answer, maxlite.objectives.rewards:brevity]", "reward_weights=[1, 0.5]",
            "grpo_max_new_tokens=10", "grpo_num_generations=4", "per_device_batch_size=2", "alignment_sft_steps=2",
            "learning_rate=1e-2", "lr_schedule_type=constant", "warmup_steps_fraction=0", "grpo_iterations=2",
            "grpo_temperature=1.5",
            f"base_output_directory={tmp_path}", "checkpoint_period=0", "log_period=1", "eval_interval=0"]
    train(C.load([*argv, "steps=3", "run_name=a"]))
    train(C.load([*argv, "steps=5", "run_name=a"]))  # resumes from step 3's checkpoint
    train(C.load([*argv, "steps=5", "run_name=b"]))
    _, pa = checkpoints.load_params(f"{tmp_path}/a/checkpoints")
    _, pb = checkpoints.load_params(f"{tmp_path}/b/checkpoints")
    for (path, x), (_, y) in zip(P.leaves(P.to_pure(pa)), P.leaves(P.to_pure(pb))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))
    b = [r for r in _metrics(f"{tmp_path}/b") if "reward" in r]
    assert [r["step"] for r in b] == [3, 4, 5]  # GRPO after the two warm-up steps
    assert all(r["completion_length"] > 0 and r["reward"] > 0 and r["reward_std"] > 0 for r in b)
    assert any(r["kl"] > 0 for r in b) and all(r["sampling_seconds"] > 0 for r in b)


@pytest.mark.parametrize("objective, warm, period, fault, steps", [
    ("dpo", 6, 2, 4, 8),  # the NaN and the rollback inside the warm-up
    ("dpo", 6, 5, 8, 9),  # the NaN after the warm-up, the rollback into it (the command)
    ("grpo", 4, 2, 4, 6),  # the warm-up's last step goes bad: back inside it, then across the boundary
    ("grpo", 4, 2, 7, 8),  # a GRPO step goes bad (its sampled rows poisoned): back to a GRPO step's state
])
def test_a_rollback_runs_each_step_with_its_own_phase(tmp_path, objective, warm, period, fault, steps):
    """After a loss rollback every step runs the objective of its own number: the SFT warm-up's lm
    loss up to `alignment_sft_steps`, the alignment loss after (an objective counting its own calls
    ran the alignment loss too early once rolled back)."""
    data = {"dpo": ["dataset_type=preference", "max_target_length=64", "per_device_batch_size=4"],
            "grpo": ["dataset_type=prompts", "max_target_length=52", "per_device_batch_size=2",
                     "reward_functions=[maxlite.objectives.rewards:exact_answer]", "grpo_max_new_tokens=10",
                     "grpo_num_generations=4"]}[objective]
    argv = [*TINY, f"train_objective={objective}", *data, f"alignment_sft_steps={warm}", f"steps={steps}",
            f"checkpoint_period={period}", "log_period=1", "eval_interval=0", "fault_type=nan",
            f"fault_step={fault}", "inmemory_snapshot_period=0", f"base_output_directory={tmp_path}",
            "run_name=r"]
    train(C.load(argv))
    rollbacks = [json.loads(line) for line in open(f"{tmp_path}/r/rollbacks.jsonl")]
    assert [r["to_step"] for r in rollbacks] == [fault - 1 - (fault - 1) % period]
    last = {r["step"]: r for r in _metrics(f"{tmp_path}/r") if "step" in r}  # each step as it finally ran
    marker = {"dpo": "rewards/accuracies", "grpo": "reward"}[objective]
    assert sorted(last) == list(range(1, steps + 1))
    assert [s for s in last if marker in last[s]] == list(range(warm + 1, steps + 1))


def test_precomputed_dpo_reference_trains_like_the_in_step_reference(tmp_path):
    """With dpo_precompute_reference the optimizer state holds no copy of the weights, and a run —
    stopped and resumed from the saved table — gives the same losses, rewards and eval figures as
    the reference computed inside every step."""
    import os

    from maxlite import state as state_lib
    from maxlite.data import sources
    from maxlite.objectives import dpo_reference

    argv = [*TINY, "train_objective=dpo", "dataset_type=preference", "max_target_length=64",
            "per_device_batch_size=1", "learning_rate=1e-2", "lr_schedule_type=constant",
            "warmup_steps_fraction=0", "dpo_beta=0.5", f"base_output_directory={tmp_path}", "log_period=1",
            "eval_interval=2", "eval_steps=2", "checkpoint_period=2"]
    table = [*argv, "dpo_precompute_reference=true"]
    train(C.load([*argv, "steps=4", "run_name=live"]))
    train(C.load([*table, "steps=2", "run_name=table"]))
    train(C.load([*table, "steps=4", "run_name=table"]))  # resumes at step 2: loads the table
    live, tab = _metrics(f"{tmp_path}/live"), _metrics(f"{tmp_path}/table")
    for name in ("loss", "rewards/margins", "rewards/chosen", "eval_loss", "eval_rewards/margins"):
        a, b = [r[name] for r in live if name in r], [r[name] for r in tab if name in r]
        assert len(a) == len(b) >= 2 and a[-1] != a[0], name  # it trained, and both runs saw each figure
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=1e-6, err_msg=name)
    saved = np.load(f"{tmp_path}/table/{dpo_reference.FILE}")
    pairs = sum(1 for path in preference.BUNDLED["preference"]
                for _ in sources.iter_documents(path, (), sources.BadRecords("error"), preference.parse_pair))
    assert saved["values"].shape == (pairs, 2) and len(set(saved["keys"])) == pairs
    with_ref, without = (build(C.load(a), jax.devices()[:1], num_processes=1).abstract for a in (argv, table))
    assert state_lib.nbytes(with_ref) - state_lib.nbytes(without) == state_lib.nbytes(without.params)
    os.remove(f"{tmp_path}/table/{dpo_reference.FILE}")
    with pytest.raises(C.ConfigError, match="dpo_reference.npz is missing"):
        train(C.load([*table, "steps=6", "run_name=table"]))
    with pytest.raises(C.ConfigError, match="not in the precomputed reference table"):
        dpo_reference.Table(saved["keys"], saved["values"]).columns(np.array(["not-a-key"]), "t.npz")


def test_objective_config_errors_are_one_line():
    for argv, words in (
            (["dpo_precompute_reference=true"], "is for train_objective=dpo"),
            (["train_objective=dpo", "dataset_type=preference", "dpo_precompute_reference=true",
              "alignment_sft_steps=5"], "set alignment_sft_steps=0"),
            (["train_objective=grpo", "dataset_type=prompts"], "needs reward_functions"),
            (["train_objective=dpo"], "reads dataset_type=preference"),
            (["dataset_type=preference"], "is for train_objective=dpo"),
            (["train_objective=grpo", "dataset_type=prompts", "reward_functions=[nope]"],
             "not 'package.module:function'")):
        with pytest.raises(C.ConfigError, match=words):
            C.load(["base.yml", *argv])


def test_warm_up_has_its_own_learning_rate_and_the_schedule_spans_the_rest():
    cfg = C.load(["base.yml", "train_objective=dpo", "dataset_type=preference", "steps=30", "alignment_sft_steps=10",
                  "alignment_sft_learning_rate=3e-3", "learning_rate=1e-3", "warmup_steps_fraction=0.1",
                  "lr_schedule_type=linear", "learning_rate_final_fraction=0.1"])
    schedule = optim.learning_rate_schedule(cfg)
    # warm-up at 3e-3; then 2 warmup steps (10% of the 20 left) up to 1e-3, linear to 1e-4 at step 30
    for step, want in ((0, 3e-3), (9, 3e-3), (10, 0.0), (11, 5e-4), (12, 1e-3), (21, 5.5e-4), (30, 1e-4)):
        assert float(schedule(step)) == pytest.approx(want, rel=1e-5, abs=1e-9), step
    with pytest.raises(C.ConfigError, match="are for train_objective=dpo or grpo"):
        C.load(["base.yml", "alignment_sft_steps=5"])


def test_rollout_rows_train_on_exactly_the_sampled_tokens():
    """Greedy rollouts laid out as rows: every supervised target is the model's own argmax at that
    position of a full forward pass (the rows hold what was sampled, where it was sampled), and
    the prompt's tokens are never supervised."""
    from maxlite.objectives.rollout import Rollout

    argv = [*TINY, "train_objective=grpo", "dataset_type=prompts", "max_target_length=52",
            "reward_functions=[maxlite.objectives.rewards:exact_answer]", "grpo_max_new_tokens=10", "per_device_batch_size=4"]
    built = build(C.load(argv), jax.devices()[:1], num_processes=1)
    params = built.init_state().params
    batch = _batch(argv)
    scored = Rollout(built.cfg, built.graphdef)(params, batch, jax.random.key(0), greedy=True)
    rows = {k: jnp.asarray(v) for k, v in scored.rows.items()}
    logits = nnx.merge(built.graphdef, params)(rows["inputs"], rows["positions"], rows["segment_ids"])
    w = np.asarray(rows["weights"]) > 0
    assert np.all(w.sum(1) == scored.lengths) and scored.lengths.min() > 0
    np.testing.assert_array_equal(np.asarray(rows["targets"])[w], np.asarray(jnp.argmax(logits, -1))[w])
    for i, n in enumerate(batch["prompt_lengths"]):
        first = np.argmax(w[i])  # the first supervised target is the first token after the prompt
        assert first == n - 1 and np.array_equal(np.asarray(rows["inputs"][i, :n]), batch["prompt_ids"][i, :n])


def _recipe_run(recipe, cwd):
    """`python -m maxlite.train RECIPE` in an empty directory as a user runs it: one CPU device, XLA's
    default code generation (the tests' cheaper compile makes the rollout engine's many small decode
    steps about 4× slower: grpo.yml took over 600 s), the default (relative) output directory and run
    name. Its run directory."""
    import os
    import pathlib
    import subprocess
    import sys

    root = str(pathlib.Path(__file__).parents[1])
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(1, cheap_compile=False),
               PYTHONPATH=root)
    subprocess.run([sys.executable, "-m", "maxlite.train", recipe], cwd=cwd, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return cwd / "runs" / f"{recipe[:-4]}_tiny"


def _eval_rows(run_dir, key):
    return {r["step"]: r for r in _metrics(run_dir) if key in r}


@pytest.mark.slow
def test_dpo_recipe_improves_on_held_out_pairs(tmp_path):
    """The packaged dpo.yml: after its warm-up the eval pairs sit at the reference (loss ln 2, no
    reward margin); at the end DPO has lowered the held-out loss and the policy prefers the right
    sum more often than the reference did, over the last three evals (steps 160-200): the policy's
    accuracy on the 96 held-out pairs moves by up to 0.06 from one eval to the next once both
    answers' log-probs fall (0.885, 0.865, 0.802 at steps 160-200 against 0.771 at the reference on a
    2-core AMD EPYC without AVX-512), and a run whose DPO step does nothing stays at the reference."""
    cfg = C.load(["dpo.yml"])
    ev = _eval_rows(_recipe_run("dpo.yml", tmp_path), "eval_loss")
    ref, end = ev[cfg.alignment_sft_steps], ev[cfg.steps]
    assert ref["eval_loss"] == pytest.approx(np.log(2), abs=1e-4) and ref["eval_rewards/margins"] == 0
    assert end["eval_loss"] < np.log(2) - 0.1
    assert end["eval_rewards/accuracies"] >= 0.7 and end["eval_rewards/margins"] > 0.2
    last = [ev[s]["eval_policy_accuracy"] for s in sorted(ev)[-3:]]
    assert sorted(ev)[-3] > cfg.alignment_sft_steps and np.mean(last) >= ref["eval_policy_accuracy"] + 0.05, last


@pytest.mark.slow
def test_grpo_recipe_raises_the_reward(tmp_path):
    """The packaged grpo.yml: greedy eval reward on the arithmetic prompts over the last three evals of
    GRPO (steps 180-220) exceeds the warm-up's (the reference policy's) by a margin, and so does the
    sampled training reward of the last steps over the first GRPO steps. Three evals, not the last
    one: a policy under GRPO moves its greedy answers to 40 prompts by ±0.1 from one eval to the next
    (0.25 after the warm-up, then 0.55, 0.525, 0.425 at steps 180-220 in one run; 0.425, 0.375, 0.575
    in another of a few changes earlier; on a 2-core AMD EPYC without AVX-512, 0.275 after the
    warm-up, then 0.4, 0.5, 0.475), while a run whose policy-gradient step does nothing stays at the
    warm-up's."""
    cfg = C.load(["grpo.yml"])
    run = _recipe_run("grpo.yml", tmp_path)
    ev = _eval_rows(run, "eval_reward")
    last = [ev[s]["eval_reward"] for s in sorted(ev)[-3:]]
    assert sorted(ev)[-3] > cfg.alignment_sft_steps and sorted(ev)[-1] == cfg.steps
    assert np.mean(last) >= ev[cfg.alignment_sft_steps]["eval_reward"] + 0.15, last
    sampled = [r["reward"] for r in _metrics(run) if "reward" in r]
    assert len(sampled) == cfg.steps - cfg.alignment_sft_steps
    assert np.mean(sampled[-20:]) >= np.mean(sampled[:20]) + 0.15


@pytest.mark.parametrize("objective", ["dpo", "grpo"])
def test_dpo_and_grpo_run_on_a_gemma3_shaped_model_with_lora(objective, tmp_path):
    """The objectives on a family with local and global layers (window 4, shorter than prompt +
    rollout: the sampler's ring caches wrap) and LoRA adapters on its projections: finite losses,
    GRPO's rewards and sampled lengths recorded, the adapters move."""
    gemma = ["decoder_block=gemma3", "base_num_decoder_layers=6", "sliding_window=4", "local_rope_max_timescale=100",
             "query_pre_attn_scalar=16", "logits_via_embedding=true", "lora_rank=4", "lora_alpha=8",
             "lora_targets=[q_proj, v_proj, down_proj]"]
    extra = {"dpo": ["dataset_type=preference", "max_target_length=64", "per_device_batch_size=1"],
             "grpo": ["dataset_type=prompts", "max_target_length=52", "grpo_max_new_tokens=10",
                      "grpo_num_generations=4", "per_device_batch_size=2", "grpo_temperature=1.5",
                      "reward_functions=[maxlite.objectives.rewards:exact_answer, maxlite.objectives.rewards:brevity]"]}[objective]
    argv = [*TINY, *gemma, *extra, f"train_objective={objective}", "alignment_sft_steps=1", "learning_rate=1e-2",
            "lr_schedule_type=constant", "warmup_steps_fraction=0", "steps=3", "checkpoint_period=0", "log_period=1",
            "eval_interval=0", f"base_output_directory={tmp_path}", "run_name=r"]
    train(C.load(argv))
    rows = [r for r in _metrics(f"{tmp_path}/r") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in rows)
    if objective == "grpo":
        assert all(r["completion_length"] > 0 and np.isfinite(r["reward"]) for r in rows[1:])
    cfg, params = checkpoints.load_params(f"{tmp_path}/r/checkpoints")
    adapters = [np.asarray(x) for path, x in P.leaves(P.to_pure(params)) if str(path[-1]).endswith("_lora_b")]
    assert adapters and all(np.abs(a).max() > 0 for a in adapters)  # B starts at zero
