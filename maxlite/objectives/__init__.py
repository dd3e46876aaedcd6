"""What a run optimises, `train_objective`: lm (next-token cross-entropy: pre-training, SFT), dpo
(preference pairs, objectives/dpo.py) or grpo (sampled completions scored by reward functions,
objectives/grpo.py). The alignment objectives keep their reference policy in the optimizer state
(optim.with_reference; DPO may instead read a table of its log-probabilities computed before step
0, objectives/dpo_reference.py) and may start with `alignment_sft_steps` warm-up steps of the lm
loss on the data's reference answers (DPO: the chosen responses; GRPO: the records' `answer`),
whose end becomes the reference. Every objective is a `(state, batch) → (state, metrics)` step for
the same loop, checkpoints, resume and launchers, and supplies the Evaluator's scorer.
"""

from __future__ import annotations

WARM_UP_ROWS = {"dpo": "chosen_", "grpo": "sft_"}  # the rows the warm-up's lm loss reads


def view(batch: dict, prefix: str) -> dict:
    """The `prefix`ed arrays of a batch under their plain names (chosen_inputs → inputs)."""
    return {k[len(prefix):]: v for k, v in batch.items() if k.startswith(prefix)}


class Phased:
    """The warm-up's compiled steps, then the objective's step. The host counts steps itself after
    reading the state's counter once, so choosing costs no device sync."""

    def __init__(self, warm, main, warm_steps: int):
        self.warm, self.main, self.warm_steps, self.step = warm, main, warm_steps, None

    def __call__(self, state, batch):
        import jax

        if self.step is None:
            self.step = int(jax.device_get(state.step))
        step, self.step = self.step, self.step + 1
        if step >= self.warm_steps:
            return self.main(state, batch)
        return self.warm(state, {k: v for k, v in batch.items() if not k.startswith("host_")})

    def __getattr__(self, name):  # the objective's own methods (GRPO's evaluate)
        return getattr(self.main, name)


def make_train_step(cfg, graphdef, tx, schedule, shardings, batch_sharding):
    """The loop's step for `cfg.train_objective`, compiled with explicit shardings, state donated."""
    from maxlite import step as step_lib

    common = (cfg, graphdef, tx, schedule, shardings, batch_sharding)
    if cfg.train_objective == "lm":
        return step_lib.jit_train_step(*common)
    if cfg.train_objective == "grpo":
        from maxlite.objectives.grpo import GRPOStep
        main = GRPOStep(*common)
    elif cfg.dpo_precompute_reference:  # config refuses it with a warm-up
        from maxlite.objectives.dpo_reference import PrecomputedStep
        return PrecomputedStep(*common)
    else:
        from maxlite.objectives import dpo
        main = step_lib.jit_step(*common, dpo.loss_fn(cfg))
    if not cfg.alignment_sft_steps:
        return main
    lm, rows = step_lib.lm_loss(cfg.z_loss_weight), WARM_UP_ROWS[cfg.train_objective]
    warm = step_lib.jit_step(*common, lambda p, g, b, *a: lm(p, g, view(b, rows), *a), set_reference=True)
    return Phased(warm, main, cfg.alignment_sft_steps)


def before_loop(train_step, state, run_dir: str, primary: bool) -> None:
    """What the objective's step does once the starting state exists, before step 0 (a precomputed
    DPO reference: the table of its log-probabilities, computed or loaded)."""
    prepare = getattr(train_step, "before_loop", None)
    if prepare is not None:
        prepare(state, run_dir, primary)


def eval_score(cfg, graphdef, train_step):
    """The Evaluator's scorer for this objective (None: the lm loss). A step object that scores
    itself supplies `evaluate` (GRPO samples with its compiled sampler; a precomputed DPO
    reference adds its table's columns)."""
    own = getattr(train_step, "evaluate", None)
    if own is not None:
        return own
    if cfg.train_objective == "dpo":
        from maxlite.objectives import dpo
        return dpo.eval_score(cfg, graphdef)
    return None
