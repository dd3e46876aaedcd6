"""Gemma 4 with images, the whole journey as a user runs it: a random Gemma4ForConditionalGeneration
built by transformers (a tokenizer holding Gemma 4's turn and image tokens, a Gemma-style chat template
that writes one <|image|> per image, its Gemma4ImageProcessorPil) → `hf import` → SFT on the shapes
task's image chat records (answers only, the tower frozen) → `generate --image --chat` → `hf export`
→ transformers answers with the same tokens. transformers' Gemma4Processor cannot be built here (it
needs a video processor, which needs torchvision); its image rule is applied as it states it
(`replace_image_token`: each <|image|> → <|image> + <|image|> × the image's soft tokens + <image|>),
the counts from transformers' own image processor."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

from maxlite.data.tokenizer import BUNDLED_DIR
from maxlite.data.vision_task import write_shapes_task
from tests import hf_models
from tests.helpers import ROOT, process_env

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPECIAL = ["<|turn>", "<turn|>", "<|image>", "<|image|>", "<image|>"]
TEMPLATE = ("{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
            "{% if c['type'] == 'image' %}<|image|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
            "<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")
BUDGET = 70


def _tokenizer():
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED_DIR / "tokenizer.json"), eos_token="<turn|>")
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.chat_template = TEMPLATE
    return tok


def _processor():
    return transformers.Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=BUDGET, pooling_kernel_size=2)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma4_vision_sft") / "hf"
    tok = _tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    config = hf_models.gemma4_vl(ids["<|image|>"], ids["<|image>"], ids["<image|>"])
    config.text_config.vocab_size = config.text_config.vocab_size_per_layer_input = len(tok)
    config.text_config.sliding_window = 16
    torch.manual_seed(0)
    transformers.Gemma4ForConditionalGeneration(config).eval().save_pretrained(str(path))
    tok.save_pretrained(str(path))
    _processor().save_pretrained(str(path))
    return path


def _run(module: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, env=process_env(1),
                          capture_output=True, text=True, timeout=900)


def _their_ids(tok, messages, images) -> list[int]:
    """The chat prompt as transformers renders it, each <|image|> expanded by Gemma4Processor's rule."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    counts = iter(_processor()(images=images, return_tensors="np")["num_soft_tokens_per_image"])
    boi, image, eoi = (tok.convert_tokens_to_ids(t) for t in ("<|image>", "<|image|>", "<image|>"))
    out = []
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        out += [boi, *[image] * int(next(counts)), eoi] if t == image else [t]
    return out


def test_import_sft_on_image_chat_generate_with_an_image_export_and_transformers_answers(hf_dir, tmp_path):
    from PIL import Image

    task = write_shapes_task(tmp_path / "shapes", train=48, eval=4, seed=0)
    done = _run("maxlite.bridge.hf", "import", hf_dir, tmp_path / "ck")
    assert done.returncode == 0, done.stderr[-3000:]
    recipe = tmp_path / "ck" / "recipe.yml"
    done = _run("maxlite.train", recipe, "dataset_type=sft", f"dataset_path={task['train']}", "sft_template=auto",
                "steps=40", "learning_rate=0.005", "max_target_length=160", "max_images_per_row=2",
                "per_device_batch_size=2", "checkpoint_period=40", "eval_interval=0", "run_name=sft",
                f"base_output_directory={tmp_path}", "enable_tensorboard=false", "write_report=false",
                "dtype=float32")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "vision encoder gemma4_vit: frozen" in done.stdout, done.stdout
    losses = [json.loads(line)["loss"] for line in open(tmp_path / "sft" / "metrics.jsonl") if '"loss"' in line]
    assert len(losses) == 40 and all(np.isfinite(losses)) and losses[-1] < losses[0], losses

    record = json.loads(task["eval"].read_text().splitlines()[0])
    image = task["eval"].parent / record["messages"][0]["content"][0]["image"]
    question = record["messages"][0]["content"][1]["text"]
    end_of_turn = _tokenizer().convert_tokens_to_ids("<turn|>")
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
    processor = transformers.Gemma4ImageProcessorPil.from_pretrained(out)
    picture = Image.open(image).convert("RGB")
    ids = _their_ids(tok, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
                     [picture])
    got = processor(images=[picture], return_tensors="pt")
    inputs = dict(input_ids=torch.tensor([ids]), pixel_values=got["pixel_values"],
                  image_position_ids=got["image_position_ids"],
                  mm_token_type_ids=(torch.tensor([ids]) == model.config.image_token_id).long())
    with torch.no_grad():
        new = model.generate(**inputs, do_sample=False, max_new_tokens=8, eos_token_id=end_of_turn,
                             pad_token_id=0)[0, len(ids):]
    theirs = tok.decode(new, skip_special_tokens=True)
    assert ours.strip() == theirs.strip() and ours.strip(), (ours, theirs)


