"""Conversations → token ids and a loss mask (dataset_type=sft).

A record is one of three shapes (an optional "system" string goes first in the last two):
  {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}   (HF / OpenAI)
  {"prompt": "...", "completion": "..."}
  {"instruction": "...", "input": "...", "output": "..."}                          (Alpaca)

It is rendered with a chat template: the tokenizer's own (the Jinja `chat_template` of the
`tokenizer_config.json` or `chat_template.jinja` beside its tokenizer.json, rendered in a sandboxed
Jinja environment as transformers renders it) or a built-in one (`llama3`, `chatml`).

Which tokens the loss covers is found without `{% generation %}` markers: for each assistant turn
the conversation is rendered up to it with the generation prompt and up to its end; the text in
between (less trailing whitespace) is the answer. Token spans come from the tokenizer's character
offsets. Some templates rewrite earlier turns once a later one follows (Qwen3 drops the reasoning
`<think>…</think>` of every answer before the last user turn): such a turn, rendered as the model
produces it (the conversation up to it), is not a prefix of the whole. It is trained as the model
produces it, in an example of its own (`examples`); the whole conversation supervises the turns it
renders as produced. A template whose generation prompt is not the start of its own turn is refused.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Sequence

import numpy as np

from maxlite.config import ConfigError

BUILTIN = {
    "llama3": (
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
        " + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
        " + '<|im_end|>' + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
}
ROLES = ("system", "user", "assistant")


def messages_of(record: Any) -> list[dict[str, str]] | str:
    """The conversation of a record, or a reason string when the record is malformed."""
    if not isinstance(record, dict):
        return f"record is a {type(record).__name__}, not an object"
    system = record.get("system")
    head = [{"role": "system", "content": system}] if isinstance(system, str) and system else []
    if "messages" in record:
        msgs = record["messages"]
        if not isinstance(msgs, list) or not msgs:
            return "'messages' is not a non-empty list"
        out = []
        for i, m in enumerate(msgs):
            content = _content(m.get("content")) if isinstance(m, dict) else None
            if isinstance(content, str) and content.startswith("!"):
                return f"messages[{i}]: {content[1:]}"
            if not isinstance(m, dict) or m.get("role") not in ROLES or content is None:
                return f"messages[{i}] is not {{role: system|user|assistant, content: string or list of parts}}"
            out.append({"role": m["role"], "content": content})
        return out
    if "prompt" in record and "completion" in record:
        if not (isinstance(record["prompt"], str) and isinstance(record["completion"], str)):
            return "'prompt' and 'completion' must be strings"
        return head + [{"role": "user", "content": record["prompt"]},
                       {"role": "assistant", "content": record["completion"]}]
    if "instruction" in record and "output" in record:
        extra = record.get("input") or ""
        if not (isinstance(record["instruction"], str) and isinstance(record["output"], str)
                and isinstance(extra, str)):
            return "'instruction', 'input' and 'output' must be strings"
        prompt = record["instruction"] + (f"\n\n{extra}" if extra else "")
        return head + [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]
    return "no 'messages', 'prompt'+'completion' or 'instruction'+'output' fields"


def _content(content: Any) -> str | list | None:
    """A message's content: a string, or a list of parts — {"type": "text", "text": ...} and
    {"type": "image", "image": path | bytes | {"bytes": ...} | URL} (also under "url" or "path", as
    transformers' processors take them). Text-only parts are joined into one string (every template
    renders that); a list with an image stays a list of {"type": "text", "text"} and {"type": "image",
    "image"} for the model's own template (its image placeholders). None: not content; "!reason": a bad part."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind in ("image", "image_url"):
            ref = next((part[k] for k in ("image", "url", "path", "image_url") if part.get(k) is not None), None)
            if ref is None:
                return f"!content[{j}] is an image part without an image"
            parts.append({"type": "image", "image": ref})
        else:
            return f"!content[{j}] is not a text or image part"
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _environment():
    import jinja2
    from jinja2 import ext, nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its body: the markers are allowed, not needed."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, separators=None, sort_keys=False: \
        json.dumps(x, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    return env


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": ...} in older tokenizer_config files
        return value.get("content") or ""
    return value or ""


def own_template(tokenizer_path: str) -> tuple[str | None, dict[str, str]]:
    """(the chat template shipped beside a tokenizer, its special tokens from tokenizer_config.json)."""
    from maxlite.data.tokenizer import BUNDLED_DIR
    p = pathlib.Path(tokenizer_path) if tokenizer_path else BUNDLED_DIR
    folder = p if p.is_dir() else p.parent
    template, specials = None, {}
    cfg_file = folder / "tokenizer_config.json"
    if cfg_file.is_file():
        cfg = json.loads(cfg_file.read_text())
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        specials = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token") if cfg.get(k)}
    if template is None and (folder / "chat_template.json").is_file():  # a multimodal processor's (Gemma 3)
        template = json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    return template, specials


