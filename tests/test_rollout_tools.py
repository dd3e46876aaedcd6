"""Multi-turn rollouts with tools (maxlite/rollout/tools.py, `rollout_tools`), on the real rollout
engine and a tiny random model. The tool-call end marker is a token the model emits greedily (read
from the static sampler, an independent path, not typed in): a call runs the tool it names with the
parsed argument, its answer's tokens are appended with no loss weight and no log-prob, and the next
turn equals greedy decoding of the whole context from scratch by the static sampler; a call that
raises, hangs, kills its worker, names no tool or does not parse is answered with an error and
counted; max_tool_turns stops; the GRPO loss over a tool rollout's rows equals a NumPy loss over the
same tokens with the tools' positions removed; bad tool config is refused in one line; a short GRPO
run with a tool logs the tool figures, and stopped and resumed samples the same tool rounds."""

import collections
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxlite import api, config as C
from maxlite.data.tokenizer import load_tokenizer
from maxlite.models import decode
from maxlite.objectives import rl_loss
from maxlite.rollout.continuous import ContinuousEngine
from maxlite.rollout.sampling import Sampling
from maxlite.rollout.tools import Tools
from maxlite.step import token_logps
from tests import tool_fns
from tests.helpers import SMALL, run_module

TINY = [*SMALL, "vocab_size=4096", "dtype=float32", "max_target_length=96"]  # the bundled tokenizer's vocabulary
FORMAT = "<tool_response>{answer}</tool_response>"
BUDGET = 64


@functools.cache
def _model():
    cfg = C.load(TINY)
    tok = load_tokenizer(cfg.tokenizer_path, cfg.bos_id, cfg.eos_id)
    graphdef, params = nnx.split(api.create_model(cfg, seed=3), nnx.Param)
    return cfg, tok, graphdef, params


def _static_greedy(contexts: list[list[int]], n: int) -> np.ndarray:
    """The static sampler (decode.generate_tokens, no end id): n greedy tokens after each context."""
    cfg, _, graphdef, params = _model()
    padded = np.zeros((len(contexts), max(map(len, contexts))), np.int32)
    for r, ids in zip(padded, contexts):
        r[:len(ids)] = ids
    return np.asarray(decode.generate_tokens(graphdef, params, jnp.asarray(padded),
                                             jnp.asarray([len(c) for c in contexts], jnp.int32), jax.random.key(0),
                                             max_new_tokens=n, temperature=0.0, top_k=0, top_p=1.0, eos_id=-1)[0])


def _marker(paths: np.ndarray, first: int) -> int:
    """The token most of the greedy paths first emit at a position ≥ `first`, among those that are one
    token of the tokenizer as text (what tool_call_end must be)."""
    tok = _model()[1]
    firsts = collections.Counter()
    for path in paths.tolist():
        firsts.update(t for k, t in enumerate(path) if k >= first and t not in path[:k])
    return next(t for t, _ in firsts.most_common() if tok.encode(tok.decode([t])).tolist() == [t])


def _tools(marker: int, names=("echo",), max_turns: int = 1, timeout: float = 5.0, response_format=FORMAT) -> Tools:
    tok = _model()[1]
    return Tools([f"tests.tool_fns:{n}" for n in names], tok, start="<tool_call>", end=tok.decode([marker]),
                 response_format=response_format, max_turns=max_turns, timeout_seconds=timeout, workers=2)


def _generate(tools: Tools, prompts: list[list[int]]):
    cfg, _, graphdef, params = _model()
    engine = ContinuousEngine(cfg, graphdef, max_num_seqs=4, max_num_batched_tokens=256)
    return tools.generate(engine, params, prompts, Sampling(BUDGET, temperature=0.0), jax.random.key(0))


def _encode(texts: list[str]) -> list[list[int]]:
    return [_model()[1].encode(t).tolist() for t in texts]


def _argument(text: str, name: str) -> str:
    """The plain call's argument, as docs/rl.md states it: after the last <tool_call>, stripped, the text
    after the tool's name and one space."""
    body = text.rsplit("<tool_call>", 1)[1].strip()
    assert body.startswith(name)
    rest = body[len(name):]
    return rest[1:] if rest[:1].isspace() else rest


