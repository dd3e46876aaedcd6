"""Gemma 3 with images, the whole journey as a user runs it: a random Gemma3ForConditionalGeneration
built by transformers (a tokenizer holding Gemma's turn and image tokens, a Gemma-style chat template
that writes one <start_of_image> per image, its Gemma3ImageProcessorPil) → `hf import` → SFT on the
shapes task's image chat records (answers only, the tower frozen) → `generate --image --chat` → `hf
export` → transformers' own Gemma3Processor (which expands each <start_of_image> in the text) and
model answer with the same tokens."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

from maxlite.data.vision_task import write_shapes_task
from tests import hf_models
from tests.helpers import ROOT, process_env

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOKENS = 16


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3_vision_sft") / "hf"
    hf_models.save_gemma3_chat_model(path, 64, ["sliding_attention", "full_attention"], 8, 32, TOKENS)
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
                "steps=60", "learning_rate=0.005", "max_target_length=64", "max_images_per_row=3",
                "per_device_batch_size=4", "checkpoint_period=60", "eval_interval=0", "run_name=sft",
                f"base_output_directory={tmp_path}", "enable_tensorboard=false", "write_report=false",
                "dtype=float32")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "vision encoder siglip: frozen" in done.stdout, done.stdout
    losses = [json.loads(line)["loss"] for line in open(tmp_path / "sft" / "metrics.jsonl") if '"loss"' in line]
    assert len(losses) == 60 and all(np.isfinite(losses)) and losses[-1] < losses[0], losses

    record = json.loads(task["eval"].read_text().splitlines()[0])
    image = task["eval"].parent / record["messages"][0]["content"][0]["image"]
    question = record["messages"][0]["content"][1]["text"]
    # the turn's end is Gemma's stop token (its generation_config's eos beside <eos>)
    end_of_turn = hf_models.gemma3_chat_tokenizer().convert_tokens_to_ids("<end_of_turn>")
    done = _run("maxlite.generate", tmp_path / "sft", "--prompt", question, "--image", image, "--chat",
                "--max-new-tokens", "8", "dtype=float32", f"eos_id={end_of_turn}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(question), done.stdout
    ours = done.stdout.rstrip("\n")[len(question):]

    done = _run("maxlite.bridge.hf", "export", tmp_path / "sft" / "checkpoints", tmp_path / "out")
    assert done.returncode == 0, done.stderr[-3000:]
    out = str(tmp_path / "out")
    model = transformers.AutoModelForImageTextToText.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    processor = transformers.Gemma3Processor(image_processor=transformers.Gemma3ImageProcessorPil.from_pretrained(out),
                                             tokenizer=tok, image_seq_length=model.config.mm_tokens_per_image)
    from PIL import Image
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
                                   tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[[Image.open(image).convert("RGB")]], return_tensors="pt",
                       add_special_tokens=False)
    with torch.no_grad():
        new = model.generate(**inputs, do_sample=False, max_new_tokens=8, eos_token_id=tok.eos_token_id,
                             pad_token_id=0)[0, inputs["input_ids"].shape[1]:]
    theirs = tok.decode(new, skip_special_tokens=True)
    assert ours.strip() == theirs.strip() and ours.strip(), (ours, theirs)


def test_prompts_and_sft_records_expand_images_as_gemma3_processor(hf_dir):
    """Each <start_of_image> becomes "\\n\\n<start_of_image>" + soft tokens + "<end_of_image>\\n\\n" in the
    text, tokenized with its neighbours: our chat prompt and our SFT record (answer supervised, image
    tokens never) hold transformers' ids, two images in one turn included."""
    from PIL import Image

    from maxlite.bridge import hf
    from maxlite.data.chat import ChatTemplate
    from maxlite.data.tokenizer import load_tokenizer

    cfg = hf.prepare_import(str(hf_dir)).cfg
    ours = ChatTemplate.for_config(cfg, load_tokenizer(cfg.tokenizer_path, cfg.bos_id, cfg.eos_id))
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    processor = transformers.Gemma3Processor(image_processor=transformers.Gemma3ImageProcessorPil.from_pretrained(
        str(hf_dir)), tokenizer=tok, image_seq_length=TOKENS)
    image = Image.new("RGB", (45, 70))
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which\n\none?"},
                                        {"type": "image"}]}
    answer = {"role": "assistant", "content": "the red one"}
    for messages, prompt in (([user], True), ([user, answer], False)):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        theirs = processor(text=[text], images=[[image, image]], add_special_tokens=False)["input_ids"][0]
        if prompt:
            assert ours.prompt_ids(messages) == theirs
            continue
        ids, mask = ours.examples(messages)[0]
        assert ids.tolist() == theirs
        assert tok.decode(ids[mask]) == "the red one<end_of_turn>" and not mask[ids == cfg.image_token_id].any()
