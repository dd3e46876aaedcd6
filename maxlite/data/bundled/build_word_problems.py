"""Build the bundled word problems (grpo_math.yml; `bundled_prompts: word_problems`).

    python maxlite/data/bundled/build_word_problems.py maxlite/data/bundled

Deterministic (seed 0). Short grade-school word problems of 1 to 3 operations (+, −, ×, ÷ with
whole results) from ten templates over names, items and small numbers, each answer a whole number
in 0..99: "Ana has 7 apples and buys 5 more. How many apples does she have now?" → 12. Records
`{"prompt", "answer", "completion"}`: `answer` the number the reward functions check
(`maxlite.objectives.math_reward:math_verify`), `completion` the reference answer `\\boxed{12}` the
warm-up trains on. TRAIN problems for training and EVAL other ones for the held-out eval split: no
problem text is in both. Generated data, released with maxlite under its Apache-2.0 licence.
"""

import json
import random
import sys

import zstandard

TRAIN, EVAL = 4000, 200
NAMES = [("Ana", "she"), ("Ben", "he"), ("Cara", "she"), ("Dan", "he"), ("Eva", "she"), ("Finn", "he"),
         ("Gina", "she"), ("Hugo", "he"), ("Ivy", "she"), ("Jack", "he"), ("Lena", "she"), ("Omar", "he"),
         ("Maya", "she"), ("Noah", "he"), ("Rosa", "she"), ("Sam", "he")]
OBJECT = {"she": "her", "he": "him"}
ITEMS = ["apples", "pencils", "marbles", "cookies", "stickers", "books", "coins", "cards", "shells", "eggs",
         "oranges", "balloons", "stamps", "crayons", "buttons", "plums"]


def _templates(rng: random.Random):
    """(problem, answer) makers, one per template; each draws its own numbers."""
    r = rng.randint

    def add(n, p, o, i):
        a, b = r(2, 50), r(2, 40)
        return f"{n} has {a} {i} and buys {b} more. How many {i} does {p} have now?", a + b

    def sub(n, p, o, i):
        a = r(5, 60)
        b = r(1, a - 1)
        return f"{n} has {a} {i} and gives {b} of them to {o}. How many {i} does {n} have left?", a - b

    def mul(n, p, o, i):
        a, b = r(2, 9), r(2, 9)
        return f"{n} buys {a} bags with {b} {i} in each bag. How many {i} does {p} buy?", a * b

    def div(n, p, o, i):
        a, b = r(2, 9), r(2, 9)
        return f"{n} shares {a * b} {i} equally among {b} friends. How many {i} does each friend get?", a

    def add_sub(n, p, o, i):
        a, b = r(5, 40), r(2, 30)
        c = r(1, a + b - 1)
        return (f"{n} has {a} {i}, finds {b} more and then gives {c} to {o}. How many {i} does {n} have "
                f"now?", a + b - c)

    def mul_sub(n, p, o, i):
        a, b = r(2, 9), r(2, 9)
        c = r(1, a * b - 1)
        return (f"{n} buys {a} boxes of {b} {i} and uses {c} of them. How many {i} are left?", a * b - c)

    def compare(n, p, o, i):
        a, b = r(2, 40), r(2, 30)
        return (f"{n} has {a} {i}. {o} has {b} more {i} than {n}. How many {i} do they have together?",
                a + a + b)

    def mul_add(n, p, o, i):
        a, b, c = r(2, 9), r(2, 9), r(1, 20)
        return (f"{n} reads {a} pages of a book every day for {b} days, then {c} more pages. How many pages "
                f"does {p} read?", a * b + c)

    def three_steps(n, p, o, i):
        a, b, c = r(2, 30), r(2, 6), r(2, 6)
        d = r(1, a + b * c - 1)
        return (f"{n} has {a} {i}. {p.capitalize()} buys {b} packs of {c} {i} and then gives {d} {i} to "
                f"{o}. How many {i} does {n} have now?", a + b * c - d)

    def pool_share(n, p, o, i):
        k, q = r(2, 6), r(2, 9)
        a, b = r(2, 5), r(2, 5)
        c = k * q - a * b
        if c < 1:
            return "", -1  # drawn again
        return (f"{n} buys {a} packs of {b} {i} and {o} gives {OBJECT[p]} {c} more. {p.capitalize()} shares them "
                f"equally among {k} friends. How many {i} does each friend get?", q)

    return [add, sub, mul, div, add_sub, mul_sub, compare, mul_add, three_steps, pool_share]


def problems(count: int, seed: int = 0) -> list[dict]:
    """`count` distinct problems with answers in 0..99, in the order drawn."""
    rng = random.Random(seed)
    makers, seen, out = _templates(rng), set(), []
    while len(out) < count:
        (name, pronoun), (other, _) = rng.sample(NAMES, 2)
        prompt, answer = rng.choice(makers)(name, pronoun, other, rng.choice(ITEMS))
        if not 0 <= answer <= 99 or prompt in seen:
            continue
        seen.add(prompt)
        out.append({"prompt": prompt, "answer": str(answer), "completion": f"\\boxed{{{answer}}}"})
    return out


def write(path, records):
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    with open(path, "wb") as f:
        f.write(zstandard.ZstdCompressor(level=19).compress(data))


def main(out):
    drawn = problems(TRAIN + EVAL)
    write(f"{out}/word_problems_train.jsonl.zst", drawn[:TRAIN])
    write(f"{out}/word_problems_eval.jsonl.zst", drawn[TRAIN:])


if __name__ == "__main__":
    main(sys.argv[1])