def test_a_call_runs_its_tool_and_the_next_turn_is_greedy_decoding_of_the_whole_context():
    cfg, tok, graphdef, params = _model()
    prompts = _encode([f"What is {q}? <tool_call>echo " for q in ("2 + 3", "7 + 1", "4 + 4", "9 + 2", "5 + 5", "1 + 6")])
    paths = _static_greedy(prompts, 8)
    marker = _marker(paths, first=1)  # a call with an argument: at least one model token before its end
    tools = _tools(marker)
    try:
        got = _generate(tools, prompts)
    finally:
        tools.close()
    called = [i for i in range(len(prompts)) if got.calls[i] == 1]
    assert called and got.failures == got.timeouts == 0
    for i in set(range(len(prompts))) - set(called):  # no call: the plain greedy path, all the model's
        assert got.tokens[i].tolist() == _static_greedy(prompts[i:i + 1], BUDGET)[0].tolist() and got.model[i].all()
    for i in called:
        tokens, model = got.tokens[i].tolist(), got.model[i]
        k = paths[i].tolist().index(marker)
        assert tokens[:k + 1] == paths[i][:k + 1].tolist() and model[:k + 1].all()  # the first turn, to its end
        answer = tool_fns.echo(_argument(tok.decode(prompts[i] + tokens[:k]), "echo"))
        tool = tok.encode(FORMAT.replace("{answer}", answer)).tolist()
        assert len(answer) > len("echo[]")  # the model's own tokens were the argument
        end = k + 1 + len(tool)
        assert tokens[k + 1:end] == tool and not model[k + 1:end].any() and not got.logps[i][k + 1:end].any()
        after = tokens[end:]
        assert len(after) == BUDGET - end and model[end:].all() and got.turns[i] == 2
        # the next turn, from scratch through the static sampler on prompt + model turn + tool turn
        assert after == _static_greedy([prompts[i] + tokens[:end]], len(after))[0].tolist()
        # the model's tokens keep their sampling log-probs: the trainer's, recomputed over the whole row
        ids = np.asarray(prompts[i] + tokens, np.int32)[None]
        rows = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "positions": np.arange(ids.shape[1] - 1)[None],
                "segment_ids": np.ones_like(ids[:, :-1]), "weights": np.ones(ids[:, 1:].shape, np.float32)}
        theirs = np.asarray(token_logps(params, graphdef, {k: jnp.asarray(v) for k, v in rows.items()}))[0]
        np.testing.assert_allclose(got.logps[i][model], theirs[len(prompts[i]) - 1:][model], rtol=1e-5, atol=2e-5)


def test_a_json_call_passes_its_arguments_by_name():
    prompts = _encode(['What is 2 + 3? <tool_call>{"name": "echo", "arguments": {"text": "hi", "n": 2}} '])
    marker = int(_static_greedy(prompts, 1)[0, 0])  # the call ends at once: the JSON is the prompt's
    tools = _tools(marker)
    try:
        got = _generate(tools, prompts)
    finally:
        tools.close()
    tok = _model()[1]
    answer = tool_fns.echo(text="hi", n=2)
    tool = tok.encode(FORMAT.replace("{answer}", answer)).tolist()
    assert got.calls.tolist() == [1] and got.tokens[0][1:1 + len(tool)].tolist() == tool


def test_failing_calls_are_answered_with_an_error_and_counted():
    names = ["raises", "hangs", "dies", "nope", "{oops", "", "echo"]  # nope: no such tool; {oops, "": no call
    prompts = _encode([f"What is 2 + 3? <tool_call>{n} " for n in names])
    paths = _static_greedy(prompts, 1)
    marker = _marker(paths, first=0)
    assert (paths[:, 0] == marker).all()  # every call ends at once: each is the prompt's own
    tools = _tools(marker, names=("echo", "raises", "hangs", "dies"), timeout=1.0)
    try:
        got = _generate(tools, prompts)
        again = _generate(tools, prompts[-1:])  # the pool replaced the killed workers: a call still runs
    finally:
        tools.close()
    tok = _model()[1]
    assert got.calls.tolist() == [1] * len(names) and got.failures == 5 and got.timeouts == 1
    assert got.turns.tolist() == [2] * len(names)  # each went on after its answer (BUDGET leaves room)
    for i, name in enumerate(names):
        tool = tok.decode(got.tokens[i][~got.model[i]].tolist())
        if name == "echo":
            assert tool == FORMAT.replace("{answer}", "echo[]")
        else:
            assert tool.startswith("<tool_response>error: ") and tool.endswith("</tool_response>"), tool
    assert again.calls.tolist() == [1] and again.failures == 0