def test_chat_prompts_and_sft_records_expand_images_as_gemma4_processor(hf_dir):
    """Our chat prompt and our SFT record (answer supervised, image tokens never) hold the ids
    transformers' template and Gemma4Processor's rule give, two images of other shapes in one turn."""
    from PIL import Image

    from maxlite.bridge import hf
    from maxlite.data import image_docs
    from maxlite.data.chat import ChatTemplate
    from maxlite.data.tokenizer import load_tokenizer

    cfg = hf.prepare_import(str(hf_dir)).cfg
    ours = ChatTemplate.for_config(cfg, load_tokenizer(cfg.tokenizer_path, cfg.bos_id, cfg.eos_id))
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    images = [Image.new("RGB", (45, 70)), Image.new("RGB", (90, 30))]
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which\n\none?"},
                                        {"type": "image"}]}
    theirs = _their_ids(tok, [user], images)
    kind = image_docs.kind_of(cfg)
    prompt = np.asarray(ours.prompt_ids([user]), np.int32)
    ids, _, _, _ = image_docs.doc_arrays(kind, prompt, np.zeros(len(prompt), bool), images, "test")
    assert ids.tolist() == theirs
    ids, mask = ours.examples([user, {"role": "assistant", "content": "the red one"}])[0]
    ids, mask, _, _ = image_docs.doc_arrays(kind, ids, mask, images, "test")
    assert ids.tolist()[:len(theirs)] == theirs
    assert tok.decode(ids[mask]) == "the red one<turn|>" and not mask[ids == cfg.image_token_id].any()


def test_a_plain_prompt_writes_one_image_token_per_image_which_expands_as_the_processor(hf_dir):
    """`generate --image` without --chat: the image's run (<|image> + soft tokens + <image|>) before the
    prompt's text, as Gemma4Processor expands one <|image|>, never doubled markers."""
    from PIL import Image

    from maxlite.bridge import hf, params as P
    from maxlite.data.tokenizer import load_tokenizer
    from maxlite.generate import Sampling, generate_text

    cfg, pure = hf.import_hf(str(hf_dir), ["dtype=float32"])
    tok = load_tokenizer(cfg.tokenizer_path, cfg.bos_id, cfg.eos_id)
    image = Image.new("RGB", (90, 30))
    _, got = generate_text(cfg, P.to_state(cfg, P.to_jax_inplace(P.to_pure(pure))), ["Which one?"], tok,
                           Sampling(max_new_tokens=1), images=[[image]])
    n = int(_processor()(images=[image], return_tensors="np")["num_soft_tokens_per_image"][0])
    text = list(tok.encode("Which one?"))
    bos = [tok.bos_id] if cfg.add_bos and tok.bos_id is not None else []
    assert got.prompts[0] == [*bos, cfg.vision_start_token_id, *[cfg.image_token_id] * n, cfg.vision_end_token_id,
                              *text]
