"""Qwen3-VL end to end against transformers: a random Qwen3VLForConditionalGeneration (2-layer vision
tower, patch 8, DeepStack at layers 0 and 1; 3 decoder layers) imported with `hf import`; an image
whose sides are not multiples of the patch, preprocessed by our code (maxlite/data/images.py), is
encoded by our tower, its tokens placed and turned by multimodal RoPE, and the float32 logits and the
greedy tokens equal transformers' for the same image through its own image processor."""

import numpy as np
import pytest
import torch
import transformers

from maxlite.bridge import hf, params as P
from maxlite.data import image_docs
from maxlite.generate import Sampling, generate_ids
from tests.hf_models import qwen3_vl
from tests.vision_helpers import QWEN_MAX_PIXELS, QWEN_MIN_PIXELS, logits_with_images, qwen_processor, random_image

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IMAGE, START, END, VIDEO = 250, 252, 253, 251


def _config():
    return qwen3_vl(layers=3, positions=512, depth=2, init=0.2, temporal_patch_size=2, spatial_merge_size=2,
                    in_channels=3, initializer_range=0.2)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.Qwen3VLForConditionalGeneration(_config()).eval()
    path = tmp_path_factory.mktemp("qwen3_vl")
    model.save_pretrained(str(path))
    qwen_processor().save_pretrained(str(path))
    cfg, pure = hf.import_hf(str(path), ["dtype=float32", "max_target_length=128"])
    return model, cfg, pure


def _theirs_expanded(ids: list[int], grids) -> list[int]:
    """transformers' processor's expansion: each <|image_pad|> → prod(grid) / merge² of them."""
    out, k = [], 0
    for t in ids:
        out += [t] * (int(np.prod(grids[k])) // 4 if t == IMAGE else 1)
        k += t == IMAGE
    return out


def test_import_reads_the_vision_tower_and_the_processor(imported):
    _, cfg, _ = imported
    assert (cfg.decoder_block, cfg.vision_encoder, cfg.vision_num_layers, cfg.vision_deepstack_layers) == \
        ("qwen3_vl", "qwen_vit", 2, (0, 1))
    assert (cfg.mrope_sections, cfg.image_token_id, cfg.image_min_pixels, cfg.image_max_pixels) == \
        ((3, 3, 2), IMAGE, QWEN_MIN_PIXELS, QWEN_MAX_PIXELS)


@pytest.mark.parametrize("size", [(45, 70), (61, 37)])
def test_logits_and_greedy_tokens_equal_transformers_with_an_image(imported, size):
    model, cfg, pure = imported
    image = random_image(*size, seed=size[0])
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
    _, cfg, pure = imported
    state = P.to_state(cfg, P.to_jax_inplace(P.to_pure(pure)))
    prompts = [[1, START, IMAGE, END, 5], [3, 4, START, IMAGE, END, START, IMAGE, END, 9, 10]]
    images = [[random_image(45, 70, 1)], [random_image(61, 37, 2), random_image(33, 90, 3)]]
    together = generate_ids(cfg, state, prompts, Sampling(max_new_tokens=8), images=images).tokens
    alone = [generate_ids(cfg, state, [p], Sampling(max_new_tokens=8), images=[i]).tokens[0]
             for p, i in zip(prompts, images)]
    assert together == alone


def test_placeholders_and_images_must_match_in_number(imported):
    _, cfg, pure = imported
    state = P.to_state(cfg, P.to_jax_inplace(P.to_pure(pure)))
    with pytest.raises(ValueError, match=r"prompt 0: 2 image\(s\) but 1 image placeholder\(s\)"):
        generate_ids(cfg, state, [[1, START, IMAGE, END]], Sampling(max_new_tokens=2),
                     images=[[random_image(40, 40, 0), random_image(40, 40, 1)]])


def test_context_parallelism_is_refused_in_one_line(imported):
    """The load-balanced layout reorders a row's arrays: its image patches must not be split with its tokens."""
    from maxlite import config as C

    _, cfg, _ = imported
    keys = {k: v for k, v in C.to_plain_dict(cfg).items() if k != "attention"}
    with pytest.raises(C.ConfigError, match="a row's images are not split over context shards"):
        C.resolve(C.load(["ici_context_parallelism=2", "ici_fsdp_parallelism=1"], **keys), 2, platform="cpu")