def test_max_tool_turns_ends_the_completion_on_the_call_past_it():
    tok = _model()[1]
    reopen = FORMAT + "<tool_call>echo "  # each answer opens the next call, as the prompt opens the first
    prompts = _encode([f"What is {q}? <tool_call>echo " for q in ("2 + 3", "7 + 1", "4 + 4", "9 + 2", "5 + 5")])
    # the marker: a prompt's first greedy token that greedy decoding emits again right after the first answer
    first = _static_greedy(prompts, 1)[:, 0].tolist()
    answer = tok.encode(reopen.replace("{answer}", tool_fns.echo(""))).tolist()
    again = _static_greedy([p + [m] + answer for p, m in zip(prompts, first)], 1)[:, 0].tolist()
    marker = next(m for m, a in zip(first, again) if m == a and tok.encode(tok.decode([m])).tolist() == [m])
    runs = {}
    for turns in (1, 3):
        tools = _tools(marker, names=("echo",), max_turns=turns, response_format=reopen)
        try:
            runs[turns] = _generate(tools, prompts)
        finally:
            tools.close()
    many, one = runs[3], runs[1]
    twice = [i for i in range(len(prompts)) if many.calls[i] >= 2]
    assert twice  # some completion called again after its first answer
    for i in twice:
        second = np.flatnonzero(many.tokens[i] == marker)[1]  # the second call's end (a model token)
        assert one.tokens[i].tolist() == many.tokens[i][:second + 1].tolist()
        assert one.calls[i] == 1 and one.turns[i] == 2 and one.stops[i] == "tool_turns"
    assert all(one.calls <= 1) and all(many.calls <= 3)


def test_the_loss_over_tool_rows_equals_the_loss_with_the_tool_positions_removed(monkeypatch):
    """GRPO's rows from a tool rollout (objectives/rollout.py): the loss (several algos and aggregations)
    equals a NumPy loss over the model's tokens alone, their positions taken from the tools' own record."""
    from maxlite.objectives.rollout import Rollout

    cfg, tok, graphdef, params = _model()
    texts = [f"What is 2 + 3? <tool_call>{n} " for n in ("echo", "nope")]
    prompts = _encode(texts)
    marker = _marker(_static_greedy(prompts, 1), first=0)
    rcfg = dataclasses.replace(C.load([*TINY, "train_objective=grpo", "dataset_type=prompts", "reward_workers=1",
                                       "reward_functions=[maxlite.objectives.rewards:brevity]", "tool_workers=1",
                                       f"grpo_max_new_tokens={BUDGET}", "rollout_tools=[tests.tool_fns:echo]"]),
                               tool_call_end=tok.decode([marker]))
    padded = np.zeros((2, 40), np.int32)
    for r, ids in zip(padded, prompts):
        r[:len(ids)] = ids
    batch = {"prompt_ids": padded, "prompt_lengths": np.array([len(p) for p in prompts], np.int32),
             "host_records": np.array([json.dumps({"answer": "5"})] * 2)}
    rollout = Rollout(rcfg, graphdef)
    try:
        scored = rollout(params, batch, jax.random.key(0), greedy=True)
        _, _, turns = rollout.sample_engine(params, padded, batch["prompt_lengths"], jax.random.key(0), greedy=True)
    finally:
        rollout.tools.close()
        rollout.scorer.close()
    assert scored.tool_calls == 2 and scored.tool_failures == 1 and scored.turns.tolist() == [2, 2]
    rows = {k: jnp.asarray(v) for k, v in scored.rows.items()}
    logp = np.asarray(token_logps(params, graphdef, rows), np.float64)
    rng = np.random.default_rng(0)
    old, ref = logp + rng.normal(0, 0.3, logp.shape), logp + rng.normal(0, 0.3, logp.shape)
    adv = np.array([1.0, -0.7])
    # the model's tokens' places in each row (a completion token j is the target at prompt_length − 1 + j)
    places = [len(p) - 1 + np.flatnonzero(m) for p, m in zip(prompts, turns.model)]
    assert [len(x) for x in places] == scored.lengths.tolist() and all(x.max() < 96 for x in places)
    assert all((~m).any() for m in turns.model)  # each row holds tool tokens
    for algo, agg, beta in [("grpo", "token-mean", 0.04), ("grpo", "sequence-mean-token-mean", 0.0),
                            ("gspo-token", "sequence-mean-token-mean", 0.0), ("dr_grpo", "sequence-sum", 0.0)]:
        _, loss, denominator = rl_loss.token_terms(
            jnp.asarray(logp, jnp.float32), jnp.asarray(old, jnp.float32), jnp.asarray(ref, jnp.float32),
            jnp.asarray(adv, jnp.float32), rows["weights"], algo=algo, agg=agg, eps_low=0.2, eps_high=0.2,
            beta=beta, max_new_tokens=BUDGET)
        want = _numpy_loss([logp[r, x] for r, x in enumerate(places)], [old[r, x] for r, x in enumerate(places)],
                           [ref[r, x] for r, x in enumerate(places)], adv, algo, agg, beta)
        np.testing.assert_allclose(float(loss / denominator), want, rtol=2e-5, err_msg=f"{algo} {agg}")


