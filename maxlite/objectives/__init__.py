"""What a run optimises, `train_objective`: lm (next-token cross-entropy: pre-training, SFT), dpo
(preference pairs, objectives/dpo.py) or grpo (sampled completions scored by reward functions,
objectives/grpo.py, objectives/rewards.py). The alignment objectives keep their reference policy in
the optimizer state (optim.with_reference; DPO may instead read a table of its log-probabilities
computed before step 0, objectives/dpo_reference.py) and may start with `alignment_sft_steps`
warm-up steps of the lm loss on the data's reference answers (DPO: the chosen responses; GRPO: the
records' `answer`), whose end becomes the reference.

Every objective is an `Objective` the loop drives with its own step number: an objective keeps no
count of its own, so a resume or a rollback cannot leave it on the wrong phase.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

WARM_UP_ROWS = {"dpo": "chosen_", "grpo": "sft_"}  # the rows the warm-up's lm loss reads


def view(batch: dict, prefix: str) -> dict:
    """The `prefix`ed arrays of a batch under their plain names (chosen_inputs → inputs)."""
    return {k[len(prefix):]: v for k, v in batch.items() if k.startswith(prefix)}


class NoClock:
    """The loop's timing hooks when no loop times the step (tests, benchmarks)."""

    @contextlib.contextmanager
    def section(self, name: str, productive: bool = False):
        yield

    @contextlib.contextmanager
    def device_wait(self):
        yield

    def train_rows(self, step: int, rows: dict, prefix: str = "") -> dict:
        return rows


NO_CLOCK = NoClock()


class Objective:
    """The protocol the loop drives; the base is one compiled step (the lm objective).

        restore(state, step, files)      the run starts (fresh or resumed) or rolled back at `step`
                                         with `state`; `files` is the run directory (maxlite.rundir)
        __call__(state, batch, step, clock) → (state, metrics)
                                         runs step number `step` (the steps done before it);
                                         `clock.section(name)` / `clock.device_wait()` show the loop
                                         (watchdog, goodput, straggler timing) where its time goes;
                                         rows it makes itself (GRPO's samples) go through
                                         `clock.train_rows(step + 1, rows)` before they become a batch
        reads_ahead, read_ahead(peek)    how many batches past the loop's it samples from, and the
                                         loop's `peek` at them (GRPO's off_policy_steps)
        draw_from(draw, taken)           `draw()`: the next batch of the loop's own data (GRPO's refill,
                                         dynamic_sampling_max_batches): a batch drawn is the run's, its
                                         saved data position counts it; `taken()`: the batches taken
                                         so far by the loop and by draws (the next one's position)
        data_rows(step)                  the prefix of the data batch's rows step `step` trains on
                                         ("": all of them), or None: it trains on rows it makes
        compiled                         the main jitted step (what the planner and benchmarks lower)
        scorer                           the Evaluator's `score(params, opt_state, batches)`, or None
                                         (the lm loss)
    """

    scorer: Callable | None = None
    reads_ahead = 0  # batches past the loop's it reads (GRPO's off_policy_steps: maxlite/data/lookahead.py)

    def __init__(self, compiled: Callable, scorer: Callable | None = None):
        self.compiled, self.scorer = compiled, scorer

    def read_ahead(self, peek: Callable) -> None:
        """`peek(i)`: the i-th data batch after the one the loop took last (for reads_ahead > 0)."""

    def draw_from(self, draw: Callable, taken: Callable) -> None:
        """`draw()`: the next data batch of the loop's iterator (this process's rows), or None past its end;
        `taken()`: the batches of it taken so far (the global order's position of the next)."""

    def restore(self, state, step: int, files) -> None:
        pass

    def data_rows(self, step: int) -> str | None:
        return ""

    def __call__(self, state, batch, step: int, clock=NO_CLOCK) -> tuple[Any, dict]:
        with clock.device_wait():  # on CPU a dispatch may run the step inline, waiting for peers
            return self.compiled(state, batch)


class Phased(Objective):
    """`warm` for the steps before `warm_steps`, `main` from then on: chosen by the step number the
    loop passes, never by counting calls."""

    def __init__(self, warm: Objective, main: Objective, warm_steps: int, warm_rows: str = ""):
        self.warm, self.main, self.warm_steps, self.warm_rows = warm, main, warm_steps, warm_rows

    @property
    def compiled(self):
        return self.main.compiled

    @property
    def scorer(self):
        return self.main.scorer

    @property
    def reads_ahead(self):
        return self.main.reads_ahead

    def read_ahead(self, peek: Callable) -> None:
        self.main.read_ahead(peek)

    def draw_from(self, draw: Callable, taken: Callable) -> None:
        self.main.draw_from(draw, taken)

    def restore(self, state, step: int, files) -> None:
        self.main.restore(state, step, files)

    def data_rows(self, step: int) -> str | None:
        return self.main.data_rows(step) if step >= self.warm_steps else self.warm_rows

    def __call__(self, state, batch, step: int, clock=NO_CLOCK):
        if step >= self.warm_steps:
            return self.main(state, batch, step, clock)
        return self.warm(state, {k: v for k, v in batch.items() if not k.startswith("host_")}, step, clock)


def make_objective(cfg, graphdef, tx, schedule, shardings, batch_sharding) -> Objective:
    """The loop's objective for `cfg.train_objective`, its steps compiled with explicit shardings and
    the state donated."""
    from maxlite import step as step_lib

    common = (cfg, graphdef, tx, schedule, shardings, batch_sharding)
    if cfg.train_objective == "lm":
        return Objective(step_lib.jit_train_step(*common))
    if cfg.train_objective == "grpo":
        from maxlite.objectives.grpo import GRPOStep
        main = GRPOStep(*common)
    elif cfg.dpo_precompute_reference:  # config refuses it with a warm-up
        from maxlite.objectives.dpo_reference import PrecomputedStep
        return PrecomputedStep(*common)
    else:
        from maxlite.objectives import dpo
        main = Objective(step_lib.jit_step(*common, dpo.loss_fn(cfg)), dpo.eval_score(cfg, graphdef))
    if not cfg.alignment_sft_steps:
        return main
    lm, rows = step_lib.lm_loss(cfg.z_loss_weight), WARM_UP_ROWS[cfg.train_objective]
    warm = step_lib.jit_step(*common, lambda p, g, b, *a: lm(p, g, view(b, rows), *a), set_reference=True)
    return Phased(Objective(warm), main, cfg.alignment_sft_steps, rows)
