"""Build the bundled chat set (dataset_type=sft's default) from the bundled KJV corpus.

    python maxlite/data/bundled/build_chat.py maxlite/data/bundled

Deterministic. Conversations from the train chapters go to chat_train.jsonl.zst, from the eval
chapters to chat_eval.jsonl.zst. Three tasks, in the three record shapes dataset_type=sft reads:
continue a verse from its first words, name the reference of a verse, and quote a verse then the
next one (two user turns). Most records are `messages` (a quarter with a system prompt); one in
ten is `prompt`/`completion`, one in ten Alpaca `instruction`/`input`/`output`.
"""

import io
import json
import random
import sys

import zstandard

SYSTEM = "You answer with the words of the King James Bible."


def chapters(path):
    with zstandard.ZstdDecompressor().stream_reader(open(path, "rb")) as f:
        for line in io.TextIOWrapper(f, encoding="utf-8"):
            head, *verses = json.loads(line)["text"].split("\n")
            book = head.rsplit(" ", 1)[0]
            for v in verses:
                ref, _, text = v.partition(" ")
                if text:  # a few verses are empty in the source
                    yield book, ref, text


def conversation(rng, verses, i):
    book, ref, text = verses[i]
    task, shape = rng.randrange(3), rng.random()
    if task == 0:
        words = text.split()
        k = max(3, len(words) // 3)
        if len(words) <= k:
            task = 1
        else:
            q, a = f"Continue the verse: {' '.join(words[:k])}", " ".join(words[k:])
    if task == 1:
        q, a = f"Where is this verse from? {text}", f"{book} {ref}."
    if task == 2:
        nb, nref, ntext = verses[i + 1] if i + 1 < len(verses) else verses[i]
        if nb != book:
            q, a = f"Quote {book} {ref}.", text
        else:
            msgs = [{"role": "user", "content": f"Quote {book} {ref}."}, {"role": "assistant", "content": text},
                    {"role": "user", "content": "And the next verse?"},
                    {"role": "assistant", "content": f"{nb} {nref}: {ntext}"}]
            return {"messages": ([{"role": "system", "content": SYSTEM}] if shape < 0.25 else []) + msgs}
    if shape < 0.1:
        return {"prompt": q, "completion": a}
    if shape < 0.2:
        instruction, _, rest = q.partition(": ") if ": " in q else q.partition("? ")
        return {"instruction": instruction + (":" if ": " in q else "?"), "input": rest, "output": a}
    msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"messages": ([{"role": "system", "content": SYSTEM}] if shape < 0.4 else []) + msgs}


def main(folder):
    for split, count, seed in (("train", 6000, 0), ("eval", 400, 1)):
        verses = list(chapters(f"{folder}/kjv_{split}.jsonl.zst"))
        rng = random.Random(seed)
        picks = sorted(rng.sample(range(len(verses)), count))
        lines = [json.dumps(conversation(rng, verses, i), ensure_ascii=False) for i in picks]
        rng.shuffle(lines)
        data = ("\n".join(lines) + "\n").encode()
        with open(f"{folder}/chat_{split}.jsonl.zst", "wb") as f:
            f.write(zstandard.ZstdCompressor(level=19).compress(data))
        print(f"{split}: {count} conversations, {len(data) / 1e6:.2f} MB")


if __name__ == "__main__":
    main(sys.argv[1])
