"""The rollout engine's interface and the choice of engine (`rollout_engine`).

    engine = make_engine(cfg, graphdef)
    done = engine.generate(params, prompts, Sampling(max_new_tokens=64, temperature=1.0, generations=8,
                                                     eos_id=tok.eos_id, marker_ids=(im_end,),
                                                     top_k=50, top_p=0.95), key)

`prompts` are lists of token ids; completion g of prompt p is sequence p·G + g of the result. Each
completion holds its sampled tokens up to and including the one that ended it, the log-probability
of each under the sampling policy, and why it stopped: "eos" (the tokenizer's end of text),
"marker" (an end-of-turn marker id: the chat template's `<|im_end|>`) or "length" (max_new_tokens).

Log-probability under the sampling policy: log softmax(cut(logits / T))[token] in float32, the
distribution the token was drawn from (maxlite.models.decode.sample, `generate`'s rule too): the
logits / T cut to the `top_k` most likely tokens (0: no cut), then to the fewest top tokens holding
`top_p` of the rest (1: no cut), renormalised. With no cut at T = 1 that is the policy's own
log p(token), what the trainer recomputes (maxlite.step.token_logps) up to float32 rounding; with a
cut it is the renormalised distribution's (log p(token) − log of the kept mass), which is what an
importance ratio π / π_sampler must divide by, the cut being part of the behaviour policy; at T ≠ 1
it is the temperature-scaled distribution's, not the policy's (an importance ratio against the
trainer's log p needs the same scaling on the trainer's side); greedy (T = 0) reports the T = 1,
uncut value.

Importable without JAX (config_checks asks `refusal` before any work).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Protocol, Sequence

from maxlite.rollout.sampling import STOPS, Completions, Sampling  # noqa: F401 (the interface's)
from maxlite.schema import ConfigError

# each engine's class, "module:Class" (imported when chosen: the modules import JAX, vllm its own)
ENGINES = {"maxlite": "maxlite.rollout.continuous:ContinuousEngine", "vllm": ""}


class Engine(Protocol):
    def generate(self, params, prompts: Sequence[Sequence[int]], sampling: Sampling, key) -> Completions: ...


def refusal(name: str) -> str | None:
    """The one line saying why engine `name` cannot run here, or None."""
    if name == "vllm" and importlib.util.find_spec("vllm") is None:
        return ("rollout_engine=vllm needs the vllm package (GPU): pip install vllm, or set "
                "rollout_engine=maxlite")
    if name == "vllm":
        return "rollout_engine=vllm: the vLLM adapter is not written yet (issue 50); set rollout_engine=maxlite"
    if name not in ENGINES:
        return f"rollout_engine={name!r}: choose one of {', '.join(ENGINES)}"
    return None


def make_engine(cfg, graphdef) -> Engine:
    """The engine `cfg.rollout_engine` names, over the model `graphdef`."""
    if (why := refusal(cfg.rollout_engine)) is not None:
        raise ConfigError(why)
    if cfg.rollout_engine == "maxlite" and cfg.rollout_paged_kv:  # the paged cache (maxlite/rollout/paged.py)
        from maxlite.rollout.paged import PagedEngine
        return PagedEngine(cfg, graphdef, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.rollout_block_size,
                           cfg.rollout_num_blocks)
    module, _, name = ENGINES[cfg.rollout_engine].partition(":")
    return getattr(importlib.import_module(module), name)(cfg, graphdef, cfg.max_num_seqs, cfg.max_num_batched_tokens)
