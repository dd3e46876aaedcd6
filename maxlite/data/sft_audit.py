"""The SFT loss-mask audit, before step 0: `sft_audit.txt` in the run directory and one line.

It reads the first `sft_audit_records` records of the train files (in file order), renders them as
training does (data/sft_pipeline.py) and counts the target tokens the loss covers. The file shows
`sft_audit_examples` rendered conversations with the supervised spans marked [[ like this ]]. A
mask that covers no target token, or every one (a template whose answers cannot be told from its
prompts, the silent SFT bug), or data whose assistant answers are all empty (the loss would see
only the template's end-of-turn tokens) stops the run with exit 2 unless
`sft_allow_degenerate_mask: true` (or `sft_train_on_inputs: true`, which asks for every token).

A vision model's conversation with images is rendered as training renders it (sft_pipeline.image_example):
each image counts the tokens its placeholder expands to (qwen_vit: its patches / merge², set by its
size), not one, and the line reports the images and their tokens; a record training would refuse
(a missing image, placeholders and images that differ in number) is counted malformed.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from maxlite.config import ConfigError
from maxlite.data import chat, image_docs, sources
from maxlite.data.sft_pipeline import examples, image_example, sft_files


@dataclasses.dataclass
class Audit:
    template: str
    conversations: int
    target_tokens: int
    supervised_tokens: int
    truncated: int
    bad_records: int
    length: int
    examples: list[str]
    answers: int = 0        # assistant turns read
    empty_answers: int = 0  # of which empty (whitespace only)
    images: int = 0         # images in the conversations read
    image_tokens: int = 0   # the decoder tokens they expand to (within max_target_length + 1)

    @property
    def fraction(self) -> float:
        return self.supervised_tokens / max(self.target_tokens, 1)

    def line(self, path: str) -> str:
        images = f", {self.images:,} images ({self.image_tokens:,} image tokens)" if self.images else ""
        return (f"maxlite: sft audit: {self.conversations:,} conversations ({self.template} template){images}, "
                f"{self.fraction:.1%} of {self.target_tokens:,} target tokens supervised, {self.truncated} "
                f"truncated to {self.length + 1} tokens, {self.bad_records} malformed → {path}")


def _marked(template: chat.ChatTemplate, ids: np.ndarray, mask: np.ndarray) -> str:
    """The tokens decoded in runs, the supervised runs between [[ and ]]."""
    backend, out, start = template.tok._backend, [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            text = backend.decode([int(t) for t in ids[start:i]], skip_special_tokens=False)
            out.append(f"[[{text}]]" if mask[start] else text)
            start = i
    return "".join(out)


def _with_images(kind, template, messages, refs, path: str, number: int, config) -> list[dict]:
    """The one document training makes of a conversation with images (placeholders expanded)."""
    length = config.max_target_length
    ids, mask, _, _ = image_example(kind, template, messages, refs, path, number, length, config.sft_train_on_inputs)
    return [{"inputs": ids[:length], "targets": ids[1:length + 1], "weights": mask[1:length + 1].astype(np.float32),
             "truncated": len(ids) > length + 1}]


def audit(config, tok) -> Audit:
    template = chat.ChatTemplate.for_config(config, tok)
    bad = sources.BadRecords(config.data_bad_record_policy)
    kind = image_docs.kind_of(config) if config.vision_encoder else None
    n = targets = supervised = truncated = answers = empty = images = image_tokens = 0
    shown = []
    for path in sft_files(config, "train"):
        for number, messages in sources.iter_documents(path, (), bad, chat.messages_of):
            refs = image_docs.image_refs(messages)
            if refs:
                try:
                    docs = _with_images(kind, template, messages, refs, path, number, config)
                except ValueError as e:  # what training would refuse: a malformed record here too
                    bad.add(path, number, str(e).removeprefix(f"{path}:{number}: "))
                    continue
                images += len(refs)
                image_tokens += sum(int(np.sum(np.append(d["inputs"][:1], d["targets"]) == config.image_token_id))
                                    for d in docs)
            else:
                docs = examples(template, messages, config.max_target_length, config.sft_train_on_inputs)
            n += 1
            replies = [m["content"] for m in messages if m["role"] == "assistant"]
            answers += len(replies)
            empty += sum(not r.strip() for r in replies if isinstance(r, str))
            for ex in docs:
                targets += len(ex["targets"])
                supervised += int(ex["weights"].sum())
                truncated += ex["truncated"]
                if len(shown) < config.sft_audit_examples:
                    ids = np.concatenate([ex["inputs"][:1], ex["targets"]])
                    mask = np.concatenate([[False], ex["weights"] > 0])
                    shown.append(_marked(template, ids, mask))
            if n >= config.sft_audit_records:
                break
        if n >= config.sft_audit_records:
            break
    if n == 0:
        raise ConfigError(f"dataset_type=sft: no well-formed conversation in {', '.join(sft_files(config, 'train'))} "
                          f"({bad.summary()})")
    return Audit(template.name, n, targets, supervised, truncated, bad.count, config.max_target_length, shown,
                 answers, empty, images, image_tokens)


def report(a: Audit) -> str:
    head = [f"SFT loss-mask audit: the first {a.conversations} conversations of the train data, rendered with "
            f"the {a.template} chat template.",
            f"supervised target tokens: {a.supervised_tokens:,} of {a.target_tokens:,} ({a.fraction:.2%})",
            f"truncated to {a.length + 1} tokens: {a.truncated}; malformed records skipped: {a.bad_records}",
            *([f"images: {a.images:,}, expanded to {a.image_tokens:,} image tokens (never supervised)"] if a.images else []),
            "", "Examples; the loss covers the text between [[ and ]]:"]
    body = [f"\n--- example {i + 1} ---\n{text}" for i, text in enumerate(a.examples)]
    return "\n".join(head + body) + "\n"


def run(config, tok, run_dir: str, primary: bool) -> Audit:
    """Audit, write the file (primary), print the line, refuse a degenerate mask (every process)."""
    from maxlite import rundir

    a = audit(config, tok)
    path = f"{run_dir}/sft_audit.txt"
    if primary:
        rundir.write_text(path, report(a))
        print(a.line(path), flush=True)
    degenerate = a.supervised_tokens == 0 or (a.supervised_tokens == a.target_tokens
                                              and not config.sft_train_on_inputs)
    if degenerate and not config.sft_allow_degenerate_mask:
        what = "no target token" if a.supervised_tokens == 0 else "every target token"
        raise ConfigError(f"sft audit: the loss mask covers {what} ({a.fraction:.0%}) with the {a.template} "
                          f"template: see {path}; fix the data or template, or set sft_allow_degenerate_mask=true")
    if a.answers and a.empty_answers == a.answers and not (config.sft_allow_degenerate_mask
                                                             or config.sft_train_on_inputs):
        raise ConfigError(f"sft audit: all {a.answers} assistant answers of the first {a.conversations} conversations "
                          f"are empty: the loss ({a.fraction:.0%} of target tokens) would see only the template's "
                          f"end-of-turn tokens; see {path}; fix the data, or set sft_allow_degenerate_mask=true")
    return a
