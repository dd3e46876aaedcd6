"""Periodic evaluation: the same `eval_steps` batches of the eval split every time → loss and
perplexity (lm); DPO's loss and reward accuracies against the reference; GRPO's mean reward of
greedy completions (objectives/)."""

from __future__ import annotations

import math


class Evaluator:
    def __init__(self, cfg, graphdef, params_shardings, batch_sharding, process_index: int,
                 process_count: int, train_step=None):
        from maxlite.step import jit_eval_step

        self.cfg, self.batch_sharding = cfg, batch_sharding
        self.where = (process_index, process_count)
        self.step_fn = jit_eval_step(graphdef, params_shardings, batch_sharding)
        self.train_step = train_step  # GRPO's: it samples
        if cfg.train_objective == "dpo":
            import functools

            import jax

            from maxlite.objectives import dpo
            self.dpo_fn = jax.jit(functools.partial(dpo.eval_step, graphdef=graphdef, cfg=cfg))

    def due(self, step: int) -> bool:
        return self.cfg.eval_interval > 0 and step % self.cfg.eval_interval == 0

    def run(self, params, opt_state=None) -> dict[str, float]:
        """Token-weighted mean loss over the eval batches (or the objective's figures); one host
        read at the end. `opt_state` holds an alignment run's reference policy."""
        from maxlite import data

        # A fresh iterator each time: every eval sees the very same batches, so values compare.
        batches = data.make_iterator(self.cfg, "eval", *self.where)
        try:
            if self.cfg.train_objective == "grpo":
                return self.train_step.evaluate(params, batches, self.cfg.eval_steps)
            if self.cfg.train_objective == "dpo":
                return self._dpo(params, opt_state, batches)
            return self._lm(params, batches)
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()

    def _batches(self, batches):
        import jax

        for _ in range(self.cfg.eval_steps):
            try:
                local = next(batches)
            except StopIteration:  # a small eval set: fewer batches than eval_steps
                break
            yield {k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in local.items()}

    def _dpo(self, params, opt_state, batches) -> dict[str, float]:
        """DPO's figures over the eval pairs: loss, reward accuracy and margin, policy accuracy."""
        from maxlite.objectives import reference
        from maxlite.state import split_trainable

        ref = reference.policy(opt_state, split_trainable(params)[1])
        totals = None
        for batch in self._batches(batches):
            out = self.dpo_fn(params, ref, batch)
            totals = out if totals is None else {k: totals[k] + out[k] for k in out}
        if totals is None:
            raise ValueError("the eval split gave no batch: check eval_dataset_path")
        pairs = max(float(totals.pop("pairs")), 1.0)
        return {k: float(v) / pairs for k, v in totals.items() if not k.startswith("logps/")}

    def _lm(self, params, batches) -> dict[str, float]:
        loss_sum = weights = 0.0
        count = 0
        for batch in self._batches(batches):
            out = self.step_fn(params, batch)
            loss_sum, weights = loss_sum + out["loss_sum"], weights + out["total_weights"]
            count += 1
        if count == 0:
            raise ValueError("the eval split gave no batch: check eval_dataset_path / eval_data_prefix")
        loss_sum, weights = float(loss_sum), float(weights)
        loss = loss_sum / max(weights, 1.0)
        return {"loss": loss, "perplexity": math.exp(min(loss, 80.0)), "tokens": weights, "batches": count}
