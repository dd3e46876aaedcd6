"""Build the bundled arithmetic task (the alignment recipes' defaults: dpo.yml, grpo.yml).

    python maxlite/data/bundled/build_arith.py maxlite/data/bundled

Deterministic. Questions "What is a + b?" for a, b in 0..5 (36 questions), answered by
the sum (one token of the bundled tokenizer). Pairs (dataset_type=preference): the right sum
chosen, a sum off by 1, 2 or 3 rejected; for each question three of the six wrong sums make
training pairs and the other three the held-out eval pairs (the same questions, pairs the run never
trains on). Prompts (dataset_type=prompts): each question and its `answer`, which the reward
function `maxlite.objectives.rewards:exact_answer` checks; eval greedily answers all 36. Generated data,
released with maxlite under its Apache-2.0 licence.
"""

import json
import random
import sys

import zstandard


def write(path, records):
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    with open(path, "wb") as f:
        f.write(zstandard.ZstdCompressor(level=19).compress(data))


def main(out):
    rng = random.Random(0)
    pairs = {"train": [], "eval": []}
    prompts = []
    for a in range(6):
        for b in range(6):
            prompt, answer = f"What is {a} + {b}?", a + b
            wrong = [answer + d for d in (-3, -2, -1, 1, 2, 3) if answer + d >= 0]
            rng.shuffle(wrong)
            half = len(wrong) // 2
            for name, chosen_wrong in (("train", wrong[:half]), ("eval", wrong[half:])):
                pairs[name] += [{"prompt": prompt, "chosen": str(answer), "rejected": str(w)} for w in chosen_wrong]
            prompts.append({"prompt": prompt, "answer": str(answer)})
    for name in ("train", "eval"):
        rng.shuffle(pairs[name])
        write(f"{out}/arith_pairs_{name}.jsonl.zst", pairs[name])
    write(f"{out}/arith_prompts_train.jsonl.zst", prompts)
    write(f"{out}/arith_prompts_eval.jsonl.zst", prompts)


if __name__ == "__main__":
    main(sys.argv[1])
