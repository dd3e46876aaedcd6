"""GRPO's rewards (maxlite/objectives/rewards.py, reward_pool.py, math_reward.py, rl_eval.py): reward
functions run in real worker processes, where a raise, a dead worker or a hang scores those
completions 0 and is counted (the time limit injected; nothing here measures time); Math-Verify's
answers; the format rewards; pass@k against its definition; the bundled word problems; the
packaged grpo_math.yml recipe."""

import itertools
import json
import math
import os
import pathlib

import pytest
import zstandard

from maxlite import config as C
from maxlite.data import preference
from maxlite.data.bundled import build_word_problems
from maxlite.objectives import math_reward, rewards, rl_eval
from maxlite.train import train
from tests.helpers import SMALL

LIMIT = 60.0  # seconds: far above any healthy call here, for the tests where nothing should time out


@pytest.fixture
def scorer():
    made = []

    def make(names, weights=(), timeout=LIMIT, workers=2):
        made.append(rewards.Scorer(names, weights, timeout, workers))
        return made[-1]
    yield make
    for s in made:
        s.close()


def _score(scorer_, completions, answer="12"):
    return scorer_(["q"] * len(completions), completions, [{"answer": answer}] * len(completions))


def test_weighted_functions_run_in_worker_processes(scorer):
    s = scorer(["maxlite.objectives.rewards:exact_answer", "tests.reward_fns:length", "tests.reward_fns:pid"],
               [1.0, 0.5, 0.0])
    got = _score(s, ["12", "7", "123"])
    assert got == rewards.Scores([1.0 + 1.0, 0.5, 1.5], 0, 0)
    pids = s.pool.run([("tests.reward_fns:pid", ([], ["x"], []))])[0].value
    assert pids[0] != os.getpid()


def test_a_function_that_raises_scores_its_batch_zero_and_is_counted(scorer, capsys):
    s = scorer(["tests.reward_fns:raises", "tests.reward_fns:length"])
    for _ in range(2):  # counted every time, said once
        assert _score(s, ["ab", "abc"]) == rewards.Scores([2.0, 3.0], 2, 0)
    said = capsys.readouterr().out
    assert said.count("reward function tests.reward_fns:raises raised ValueError: this reward function is broken") == 1


def test_a_hanging_function_is_cut_at_the_time_limit_counted_and_its_worker_replaced(scorer):
    s = scorer(["tests.reward_fns:hangs", "tests.reward_fns:length"], timeout=2.0, workers=1)
    first = s.pool.workers
    assert _score(s, ["ab", "abc"]) == rewards.Scores([2.0, 3.0], 0, 2)
    pid = s.pool.workers[0].process.pid
    assert _score(s, ["a"]) == rewards.Scores([1.0], 0, 1)  # the fresh worker scores, and is cut again
    assert s.pool.workers[0].process.pid != pid and first is s.pool.workers


def test_a_worker_that_dies_is_counted_and_replaced(scorer):
    s = scorer(["tests.reward_fns:dies", "tests.reward_fns:length"], workers=1)
    assert _score(s, ["ab", "abc"]) == rewards.Scores([2.0, 3.0], 2, 0)
    assert _score(s, ["abcd"]) == rewards.Scores([4.0], 1, 0)


def test_a_per_completion_function_loses_only_the_completions_that_fail(scorer):
    s = scorer(["tests.reward_fns:hangs_on_hang"], timeout=2.0)
    assert _score(s, ["a", "hang", "b", "die", "c"]) == rewards.Scores([1.0, 0.0, 1.0, 0.0, 1.0], 1, 1)


@pytest.mark.parametrize("name, message", [
    ("one_too_many", "reward function tests.reward_fns:one_too_many returned 3 values for 2 completions"),
    ("not_numbers", "reward function tests.reward_fns:not_numbers returned a list, not a list of numbers"),
])
def test_a_wrong_return_stops_the_run_in_one_line(scorer, name, message):
    with pytest.raises(C.ConfigError, match=f"^{message}$"):
        _score(scorer([f"tests.reward_fns:{name}"]), ["a", "b"])


def test_math_verify_checks_the_final_answer(scorer):
    s = scorer(["maxlite.objectives.math_reward:math_verify"])
    completions = ["\\boxed{12}", "5 + 7 is 12", "\\boxed{12.0}.", "\\boxed{\\frac{24}{2}}", "\\boxed{13}",
                   "12, no: \\boxed{13}", "twelve", "13 then 12"]
    assert _score(s, completions).total == [1, 1, 1, 1, 0, 0, 0, 1]
    assert _score(s, ["\\boxed{0.5}", "\\boxed{1/2}", "1/3"], answer="\\frac{1}{2}").total == [1, 1, 0]
    assert s(["q"], ["12"], [{}]) == rewards.Scores([0.0], 1, 0)  # a record without an answer: counted


def test_math_verify_that_hangs_on_an_answer_is_cut_and_counted(scorer):
    """Math-Verify itself never returns on 9^(9^(9^9)) against 12 (its own timeouts off: the pool's
    limit bounds it): that answer scores 0 as a timeout, the others are verified."""
    s = scorer(["maxlite.objectives.math_reward:math_verify"], timeout=3.0)
    assert _score(s, ["\\boxed{12}", "\\boxed{9^{9^{9^{9}}}}", "\\boxed{11}"]) == rewards.Scores([1, 0, 0], 0, 1)


