"""A vision-language model's whole journey, as a user runs it: a random Qwen3-VL built by transformers
(with a tokenizer holding Qwen's vision tokens, a chat template that writes one placeholder per image,
and its image processor) → `hf import` → SFT on the bundled shapes task's image chat records (answers
only, the tower frozen) → `generate --image --chat` → `hf export` → transformers, with the exported
processor's settings, answers with the same tokens."""

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

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|>"
            "<|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_vl_sft") / "hf"
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED_DIR / "tokenizer.json"),
                                               eos_token="<|im_end|>")
    tok.add_special_tokens({"additional_special_tokens": SPECIAL[2:], "eos_token": "<|im_end|>"})
    tok.add_tokens(["<|im_start|>"], special_tokens=True)
    tok.chat_template = TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    config = transformers.Qwen3VLConfig(
        text_config=dict(vocab_size=4104, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2],
                                          "mrope_interleaved": True}, tie_word_embeddings=False),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
                           num_position_embeddings=16, deepstack_visual_indexes=[0], in_channels=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=0, vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    transformers.Qwen3VLForConditionalGeneration(config).eval().save_pretrained(str(path))
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
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
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


def _first_batch_error(cfg_argv, records, tmp_path, hf_path=None):
    """The one-line error the SFT data of `records` (written as train.jsonl) stops with."""
    from maxlite import config as C
    from maxlite.bridge import hf
    from maxlite.data.sft_pipeline import make_sft_dataset
    from maxlite.data.tokenizer import load_tokenizer

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = [*cfg_argv, "dataset_type=sft", f"dataset_path={data}", "data_bad_record_policy=error",
            "max_target_length=96", "max_image_patches=128", "per_device_batch_size=1"]
    cfg = hf.import_hf(str(hf_path), argv)[0] if hf_path else C.load(argv)
    tok = load_tokenizer(cfg.tokenizer_path, cfg.bos_id, cfg.eos_id)
    with pytest.raises(C.ConfigError) as e:
        next(iter(make_sft_dataset(cfg, "train", 0, 1, tok)))
    return str(e.value)


def _turn(*parts, answer="3"):
    return {"messages": [{"role": "user", "content": list(parts)}, {"role": "assistant", "content": answer}]}


IMAGE_PART = {"type": "image", "image": "img.png"}


def _png(path):
    from PIL import Image

    Image.new("RGB", (45, 70), (200, 10, 10)).save(path)


@pytest.mark.parametrize("case", ["missing", "unreadable", "more_placeholders", "too_many_patches"])
def test_a_bad_image_record_is_one_line_naming_it(hf_dir, tmp_path, case):
    good = _turn(IMAGE_PART, {"type": "text", "text": "How many shapes?"})
    bad = {"missing": _turn({"type": "image", "image": "gone.png"}, {"type": "text", "text": "q"}),
           "unreadable": _turn({"type": "image", "image": "junk.png"}, {"type": "text", "text": "q"}),
           "more_placeholders": _turn(IMAGE_PART, {"type": "text", "text": "and <|vision_start|><|image_pad|><|vision_end|>"}),
           "too_many_patches": _turn(*[IMAGE_PART] * 5, {"type": "text", "text": "q"})}[case]
    _png(tmp_path / "img.png")
    (tmp_path / "junk.png").write_text("not a picture")
    message = _first_batch_error([], [good, bad], tmp_path, hf_dir)
    assert "\n" not in message and f"{tmp_path / 'train.jsonl'}:2: malformed record" in message, message
    assert {"missing": "gone.png", "unreadable": "not a readable image",
            "more_placeholders": "1 image(s) but 2 image placeholder(s)",
            "too_many_patches": "more than a row holds (max_image_patches=128)"}[case] in message, message


def test_a_batch_holds_the_image_arrays_the_planner_compiles_for(hf_dir, tmp_path):
    """The planner's abstract batch (image_docs' batch_shapes) is what the SFT pipeline hands the step."""
    from maxlite.bridge import hf
    from maxlite.data.image_docs import kind_of
    from maxlite.data.sft_pipeline import make_sft_dataset
    from maxlite.data.tokenizer import load_tokenizer

    _png(tmp_path / "img.png")
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps(_turn(IMAGE_PART, {"type": "text", "text": "How many shapes?"})) + "\n")
    cfg = hf.import_hf(str(hf_dir), ["dataset_type=sft", f"dataset_path={data}", "max_target_length=96",
                                     "max_image_patches=128", "per_device_batch_size=2"])[0]
    batch = next(iter(make_sft_dataset(cfg, "train", 0, 1, load_tokenizer(cfg.tokenizer_path, cfg.bos_id, cfg.eos_id))))
    want = kind_of(cfg).batch_shapes(2, 96)
    assert {k: (tuple(batch[k].shape), str(batch[k].dtype)) for k in want} == want


def test_an_image_in_a_text_only_models_data_is_one_line_naming_the_record(tmp_path):
    _png(tmp_path / "img.png")
    message = _first_batch_error(["base.yml", "model_name=tiny", "sft_template=chatml"],
                                 [_turn(IMAGE_PART, {"type": "text", "text": "q"})], tmp_path)
    assert "\n" not in message and f"{tmp_path / 'train.jsonl'}:1: malformed record" in message, message
    assert "the model has no vision encoder" in message, message


def test_data_whose_every_image_record_is_refused_stops_in_one_line_instead_of_looping(tmp_path):
    """Under data_bad_record_policy=skip each refused record is reported and skipped; once a whole
    epoch gave nothing to train on, the run stops (it read the same records again: no end otherwise)."""
    from maxlite import config as C
    from maxlite.data.sft_pipeline import make_sft_dataset
    from maxlite.data.tokenizer import load_tokenizer

    _png(tmp_path / "img.png")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(_turn(IMAGE_PART, {"type": "text", "text": f"q{i}"})) + "\n" for i in range(3)))
    cfg = C.load(["base.yml", "model_name=tiny", "sft_template=chatml", "dataset_type=sft", f"dataset_path={data}",
                  "data_bad_record_policy=skip", "per_device_batch_size=1"])
    with pytest.raises(C.ConfigError, match=r"no usable conversation in the data: every one was refused \(3 malformed"):
        next(iter(make_sft_dataset(cfg, "train", 0, 1, load_tokenizer(cfg.tokenizer_path, cfg.bos_id, cfg.eos_id))))