def _numpy_loss(logp, old, ref, adv, algo, agg, beta, eps=0.2):
    """The clipped objective over per-row arrays of the kept tokens only (objectives/rl_loss.py's formulas)."""
    per_row = []
    for x, o, f, a in zip(logp, old, ref, adv):
        ratio = np.exp(np.full_like(x, np.mean(x - o))) if algo == "gspo-token" else np.exp(x - o)
        term = -np.minimum(ratio * a, np.clip(ratio, 1 - eps, 1 + eps) * a)
        per_row.append(term + beta * (np.exp(f - x) - (f - x) - 1))
    if agg == "token-mean":
        return np.concatenate(per_row).sum() / sum(map(len, per_row))
    if agg == "sequence-mean-token-mean":
        return np.mean([t.mean() for t in per_row])
    return sum(t.sum() for t in per_row) / BUDGET / len(per_row)


@pytest.mark.parametrize("extra, match", [
    (["max_tool_turns=2"], "max_tool_turns is read only with rollout_tools"),
    (["rollout_tools=[tests.tool_fns:echo, other.module:echo]"], "two tools are called 'echo'"),
    (["rollout_tools=[nope]"], "is not 'package.module:function'"),
    (["rollout_tools=[tests.tool_fns:echo]", "tool_response_format=plain"], "holding {answer}"),
    (["rollout_tools=[tests.tool_fns:echo]", "max_num_batched_tokens=32"], "raise max_num_batched_tokens"),
])
def test_bad_tool_config_is_refused_in_one_line(extra, match):
    with pytest.raises(C.ConfigError, match=match):
        C.load([*TINY, "train_objective=grpo", "dataset_type=prompts",
                "reward_functions=[maxlite.objectives.rewards:brevity]", *extra])


@pytest.mark.parametrize("extra, match", [
    (["rollout_tools=[tests.tool_fns:missing]"], "rollout_tools: cannot load 'tests.tool_fns:missing'"),
    (["rollout_tools=[no_such_module.tools:f]"], "rollout_tools: cannot load 'no_such_module.tools:f'"),
    (["rollout_tools=[tests.tool_fns:echo]"], r"tool_call_end='</tool_call>' is \d+ tokens of this tokenizer"),
])
def test_tools_the_rollout_cannot_run_are_refused_when_it_is_built(extra, match):
    from maxlite.objectives.rollout import Rollout

    cfg, _, graphdef, _ = _model()
    rcfg = C.load([*TINY, "train_objective=grpo", "dataset_type=prompts", "reward_workers=1",
                   "reward_functions=[maxlite.objectives.rewards:brevity]", *extra])
    with pytest.raises(C.ConfigError, match=match):
        Rollout(rcfg, graphdef)