def template_source(config) -> tuple[str, str]:
    """(name, Jinja source) of the recipe's chat template: `sft_template`, where `auto` is the
    tokenizer's own and chatml when it has none. The HF export ships the same one."""
    own, _ = own_template(config.tokenizer_path)
    name = config.sft_template
    if name == "auto":
        name = "tokenizer's own" if own else "chatml"
    return name, own if name == "tokenizer's own" else BUILTIN[name]


class ChatTemplate:
    """Renders conversations; `encode` gives (ids, assistant mask)."""

    def __init__(self, source: str, tokenizer, name: str = "", bos_token: str = "", eos_token: str = "",
                 image_expansion: tuple[str, str] | None = None):
        import jinja2
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"chat template {name or ''}: not valid Jinja ({e})") from None
        self.name, self.tok = name, tokenizer
        self.bos_token, self.eos_token = bos_token, eos_token
        # a vision kind that expands its image placeholder in the text (image_docs.text_expansion: Gemma 3)
        self.image_expansion = image_expansion
        if not hasattr(tokenizer._backend, "encode_batch_fast") and not hasattr(tokenizer._backend, "get_vocab_size"):
            raise ConfigError(f"dataset_type=sft needs an HF tokenizers tokenizer (tokenizer.json) for token "
                              f"offsets; {tokenizer.path} is not one")

    @classmethod
    def for_config(cls, config, tokenizer) -> "ChatTemplate":
        name, source = template_source(config)
        _, specials = own_template(config.tokenizer_path)
        backend = tokenizer._backend

        def text(tid, default):
            return (backend.id_to_token(tid) if tid is not None and hasattr(backend, "id_to_token") else None) or default
        from maxlite.data.image_docs import text_expansion

        expansion = text_expansion(config, tokenizer) if config.vision_encoder else None
        return cls(source, tokenizer, name, specials.get("bos_token") or text(tokenizer.bos_id, ""),
                   specials.get("eos_token") or text(tokenizer.eos_id, ""), expansion)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        import jinja2
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except jinja2.TemplateError as e:
            raise ConfigError(f"chat template {self.name}: {e}") from None

    def assistant_spans(self, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]], list[int]]:
        """(the rendered conversation, character spans of the answers it renders as they were
        produced, the indices of the assistant turns it rewrites)."""
        whole = self.render(messages)
        spans, rewritten = [], []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before, upto = self._turn(messages, i)
            if not whole.startswith(upto):
                rewritten.append(i)
                continue
            end = len(upto.rstrip())
            if end > len(before):
                spans.append((len(before), end))
        return whole, spans, rewritten

    def _turn(self, messages: Sequence[dict], i: int) -> tuple[str, str]:
        """(the conversation before turn i with the generation prompt, the conversation up to it)."""
        before, upto = self.render(messages[:i], True), self.render(messages[:i + 1])
        if not upto.startswith(before):
            raise ConfigError(f"chat template {self.name}: the generation prompt after the first {i} messages is "
                              f"not the start of the assistant turn that follows them: the answer cannot be found")
        return before, upto

    def examples(self, messages: Sequence[dict], train_on_inputs: bool = False) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids, mask) of the whole conversation, then one per assistant turn the whole rewrites:
        that turn rendered as the model produced it (the conversation up to it), it alone supervised."""
        out = [self.encode(messages, train_on_inputs, rewritten_ok=True)]
        if train_on_inputs:
            return out
        for i in self.assistant_spans(messages)[2]:
            before, upto = self._turn(messages, i)
            out.append(self._ids_and_mask(upto, [(len(before), len(upto.rstrip()))], False))
        return out

    def encode(self, messages: Sequence[dict], train_on_inputs: bool = False,
               answers_from: int = 0, rewritten_ok: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(token ids int32, mask bool: the token belongs to an assistant answer — one starting at
        character `answers_from` or later: a preference pair's response after its prompt —, or
        every token). An answer the whole conversation rewrites is refused (`examples` trains it on
        its own) unless `rewritten_ok`."""
        text, spans, rewritten = self.assistant_spans(messages)
        if rewritten and not rewritten_ok and len(self.render(messages[:rewritten[-1]], True)) >= answers_from:
            raise ConfigError(f"chat template {self.name} renders assistant turn {rewritten[-1]} differently once "
                              f"the conversation goes on: that answer cannot be supervised in this conversation")
        spans = [(lo, hi) for lo, hi in spans if lo >= answers_from]
        return self._ids_and_mask(text, spans, train_on_inputs)

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """The ids of `messages` and the assistant's generation prompt, as `examples` tokenizes them."""
        return self._ids_and_mask(self.render(messages, True), [], True)[0].tolist()

    def _ids_and_mask(self, text: str, spans: list[tuple[int, int]], train_on_inputs: bool):
        from maxlite.data.image_docs import expand_text

        text, spans = expand_text(text, spans, self.image_expansion)
        enc = self.tok._backend.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, np.int32)
        if train_on_inputs:
            return ids, np.ones(len(ids), bool)
        starts = np.array([s for s, _ in enc.offsets], np.int64)
        mask = np.zeros(len(ids), bool)
        for lo, hi in spans:
            mask |= (starts >= lo) & (starts < hi)
        return ids, mask
