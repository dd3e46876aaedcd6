"""Qwen3.5's multimodal checkpoint against transformers: a random Qwen3_5ForConditionalGeneration (a
2-block vision tower of patch 8; 4 decoder layers, 3 gated delta-net : 1 full attention, whose
attention turns 12 of 16 dims by multimodal RoPE) and a Qwen3_5MoeForConditionalGeneration (2 layers,
[linear, full]) imported with `hf import`: an image whose sides are not multiples of the patch,
preprocessed by our code (maxlite/data/images.py), is encoded by our tower and its tokens placed and
turned by multimodal RoPE; the float32 logits and 16 greedy tokens equal transformers' for the same
image through its own image processor. The export writes the same class and processor back."""

import json

import numpy as np
import pytest
import torch
import transformers

from maxlite.bridge import hf, params as P
from maxlite.data import image_docs
from maxlite.generate import Sampling, generate_ids
from tests.hf_models import qwen3_5_vl
from tests.vision_helpers import QWEN_MAX_PIXELS, QWEN_MIN_PIXELS, logits_with_images, qwen_processor, random_image

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IMAGE, START, END = 250, 252, 253
MODELS = {"qwen3_5": (transformers.Qwen3_5ForConditionalGeneration, ("linear_attention",) * 3 + ("full_attention",)),
          "qwen3_5_moe": (transformers.Qwen3_5MoeForConditionalGeneration, ("linear_attention", "full_attention"))}


def _hf_model(family: str):
    cls, layer_types = MODELS[family]
    torch.manual_seed(0)
    model = cls(qwen3_5_vl(layer_types, moe=family == "qwen3_5_moe")).eval()
    with torch.no_grad():  # the tower's biases and norms away from HF's 0 and 1: a dropped one must show
        for name, p in model.model.visual.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=sorted(MODELS))
def imported(request, tmp_path_factory):
    model = _hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(str(path))
    qwen_processor().save_pretrained(str(path))
    cfg, pure = hf.import_hf(str(path), ["dtype=float32", "max_target_length=128"])
    return request.param, model, cfg, pure, path


def _theirs_expanded(ids: list[int], grids) -> list[int]:
    """transformers' processor's expansion: each <|image_pad|> → prod(grid) / merge² of them."""
    out, k = [], 0
    for t in ids:
        out += [t] * (int(np.prod(grids[k])) // 4 if t == IMAGE else 1)
        k += t == IMAGE
    return out


def test_import_reads_the_vision_tower_and_the_processor(imported):
    family, _, cfg, _, _ = imported
    assert (cfg.decoder_block, cfg.vision_encoder, cfg.vision_num_layers, cfg.vision_deepstack_layers) == \
        (family, "qwen_vit", 2, ())
    assert (cfg.mrope_sections, cfg.partial_rotary_factor, cfg.image_token_id, cfg.image_min_pixels,
            cfg.image_max_pixels) == ((2, 2, 2), 0.75, IMAGE, QWEN_MIN_PIXELS, QWEN_MAX_PIXELS)


def test_logits_and_greedy_tokens_equal_transformers_with_an_image(imported):
    family, model, cfg, pure, _ = imported
    image = random_image(45, 70, seed=45)
    prompt = [1, 2, START, IMAGE, END, 17, 42, 99]
    theirs_in = qwen_processor()(images=[image], return_tensors="pt")
    grids = theirs_in["image_grid_thw"].tolist()
    ids = _theirs_expanded(prompt, grids)
    inputs = dict(input_ids=torch.tensor([ids]), pixel_values=theirs_in["pixel_values"],
                  image_grid_thw=theirs_in["image_grid_thw"], mm_token_type_ids=(torch.tensor([ids]) == IMAGE).int())
    with torch.no_grad():
        want = model(**inputs).logits[0].numpy()
        theirs = model.generate(**inputs, do_sample=False, max_new_tokens=16,
                                min_new_tokens=16, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()

    kind = image_docs.QwenImages(cfg)
    ours_ids, _, rope, arrays = image_docs.doc_arrays(kind, np.asarray(prompt, np.int32), np.zeros(len(prompt), bool),
                                                     [image], "test")
    assert ours_ids.tolist() == ids
    got = logits_with_images(cfg, pure, ours_ids, rope, arrays)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())

    state = P.to_state(cfg, P.to_jax_inplace(P.to_pure(pure)))
    ours = generate_ids(cfg, state, [prompt], Sampling(max_new_tokens=16), images=[[image]]).tokens[0]
    assert ours == theirs and len(set(ours)) > 3, (ours, theirs)


def test_batched_prompts_with_different_images_decode_as_each_alone(imported):
    _, _, cfg, pure, _ = imported
    state = P.to_state(cfg, P.to_jax_inplace(P.to_pure(pure)))
    prompts = [[1, START, IMAGE, END, 5], [3, 4, START, IMAGE, END, START, IMAGE, END, 9, 10]]
    images = [[random_image(45, 70, 1)], [random_image(61, 37, 2), random_image(33, 90, 3)]]
    together = generate_ids(cfg, state, prompts, Sampling(max_new_tokens=8), images=images).tokens
    alone = [generate_ids(cfg, state, [p], Sampling(max_new_tokens=8), images=[i]).tokens[0]
             for p, i in zip(prompts, images)]
    assert together == alone


def test_export_writes_the_multimodal_class_and_its_processor(imported, tmp_path):
    """`hf export` of the imported model: the same class (every tensor equal), the same image processor."""
    family, model, cfg, pure, path = imported
    hf.export_hf(cfg, pure, str(tmp_path / "out"), tokenizer="none")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__] and config["model_type"] == family
    back = transformers.AutoModelForImageTextToText.from_pretrained(str(tmp_path / "out")).eval()
    assert type(back) is type(model)
    theirs, ours = model.state_dict(), back.state_dict()
    assert set(theirs) == set(ours)
    for name in theirs:
        np.testing.assert_array_equal(ours[name].numpy(), theirs[name].numpy(), err_msg=name)
    processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(str(tmp_path / "out"))
    image = random_image(61, 37, 4)
    np.testing.assert_array_equal(processor(images=[image], return_tensors="np")["pixel_values"],
                                  qwen_processor()(images=[image], return_tensors="np")["pixel_values"])


def test_a_text_only_checkpoint_stays_a_text_model(tmp_path):
    """Qwen3_5ForCausalLM imports with no vision keys, no M-RoPE sections and no processor settings."""
    from tests.hf_models import model

    model("qwen3_5_text").save_pretrained(str(tmp_path / "text"))
    cfg, _ = hf.import_hf(str(tmp_path / "text"), ["dtype=float32"])
    assert (cfg.vision_encoder, cfg.mrope_sections, cfg.image_token_id, cfg.image_min_pixels) == ("", (), -1, 0)
    assert hf.adapter("maxlite.families.qwen3_5.hf").hf_config(cfg)["architectures"] == ["Qwen3_5ForCausalLM"]
