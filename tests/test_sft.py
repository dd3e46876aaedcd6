"""Supervised fine-tuning (dataset_type=sft): the ids we render equal transformers'
apply_chat_template, the assistant mask equals transformers' generation-marker mask without using
the markers, packed batches train on answers only and resume exactly, the audit refuses a mask of
0% or 100% and data whose answers are all empty, a template that rewrites earlier answers (Qwen3's
reasoning) trains each as it was produced, and `python -m maxlite.train sft.yml` fine-tunes, audits
and exports a model that transformers runs with the same chat template."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import transformers

from maxlite import config as C
from maxlite.data import chat, make_iterator, sft_audit
from maxlite.data.tokenizer import load_tokenizer
from tests.xla_flags import cpu_xla_flags

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|im_start|>",
            "<|im_end|>"]
CHATML_WITH_MARKERS = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who made the light?"},
     {"role": "assistant", "content": "God said, Let there be light."},
     {"role": "user", "content": "And then?"}, {"role": "assistant", "content": "  And there was light. "}],
    [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "one two three"}],
    [{"role": "user", "content": "Only a question, no answer yet."}],
]


def _hf_tokenizer(directory, template):
    """A byte-level BPE with Llama-3 and ChatML special tokens, saved by transformers with `template`."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for c in CONVERSATIONS for m in c] * 20 + ["system user assistant"] * 20
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                                eos_token="<|eot_id|>")
    fast.chat_template = template
    fast.save_pretrained(str(directory))
    return fast


def _config(tmp_path, *extra):
    return C.load(["base.yml", "dataset_type=sft", f"base_output_directory={tmp_path}", *extra])


def _theirs(fast, messages, **kw):
    out = fast.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)
    return out


@pytest.mark.parametrize("name", ["llama3", "chatml"])
def test_rendered_ids_equal_transformers_apply_chat_template(tmp_path, name):
    fast = _hf_tokenizer(tmp_path / "tok", chat.BUILTIN[name])  # the tokenizer's own template
    cfg = _config(tmp_path, f"tokenizer_path={tmp_path}/tok")
    ours = chat.ChatTemplate.for_config(cfg, load_tokenizer(cfg.tokenizer_path))
    assert ours.name == "tokenizer's own"
    for messages in CONVERSATIONS:
        ids, mask = ours.encode(messages)
        assert ids.tolist() == list(_theirs(fast, messages)["input_ids"])
        # the answers, and only they, are supervised: each ends with the template's end-of-turn token
        answers = [fast.decode(ids[lo:hi]) for lo, hi in _runs(mask)]
        expected = [m["content"].strip() if name == "llama3" else m["content"]
                    for m in messages if m["role"] == "assistant"]
        end = "<|eot_id|>" if name == "llama3" else "<|im_end|>"
        assert answers == [a + end for a in expected]
    generation = fast.apply_chat_template(CONVERSATIONS[1][:1], tokenize=True, return_dict=True,
                                          add_generation_prompt=True)["input_ids"]
    text = ours.render(CONVERSATIONS[1][:1], add_generation_prompt=True)
    assert fast(text, add_special_tokens=False)["input_ids"] == list(generation)


