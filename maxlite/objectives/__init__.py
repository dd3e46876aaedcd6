"""What a run optimises, `train_objective`: lm (next-token cross-entropy: pre-training, SFT), dpo
(preference pairs, objectives/dpo.py) or grpo (sampled completions scored by reward functions,
objectives/grpo.py). The alignment objectives keep their reference policy in the optimizer state
(objectives/reference.py) and may start with `alignment_sft_steps` warm-up steps of the lm loss on
the data's reference answers (DPO: the chosen responses; GRPO: the records' `answer`), whose end
becomes the reference. Every objective is a `(state, batch) → (state, metrics)` step for the same
loop, checkpoints, resume and launchers.
"""

from __future__ import annotations

OBJECTIVES = ("lm", "dpo", "grpo")
DATASET_OF = {"dpo": "preference", "grpo": "prompts"}  # the dataset_type each alignment objective reads


class Phased:
    """Warm-up steps (the lm loss on the chosen responses, moving the reference along), then the
    objective's step; the host counts steps itself after reading the state's counter once."""

    def __init__(self, warm, main, warm_steps: int):
        self.warm, self.main, self.warm_steps, self.step = warm, main, warm_steps, None

    def __call__(self, state, batch):
        import jax

        if self.step is None:
            self.step = int(jax.device_get(state.step))
        step, self.step = self.step, self.step + 1
        return (self.warm if step < self.warm_steps else self.main)(state, batch)


def make_train_step(cfg, graphdef, tx, schedule, shardings, batch_sharding):
    from maxlite import step as step_lib

    common = (cfg, graphdef, tx, schedule, shardings, batch_sharding)
    if cfg.train_objective == "grpo":
        from maxlite.objectives.grpo import GRPOStep
        return GRPOStep(*common)
    if cfg.train_objective == "dpo":
        from maxlite.objectives import dpo
        main = step_lib.jit_step(*common, dpo.loss_fn(cfg))
        if not cfg.alignment_sft_steps:
            return main
        lm = step_lib.lm_loss(cfg.z_loss_weight)
        warm = step_lib.jit_step(*common, lambda p, g, b, *a: lm(p, g, dpo.view(b, "chosen_"), *a),
                                 set_reference=True)
        return Phased(warm, main, cfg.alignment_sft_steps)
    return step_lib.jit_step(*common, step_lib.lm_loss(cfg.z_loss_weight))