def test_format_rewards():
    boxed = ["The sum is \\boxed{12}", "\\boxed{12}.", "\\boxed{\\frac{1}{2}}$", "\\boxed{1} then \\boxed{2}",
             "\\boxed{12} and more", "12", "\\boxed{}", "\\boxed{12"]
    assert rewards.boxed_format([], boxed, []) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert rewards.last_boxed("a \\boxed{x{y}} b") == (2, 14, "x{y}")
    think = ["<think>7 + 5</think><answer>12</answer>", " <think></think>\n<answer>12</answer>\n",
             "<answer>12</answer>", "<think>a</think><answer>12</answer> extra",
             "<think><think></think><answer>1</answer>", "<think>a</think><answer></answer>"]
    assert rewards.think_answer_format([], think, []) == [1, 1, 0, 0, 0, 0]
    assert [math_reward.answer_text(c) for c in ("x \\boxed{3} y", "1, 2 and 1,000", "none")] == \
        ["\\boxed{3}", "1,000", None]


@pytest.mark.parametrize("n, c, k", [(n, c, k) for n in (1, 2, 5, 8) for c in range(n + 1) for k in range(1, n + 1)])
def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_pass(n, c, k):
    """Its definition: of the C(n, k) ways to draw k of the n samples (c pass), the share that
    draws at least one passing sample."""
    samples = [True] * c + [False] * (n - c)
    draws = list(itertools.combinations(range(n), k))
    want = sum(any(samples[i] for i in d) for d in draws) / len(draws)
    assert len(draws) == math.comb(n, k)
    assert rl_eval.pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def _records(path):
    with open(path, "rb") as f:
        return [json.loads(line) for line in zstandard.ZstdDecompressor().stream_reader(f).read().decode().splitlines()]


def test_word_problems_are_the_build_scripts_and_the_eval_split_is_held_out(tmp_path):
    build_word_problems.main(str(tmp_path))
    train_path, eval_path = preference.BUNDLED_PROMPTS["word_problems"]
    bundled = {split: _records(path) for split, path in (("train", train_path), ("eval", eval_path))}
    for split in bundled:
        assert _records(tmp_path / f"word_problems_{split}.jsonl.zst") == bundled[split]  # rebuilt: the same
    assert (len(bundled["train"]), len(bundled["eval"])) == (build_word_problems.TRAIN, build_word_problems.EVAL)
    prompts = {split: {r["prompt"] for r in records} for split, records in bundled.items()}
    assert len(prompts["train"]) == len(bundled["train"]) and len(prompts["eval"]) == len(bundled["eval"])
    assert not prompts["train"] & prompts["eval"]
    for r in bundled["train"] + bundled["eval"]:
        assert 0 <= int(r["answer"]) <= 99 and r["completion"] == f"\\boxed{{{r['answer']}}}"


def test_bundled_prompts_picks_the_set_and_is_refused_beside_a_path():
    grpo = ["base.yml", "train_objective=grpo", "dataset_type=prompts", "reward_functions=[m:f]"]
    assert preference.files(C.load(grpo), "eval") == [preference.BUNDLED_PROMPTS["arith"][1]]
    assert preference.files(C.load([*grpo, "bundled_prompts=word_problems"]), "train") == \
        [preference.BUNDLED_PROMPTS["word_problems"][0]]
    for argv, message in (
            ([*grpo, "bundled_prompts=word_problems", "dataset_path=x.jsonl", "eval_dataset_path=y.jsonl"],
             "bundled_prompts=word_problems names a bundled set, read only when dataset_path is"),
            (["base.yml", "dataset_type=text", "bundled_prompts=word_problems"],
             "bundled_prompts is read by dataset_type=prompts"),
            ([*grpo, "eval_pass_k=9"], "eval_pass_k=9 needs at least that many samples per prompt"),
            ([*grpo, "eval_pass_k=1"], "eval_pass_k=1: eval always reports the greedy pass_at_1")):
        with pytest.raises(C.ConfigError, match=message):
            C.load(argv)


def test_math_recipe_runs_and_evaluates_pass_at_k(tmp_path):
    """grpo_math.yml, shortened: a warm-up step, GRPO steps with both rewards and the counts, and
    an eval with the greedy pass_at_1 and the sampled pass_at_4."""
    shape = [k for k in SMALL[2:] if not k.startswith(("vocab_size", "max_target_length", "per_device"))]
    train(C.load(["grpo_math.yml", *shape, "steps=3", "alignment_sft_steps=1", "per_device_batch_size=2",
                  "grpo_num_generations=4", "eval_interval=3", "eval_steps=1", "log_period=1", "checkpoint_period=0",
                  "sample_prompts=[]", f"base_output_directory={tmp_path}", "run_name=r"]))
    rows = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")]
    steps = [r for r in rows if "reward" in r]
    assert [r["step"] for r in steps] == [2, 3]
    assert all(r["reward_failures"] == 0 and r["reward_timeouts"] == 0 and 0 <= r["reward"] <= 1.1 for r in steps)
    ev = next(r for r in rows if "eval_reward" in r)
    assert ev["step"] == 3 and {"eval_pass_at_1", "eval_pass_at_4", "eval_reward_failures"} <= set(ev)
    assert 0 <= ev["eval_pass_at_1"] <= 1 and 0 <= ev["eval_pass_at_4"] <= 1