def _runs(mask):
    """[lo, hi) of each run of True."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def test_assistant_mask_equals_transformers_generation_markers_without_using_them(tmp_path):
    fast = _hf_tokenizer(tmp_path / "tok", CHATML_WITH_MARKERS)
    cfg = _config(tmp_path, f"tokenizer_path={tmp_path}/tok")
    ours = chat.ChatTemplate.for_config(cfg, load_tokenizer(cfg.tokenizer_path))
    for messages in CONVERSATIONS:
        ids, mask = ours.encode(messages)
        theirs = _theirs(fast, messages, return_assistant_tokens_mask=True)
        assert ids.tolist() == list(theirs["input_ids"])
        assert mask.astype(int).tolist() == list(theirs["assistant_masks"])
    assert ours.encode(CONVERSATIONS[0], train_on_inputs=True)[1].all()


def test_record_shapes_and_bad_records():
    system, user, answer = "S", "Q?", "A."
    want = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    assert chat.messages_of({"messages": want}) == want
    assert chat.messages_of({"prompt": user, "completion": answer}) == want
    assert chat.messages_of({"prompt": user, "completion": answer, "system": system}) == [
        {"role": "system", "content": system}, *want]
    assert chat.messages_of({"instruction": "Q", "input": "more", "output": answer}) == [
        {"role": "user", "content": "Q\n\nmore"}, want[1]]
    for bad in ({"messages": []}, {"messages": [{"role": "robot", "content": "x"}]}, {"prompt": 3, "completion": "x"},
                {"text": "plain"}, ["a list"]):
        assert isinstance(chat.messages_of(bad), str)


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_packed_batches_supervise_answers_only_and_resume_exactly(tmp_path, capsys):
    answers = [f"answer number {i} is {'yes' if i % 2 else 'no'}." for i in range(40)]
    records = [{"prompt": f"question {i}: is it?", "completion": a} for i, a in enumerate(answers)]
    records.insert(5, {"prompt": "no completion"})  # malformed: skipped and reported
    data = _write_jsonl(tmp_path / "chat.jsonl", records)
    cfg = _config(tmp_path, f"dataset_path={data}", "max_target_length=64", "per_device_batch_size=2",
                  "data_shuffle_window=8")
    tok = load_tokenizer("")
    it = make_iterator(cfg, "train", 0, 1)
    seen = 0
    for _ in range(3):
        batch = next(it)
        for row in range(batch["inputs"].shape[0]):
            seg, w, targets = batch["segment_ids"][row], batch["weights"][row], batch["targets"][row]
            assert not w[seg == 0].any()  # padding carries no loss
            for s in set(seg[seg > 0].tolist()):  # each packed conversation: its answer, whole, and nothing else
                supervised = tok._backend.decode(targets[(seg == s) & (w > 0)].tolist(), skip_special_tokens=False)
                assert supervised.endswith("<|im_end|>") and supervised[:-len("<|im_end|>")] in answers
                seen += 1
    assert seen >= 6 and "skipping malformed record" in capsys.readouterr().err
    state = it.get_state()
    expected = next(it)
    again = make_iterator(cfg, "train", 0, 1)
    again.set_state(json.loads(json.dumps(state)))
    got = next(again)
    for k in expected:
        np.testing.assert_array_equal(got[k], expected[k])
    it.close()
    again.close()


def test_the_audit_refuses_a_mask_of_none_or_every_token(tmp_path, capsys):
    tok = load_tokenizer("")
    no_answers = _write_jsonl(tmp_path / "q.jsonl", [{"messages": [{"role": "user", "content": "hello?"}]}] * 4)
    cfg = _config(tmp_path, f"dataset_path={no_answers}")
    with pytest.raises(C.ConfigError, match="covers no target token"):
        sft_audit.run(cfg, tok, str(tmp_path), primary=True)
    assert "0.0% of" in open(tmp_path / "sft_audit.txt").read().splitlines()[1] + capsys.readouterr().out
    # a template whose whole text is the answer: the silent all-ones bug
    only_answers = tmp_path / "tok"
    only_answers.mkdir()
    for name in ("tokenizer.json",):
        (only_answers / name).write_bytes(open(tok.path, "rb").read())
    (only_answers / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}")}))
    pairs = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Q?", "completion": "An answer."}] * 4)
    cfg = _config(tmp_path, f"dataset_path={pairs}", f"tokenizer_path={only_answers}")
    with pytest.raises(C.ConfigError, match="covers every target token"):
        sft_audit.run(cfg, tok, str(tmp_path), primary=True)
    allowed = sft_audit.run(_config(tmp_path, f"dataset_path={pairs}", f"tokenizer_path={only_answers}",
                                    "sft_allow_degenerate_mask=true"), tok, str(tmp_path), primary=True)
    assert allowed.fraction == 1.0
    # the bundled chat set: answers only, examples marked
    good = sft_audit.run(_config(tmp_path), tok, str(tmp_path), primary=True)
    assert 0.2 < good.fraction < 0.8 and good.conversations == 512
    text = open(tmp_path / "sft_audit.txt").read()
    assert text.count("--- example") == 3 and "<|im_start|>assistant\n[[" in text


def test_sft_recipe_fine_tunes_audits_and_exports_for_transformers(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(2),
               PYTHONPATH=ROOT)
    run = dict(cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    train = subprocess.run([sys.executable, "-m", "maxlite.train", "sft.yml", "steps=40", "eval_interval=20",
                            "per_device_batch_size=2", "max_target_length=128", "checkpoint_period=0",
                            "run_name=sft", "write_report=false", "enable_tensorboard=false"], **run)
    assert train.returncode == 0, train.stderr[-3000:]
    assert "maxlite: sft audit: 512 conversations (chatml template)" in train.stdout
    assert os.path.exists(tmp_path / "runs" / "sft" / "sft_audit.txt")
    evals = [json.loads(line)["eval_loss"] for line in open(tmp_path / "runs" / "sft" / "metrics.jsonl")
             if "eval_loss" in line]
    assert len(evals) == 2 and evals[1] < evals[0] < 7.0  # held-out answer tokens; ln(4096) = 8.3 at the start
    assert "maxlite: sample at step 40: Where is this verse from?" in train.stdout
    export = subprocess.run([sys.executable, "-m", "maxlite.bridge.hf", "export", "runs/sft/checkpoints", "hf"], **run)
    assert export.returncode == 0, export.stderr[-3000:]

    import torch
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    fast = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    question = [{"role": "user", "content": "Where is this verse from? And God said, Let there be light."}]
    ids = fast.apply_chat_template(question, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert fast.decode(ids).endswith("<|im_end|>\n<|im_start|>assistant\n")  # the template it was tuned with
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12, pad_token_id=0)
    answer = fast.decode(out[0, len(ids):])
    assert answer.strip()  # it answers (a 40-step model: words, not yet the right book)


# A template written as Qwen3's behaves (ours, not a copy): answers after the last user turn carry
# their reasoning in <think>…</think>, earlier ones are rendered without it.
QWEN3_STYLE = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}"
    "{%- set content = m['content'] %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
REASONING = [{"role": "user", "content": "Who made the light?"},
             {"role": "assistant", "content": "<think>\nThe first verses.\n</think>\n\nGod did."},
             {"role": "user", "content": "And then?"},
             {"role": "assistant", "content": "<think>\nRead on.\n</think>\n\nThere was light."}]


def test_a_template_that_rewrites_earlier_answers_trains_each_as_it_was_produced(tmp_path):
    """Qwen3's reasoning: the whole conversation (ids equal to transformers') supervises the last
    answer with its reasoning; the first answer, whose reasoning the whole drops, is its own
    example rendered up to it, reasoning included."""
    fast = _hf_tokenizer(tmp_path / "tok", QWEN3_STYLE)
    cfg = _config(tmp_path, f"tokenizer_path={tmp_path}/tok")
    ours = chat.ChatTemplate.for_config(cfg, load_tokenizer(cfg.tokenizer_path))
    got = ours.examples(REASONING)
    assert [ids.tolist() for ids, _ in got] == [list(_theirs(fast, REASONING)["input_ids"]),
                                                list(_theirs(fast, REASONING[:2])["input_ids"])]
    supervised = [[fast.decode(ids[lo:hi]) for lo, hi in _runs(mask)] for ids, mask in got]
    assert supervised == [["<think>\nRead on.\n</think>\n\nThere was light.<|im_end|>"],
                          ["<think>\nThe first verses.\n</think>\n\nGod did.<|im_end|>"]]
    assert "The first verses" not in fast.decode(got[0][0])  # the history as the template renders it
    with pytest.raises(C.ConfigError, match="renders assistant turn 1 differently"):
        ours.encode(REASONING)  # one sequence cannot supervise both
    # the pipeline packs both documents
    data = _write_jsonl(tmp_path / "r.jsonl", [{"messages": REASONING}] * 8)
    it = make_iterator(_config(tmp_path, f"tokenizer_path={tmp_path}/tok", f"dataset_path={data}",
                               "max_target_length=128", "per_device_batch_size=1"), "train", 0, 1)
    answers = set()
    for _ in range(12):  # first-fit packing emits the longer whole conversations first
        batch = next(it)
        for seg, w, targets in zip(batch["segment_ids"], batch["weights"], batch["targets"]):
            answers |= {fast.decode(targets[(seg == s) & (w > 0)]) for s in set(seg[seg > 0].tolist())}
    it.close()
    assert answers == {s[0] for s in supervised}


def test_the_audit_refuses_data_whose_answers_are_all_empty(tmp_path, capsys):
    tok = load_tokenizer("")
    empty = _write_jsonl(tmp_path / "e.jsonl", [{"prompt": f"question {i}?", "completion": ""} for i in range(50)])
    cfg = _config(tmp_path, f"dataset_path={empty}")
    with pytest.raises(C.ConfigError, match="all 50 assistant answers of the first 50 conversations are empty"):
        sft_audit.run(cfg, tok, str(tmp_path), primary=True)
    allowed = sft_audit.run(_config(tmp_path, f"dataset_path={empty}", "sft_allow_degenerate_mask=true"), tok,
                            str(tmp_path), primary=True)
    assert 0 < allowed.fraction < 0.5 and allowed.empty_answers == allowed.answers == 50  # end-of-turn tokens only
    one = _write_jsonl(tmp_path / "one.jsonl", [{"prompt": "q?", "completion": ""}] * 49 + [
        {"prompt": "q?", "completion": "an answer"}])
    assert sft_audit.run(_config(tmp_path, f"dataset_path={one}"), tok, str(tmp_path), primary=True).empty_answers == 49


def test_a_processor_chat_template_json_is_the_tokenizer_own(tmp_path):
    """Multimodal checkpoints (Gemma 3 4B-27B) ship their template as chat_template.json."""
    _hf_tokenizer(tmp_path / "tok", None)
    (tmp_path / "tok" / "chat_template.json").write_text(json.dumps({"chat_template": chat.BUILTIN["llama3"]}))
    cfg = _config(tmp_path, f"tokenizer_path={tmp_path}/tok")
    assert chat.template_source(cfg) == ("tokenizer's own", chat.BUILTIN["llama3"])
