"""Data for the alignment objectives (maxlite/objectives/): preference pairs for DPO and prompts
for GRPO, streamed, shuffled in a window and resumable like dataset_type=sft (data/sft_pipeline.py).

dataset_type=preference — one record per pair; `prompt` a string (a user turn) or a message list,
`chosen` / `rejected` a string (the assistant's answer) or a message list (the turns after the
prompt). Each side is rendered with the chat template (data/chat.py) into one unpacked row:
chosen_{inputs,targets,positions,segment_ids,weights} and rejected_{...}, the weights covering
the response's assistant tokens only. With dpo_precompute_reference each row also carries
host_pair_key, a hash of its tokens and weights, which finds the pair in the reference table.

dataset_type=prompts — one record per prompt: `prompt` as above, any other fields (an `answer`
the reward functions check, ...) passed to the reward functions as the record. Rows:
prompt_ids [P] (rendered with the generation prompt, right-padded; P = max_target_length −
grpo_max_new_tokens), prompt_lengths, host_records (the record as JSON, kept on the host), and
sft_{...}: the prompt followed by the record's `completion` (else its `answer`), for the warm-up
steps. With dataset_path "" the records are the bundled set `bundled_prompts` names.

A response longer than its row is cut (one line on stdout the first time); one that the cut leaves
with no token, and a prompt longer than its room, stop the run with one line (raise
max_target_length).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterator

import grain
import numpy as np

from maxlite.data import chat, sources
from maxlite.data.text_pipeline import _Records, check_tokenizer, process_batches, text_files
from maxlite.data.tokenizer import BUNDLED_DIR, Tokenizer

BUNDLED = {"preference": (str(BUNDLED_DIR / "arith_pairs_train.jsonl.zst"), str(BUNDLED_DIR / "arith_pairs_eval.jsonl.zst"))}
# dataset_type=prompts: the bundled sets `bundled_prompts` names (build_arith.py, build_word_problems.py)
BUNDLED_PROMPTS = {name: (str(BUNDLED_DIR / f"{stem}_train.jsonl.zst"), str(BUNDLED_DIR / f"{stem}_eval.jsonl.zst"))
                   for name, stem in (("arith", "arith_prompts"), ("word_problems", "word_problems"))}
SIDES = ("chosen", "rejected")


def _messages(value: Any, role: str) -> list[dict[str, str]] | None:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and value:
        out = chat.messages_of({"messages": value})
        return out if isinstance(out, list) else None
    return None


def _prompt_of(record: Any) -> list[dict[str, str]] | str:
    """A record's prompt as messages, or the reason it has none."""
    if not isinstance(record, dict):
        return f"record is a {type(record).__name__}, not an object"
    prompt = _messages(record.get("prompt"), "user")
    return prompt if prompt is not None else "'prompt' must be a string or a list of {role, content} messages"


def parse_pair(record: Any) -> dict[str, Any] | str:
    """{prompt, chosen, rejected} as message lists, or the reason the record is malformed."""
    prompt = _prompt_of(record)
    if isinstance(prompt, str):
        return prompt
    out = {"prompt": prompt}
    for side in SIDES:
        msgs = _messages(record.get(side), "assistant")
        if msgs is None or not any(m["role"] == "assistant" for m in msgs):
            return f"'{side}' must be a string or a message list with an assistant turn"
        out[side] = msgs
    return out


def parse_prompt(record: Any) -> dict[str, Any] | str:
    """{prompt, answer (or None), record} or the reason the record is malformed."""
    prompt = _prompt_of(record)
    if isinstance(prompt, str):
        return prompt
    answer = record.get("completion", record.get("answer"))  # a worked completion, else the bare answer
    return {"prompt": prompt, "answer": str(answer) if answer is not None else None,
            "record": json.dumps(record, ensure_ascii=False)}


def encode_response(template: chat.ChatTemplate, prompt, response) -> tuple[np.ndarray, np.ndarray]:
    """(ids of prompt + response, mask of the response's assistant tokens)."""
    return template.encode([*prompt, *response],
                           answers_from=len(template.render(prompt, add_generation_prompt=True)))


def encode_prompt(template: chat.ChatTemplate, prompt) -> np.ndarray:
    text = template.render(prompt, add_generation_prompt=True)
    return np.asarray(template.tok._backend.encode(text, add_special_tokens=False).ids, np.int32)


def row(ids: np.ndarray, mask: np.ndarray, length: int, prefix: str = "") -> dict[str, np.ndarray]:
    """One unpacked row (cut to `length` + 1 tokens), padded: inputs, targets, positions,
    segment_ids (1 = real, 0 = padding) and weights (the masked targets)."""
    ids, mask = ids[:length + 1], mask[:length + 1]
    n = max(len(ids) - 1, 0)
    out = {"inputs": np.zeros(length, np.int32), "targets": np.zeros(length, np.int32),
           "positions": np.arange(length, dtype=np.int32), "segment_ids": np.zeros(length, np.int32),
           "weights": np.zeros(length, np.float32)}
    out["inputs"][:n], out["targets"][:n] = ids[:-1], ids[1:]
    out["segment_ids"][:n], out["weights"][:n] = 1, mask[1:]
    return {prefix + k: v for k, v in out.items()}


