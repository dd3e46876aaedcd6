"""Qwen3.5's multimodal checkpoint's whole journey, as a user runs it: a random
Qwen3_5ForConditionalGeneration built by transformers ([linear, full] decoder, a 2-block vision tower;
a tokenizer holding Qwen's vision tokens, a chat template that writes one placeholder per image, its
image processor) → `hf import` → SFT on the bundled shapes task's image chat records from the written
recipe.yml (answers only, the tower frozen) → `generate --image --chat` → `hf export` → transformers,
with the exported processor, answers with the same tokens."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

from maxlite.data.tokenizer import BUNDLED_DIR
from maxlite.data.vision_task import write_shapes_task
from tests.helpers import ROOT, process_env
from tests.hf_models import qwen3_5_vl

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|>"
            "<|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_sft") / "hf"
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED_DIR / "tokenizer.json"),
                                               eos_token="<|im_end|>")
    tok.add_special_tokens({"additional_special_tokens": SPECIAL[2:], "eos_token": "<|im_end|>"})
    tok.add_tokens(["<|im_start|>"], special_tokens=True)
    tok.chat_template = TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    config = qwen3_5_vl(image_token_id=ids["<|image_pad|>"], video_token_id=0,
                        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    config.text_config.vocab_size = 4104
    torch.manual_seed(0)
    transformers.Qwen3_5ForConditionalGeneration(config).eval().save_pretrained(str(path))
    tok.save_pretrained(str(path))
    transformers.Qwen2VLImageProcessorPil(patch_size=8, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                          image_std=[0.5] * 3, size={"shortest_edge": 32 * 32,
                                                                     "longest_edge": 64 * 64}).save_pretrained(str(path))
    return path


def _run(module: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, env=process_env(1),
                          capture_output=True, text=True, timeout=900)


def test_import_sft_on_image_chat_generate_with_an_image_export_and_transformers_answers(hf_dir, tmp_path):
    task = write_shapes_task(tmp_path / "shapes", train=48, eval=4, seed=0)
    done = _run("maxlite.bridge.hf", "import", hf_dir, tmp_path / "ck")
    assert done.returncode == 0, done.stderr[-3000:]
    recipe = tmp_path / "ck" / "recipe.yml"
    import yaml
    written = yaml.safe_load(recipe.read_text())
    assert (written["decoder_block"], written["vision_encoder"], written["mrope_sections"]) == \
        ("qwen3_5", "qwen_vit", [2, 2, 2]), written
    done = _run("maxlite.train", recipe, "dataset_type=sft", f"dataset_path={task['train']}", "sft_template=auto",
                "steps=6", "learning_rate=0.003", "max_target_length=96", "max_image_patches=128",
                "per_device_batch_size=4", "checkpoint_period=6", "eval_interval=0", "run_name=sft",
                f"base_output_directory={tmp_path}", "enable_tensorboard=false", "write_report=false",
                "dtype=float32")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "vision encoder qwen_vit: frozen" in done.stdout, done.stdout
    losses = [json.loads(line)["loss"] for line in open(tmp_path / "sft" / "metrics.jsonl") if '"loss"' in line]
    assert len(losses) == 6 and all(np.isfinite(losses)) and losses[-1] < losses[0], losses

    record = json.loads(task["eval"].read_text().splitlines()[0])
    image = task["eval"].parent / record["messages"][0]["content"][0]["image"]
    question = record["messages"][0]["content"][1]["text"]
    done = _run("maxlite.generate", tmp_path / "sft", "--prompt", question, "--image", image, "--chat",
                "--max-new-tokens", "8", "dtype=float32")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(question), done.stdout
    ours = done.stdout.rstrip("\n")[len(question):]

    done = _run("maxlite.bridge.hf", "export", tmp_path / "sft" / "checkpoints", tmp_path / "out")
    assert done.returncode == 0, done.stderr[-3000:]
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(tmp_path / "out")).eval()
    assert type(model) is transformers.Qwen3_5ForConditionalGeneration
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "out"))
    processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(str(tmp_path / "out"))
    from PIL import Image
    pixels = processor(images=[Image.open(image).convert("RGB")], return_tensors="pt")
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
                                   tokenize=False, add_generation_prompt=True)
    ids, pad = tok(text, add_special_tokens=False)["input_ids"], model.config.image_token_id
    n = int(pixels["image_grid_thw"][0].prod()) // 4
    ids = [t for i in ids for t in ([pad] * n if i == pad else [i])]
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), pixel_values=pixels["pixel_values"],
                             image_grid_thw=pixels["image_grid_thw"], mm_token_type_ids=(torch.tensor([ids]) == pad).int(),
                             do_sample=False, max_new_tokens=8, eos_token_id=tok.eos_token_id, pad_token_id=0)
    theirs = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    assert ours.strip() == theirs.strip() and ours.strip(), (ours, theirs)


def test_the_sft_audit_counts_each_image_as_the_tokens_it_expands_to(hf_dir, tmp_path):
    """The audit's target tokens are the rows training sees: each image counts the placeholders
    transformers' processor expands it to (prod(image_grid_thw) / merge²), not one token; a record
    whose image is missing is malformed, as training would refuse it."""
    from PIL import Image

    from maxlite.bridge import hf
    from maxlite.data import sft_audit
    from maxlite.data.tokenizer import load_tokenizer

    sizes = {"a.png": (45, 70), "b.png": (61, 37), "c.png": (33, 90)}
    for name, (h, w) in sizes.items():
        Image.new("RGB", (w, h), (200, 10, 10)).save(tmp_path / name)

    def record(*names, answer="two"):
        parts = [*({"type": "image", "image": n} for n in names), {"type": "text", "text": "How many?"}]
        return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]}
    records = [record("a.png"), record("b.png", "c.png", answer="three"), record("gone.png")]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg, _ = hf.import_hf(str(hf_dir), ["dataset_type=sft", f"dataset_path={data}", "sft_template=auto",
                                        "max_target_length=256", "max_image_patches=256"])
    got = sft_audit.audit(cfg, load_tokenizer(cfg.tokenizer_path, cfg.bos_id, cfg.eos_id))

    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(hf_dir))
    processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(str(hf_dir))
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    want_targets = want_image_tokens = 0
    for r in records[:2]:
        names = [p["image"] for p in r["messages"][0]["content"] if p["type"] == "image"]
        grids = processor(images=[Image.open(tmp_path / n) for n in names], return_tensors="np")["image_grid_thw"]
        counts = iter(int(np.prod(g)) // 4 for g in grids)
        ids = tok.apply_chat_template(r["messages"], tokenize=True, return_dict=False)
        ids = [t for i in ids for t in ([pad] * next(counts) if i == pad else [i])]
        want_targets += len(ids) - 1
        want_image_tokens += ids.count(pad)
    assert (got.conversations, got.bad_records, got.images) == (2, 1, 3)
    assert (got.image_tokens, got.target_tokens) == (want_image_tokens, want_targets)
    assert got.image_tokens > got.images and "3 images (" in got.line("x")