def test_tools_on_several_processes_are_refused_with_the_process_count():
    # several processes sample with the static sampler, which has no tool turns: refused where the recipe
    # is resolved for its processes (ray_entry.train does that before any cluster starts)
    cfg = C.load([*TINY, "train_objective=grpo", "dataset_type=prompts", "rollout_tools=[tests.tool_fns:echo]",
                  "tool_call_end=<", "reward_functions=[maxlite.objectives.rewards:brevity]"])
    C.resolve(cfg, 2, num_processes=1)
    with pytest.raises(C.ConfigError, match=r"rollout_tools runs on the rollout engine, which samples in one "
                                            r"process \(this run has 2;.*under Ray: ray_num_workers=1") as e:
        C.resolve(cfg, 2, num_processes=2)
    assert "\n" not in str(e.value)


def test_a_grpo_run_with_a_tool_logs_the_tool_figures_and_resumes_to_the_same_rollouts(tmp_path):
    """`python -m maxlite.train` (a short GRPO run): the ChatML generation prompt "<|im_start|>assistant\\n"
    opens a call to the tool `assistant` when tool_call_start is "<|im_start|>", and the token "<" (the
    first of "<|im_end|>", which the warm-up teaches) ends it. Stopped after step 7 and resumed, the
    run's step 8 samples the same tool rounds (same figures) and ends at the same parameters."""
    from maxlite import checkpoints
    from maxlite.bridge import params as P

    argv = [*TINY, "train_objective=grpo", "dataset_type=prompts", "reward_functions=[maxlite.objectives.rewards:exact_answer]",
            "grpo_max_new_tokens=40", "grpo_num_generations=4", "per_device_batch_size=2", "alignment_sft_steps=6",
            "learning_rate=1e-2", "rollout_tools=[tests.tool_fns:assistant, tests.tool_fns:raises]",
            "tool_call_start=<|im_start|>", "tool_call_end=<", "max_tool_turns=2", "tool_workers=1", "reward_workers=1",
            "lr_schedule_type=constant", "warmup_steps_fraction=0",
            f"base_output_directory={tmp_path}", "checkpoint_period=0", "log_period=1", "eval_interval=0"]
    for extra in (["steps=8", "run_name=tools"], ["steps=7", "run_name=again"], ["steps=8", "run_name=again"]):
        codes, outs = run_module("maxlite.train", [*argv, *extra], devices=1)
        assert codes == [0], outs[0][-3000:]
    assert "maxlite: resumed from step 7" in outs[0]
    rows = [json.loads(line) for line in open(tmp_path / "tools" / "metrics.jsonl")]
    grpo_rows = [r for r in rows if "reward" in r]
    assert [r["step"] for r in grpo_rows] == [7, 8]
    for r in grpo_rows:
        assert {"tool_calls", "tool_failures", "tool_timeouts", "turns"} <= set(r)
        assert r["tool_failures"] <= r["tool_calls"] and r["turns"] >= 1
    assert sum(r["tool_calls"] for r in grpo_rows) > 0 and max(r["turns"] for r in grpo_rows) > 1
    resumed = [json.loads(line) for line in open(tmp_path / "again" / "metrics.jsonl")]
    last = [r for r in resumed if r.get("step") == 8 and "reward" in r]
    figures = ("reward", "tool_calls", "tool_failures", "tool_timeouts", "turns", "completion_length", "loss")
    assert [{k: r[k] for k in figures} for r in last] == [{k: grpo_rows[-1][k] for k in figures}]
    _, pa = checkpoints.load_params(str(tmp_path / "tools" / "checkpoints"))
    _, pb = checkpoints.load_params(str(tmp_path / "again" / "checkpoints"))
    for (path, x), (_, y) in zip(P.leaves(P.to_pure(pa)), P.leaves(P.to_pure(pb))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))