class _Rows(grain.transforms.Map):
    """Rows cut to `length`: saying so once when the cut removes part of a response, and refusing
    one it removes whole."""

    def __init__(self, template, length: int):
        self.template, self.length, self.warned = template, length, set()

    def checked_row(self, ids, mask, prefix: str, what: str) -> dict[str, np.ndarray]:
        from maxlite.config import ConfigError

        out = row(ids, mask, self.length, prefix)
        if len(ids) > self.length + 1 and mask.any():
            if not out[prefix + "weights"].any():
                raise ConfigError(f"a {what} starts after token {self.length} (max_target_length="
                                  f"{self.length}): raise max_target_length")
            if what not in self.warned:
                self.warned.add(what)
                print(f"maxlite: some {what}s are cut at max_target_length={self.length} (their loss "
                      f"covers the part that fits)", flush=True)
        return out


def pair_key(rows: dict[str, np.ndarray]) -> str:
    """A pair's identity: a hash of both sides' rows (tokens, positions, weights) as trained on."""
    h = hashlib.blake2b(digest_size=12)
    for name in sorted(k for k in rows if k.startswith(SIDES)):
        h.update(name.encode())
        h.update(np.ascontiguousarray(rows[name]).tobytes())
    return h.hexdigest()


class _PairRows(_Rows):
    def __init__(self, template, length: int, keyed: bool):
        super().__init__(template, length)
        self.keyed = keyed

    def map(self, pair: dict[str, Any]) -> dict[str, np.ndarray]:
        out = {}
        for side in SIDES:
            ids, mask = encode_response(self.template, pair["prompt"], pair[side])
            out.update(self.checked_row(ids, mask, f"{side}_", f"{side} response"))
        if self.keyed:
            out["host_pair_key"] = np.array(pair_key(out))
        return out


class _PromptRows(_Rows):
    def __init__(self, template, length: int, prompt_length: int):
        super().__init__(template, length)
        self.prompt_length = prompt_length

    def map(self, item: dict[str, Any]) -> dict[str, np.ndarray]:
        from maxlite.config import ConfigError

        ids = encode_prompt(self.template, item["prompt"])
        if len(ids) > self.prompt_length:
            raise ConfigError(f"a prompt has {len(ids)} tokens, more than max_target_length − "
                              f"grpo_max_new_tokens = {self.prompt_length}: raise max_target_length "
                              f"(record: {item['record'][:120]})")
        padded = np.zeros(self.prompt_length, np.int32)
        padded[:len(ids)] = ids
        out = {"prompt_ids": padded, "prompt_lengths": np.int32(len(ids)),
               "host_records": np.array(item["record"])}
        if item["answer"] is not None:
            full, mask = encode_response(self.template, item["prompt"],
                                         [{"role": "assistant", "content": item["answer"]}])
        else:  # nothing to warm up on: an all-padding row
            full, mask = np.zeros(1, np.int32), np.zeros(1, bool)
        out.update(self.checked_row(full, mask, "sft_", "answer"))
        return out


def files(config, split: str) -> list[str]:
    prompts = config.dataset_type == "prompts"
    bundled = BUNDLED_PROMPTS[config.bundled_prompts] if prompts else BUNDLED[config.dataset_type]
    return text_files(config, split, bundled)


def make_dataset(config, split: str, process_index: int, process_count: int, tok: Tokenizer) -> grain.IterDataset:
    check_tokenizer(tok, config)
    template = chat.ChatTemplate.for_config(config, tok)
    shuffle = split == "train" and config.data_shuffle
    seed = config.data_shuffle_seed
    bad = sources.BadRecords(config.data_bad_record_policy)
    parse = parse_pair if config.dataset_type == "preference" else parse_prompt
    ds: grain.IterDataset = _Records(files(config, split), (), bad, seed, shuffle, True, parse)
    if shuffle and config.data_shuffle_window > 1:
        ds = grain.experimental.WindowShuffleIterDataset(ds, window_size=config.data_shuffle_window, seed=seed)
    ds = ds.map(lambda element: element["texts"])
    if config.dataset_type == "preference":
        ds = ds.map(_PairRows(template, config.max_target_length, config.dpo_precompute_reference))
    else:
        ds = ds.map(_PromptRows(template, config.max_target_length,
                                config.max_target_length - config.grpo_max_new_tokens))
    return process_batches(ds, config, process_index, process_count)


def every_pair(config, split: str, tok: Tokenizer) -> Iterator[dict[str, np.ndarray]]:
    """Each well-formed pair of `split` once, in file order, as one keyed row (the reference
    table's pass, objectives/dpo_reference.py); bad records are counted as in training."""
    check_tokenizer(tok, config)
    rows = _PairRows(chat.ChatTemplate.for_config(config, tok), config.max_target_length, True)
    records = iter(_Records(files(config, split), (), sources.BadRecords(config.data_bad_record_policy),
                            config.data_shuffle_seed, False, False, parse_pair))
    for element in records:
        yield rows.map(element["texts"])
