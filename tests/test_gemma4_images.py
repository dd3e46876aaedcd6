"""The data side of Gemma 4's images (vision_encoder=gemma4_vit): maxlite/data/images.py's
`gemma4_patches` against transformers' Gemma4ImageProcessorPil, and image_docs' Gemma4Images
(placeholders expanded in the ids as Gemma4Processor does, packed rows, synthetic rows).

No model is built: the tower is maxlite/models/vision/'s. Patch sizes are small so images stay small;
max_soft_tokens is one of the processor's (70, 140, ...).
"""

import functools
import math

import grain
import numpy as np
import pytest
from PIL import Image

from maxlite import config as C
from maxlite.data import image_docs, images

IMG, BOI, EOI = 500, 502, 503


def _config(patch: int = 4, pool: int = 2, tokens: int = 70, *more: str):
    """A recipe with a (small) gemma4_vit tower: the data side reads its patch, pool and budget."""
    tower = ["vision_num_layers=1", "vision_emb_dim=32", "vision_mlp_dim=64", "vision_num_heads=2",
             "vision_num_positions=64"]
    return C.load(["base.yml", "model_name=tiny", "vision_encoder=gemma4_vit", *tower, f"vision_patch_size={patch}",
                   f"vision_pool_size={pool}", f"vision_tokens_per_image={tokens}", f"image_token_id={IMG}",
                   f"vision_start_token_id={BOI}", f"vision_end_token_id={EOI}", "image_mean=[0, 0, 0]",
                   "image_std=[1, 1, 1]", "max_target_length=1024", *more])


def _processor(cfg):
    from transformers import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(patch_size=cfg.vision_patch_size, max_soft_tokens=cfg.vision_tokens_per_image,
                                   pooling_kernel_size=cfg.vision_pool_size)


def _image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    bands = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, bands), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if bands == 1 else pixels, mode)


# (width, height, mode): odd sizes both ways, 1-pixel extremes (a side rounds to nothing), transparency,
# grayscale, a tiny image scaled up, and 80 × 56 (4 · 2 · 70 patches of 4: already its own target size)
IMAGES = [(37, 53, "RGB"), (200, 41, "RGB"), (1, 300, "RGB"), (300, 1, "RGB"), (45, 31, "RGBA"), (29, 66, "L"),
          (3, 2, "RGB"), (80, 56, "RGB")]
SETTINGS = [(4, 2, 70), (4, 3, 140), (2, 1, 70), (3, 3, 70)]  # (patch, pool, max_soft_tokens)


@pytest.mark.parametrize("patch,pool,tokens", SETTINGS, ids=[f"p{p}-k{k}-t{t}" for p, k, t in SETTINGS])
def test_patches_positions_and_tokens_equal_transformers(patch, pool, tokens):
    cfg = _config(patch, pool, tokens)
    kind = image_docs.kind_of(cfg)
    for i, (width, height, mode) in enumerate(IMAGES):
        image = _image(width, height, mode, seed=i)
        hf = _processor(cfg)(images=image, return_tensors="np")
        counts, ours = kind.encode([images.to_rgb(image)], where="r")  # load_image's RGB, as training reads it
        name = f"{width}x{height} {mode}"
        assert ours["image_pixels"].dtype == np.float32 and ours["image_positions"].dtype == np.int32, name
        assert ours["image_pixels"].shape == hf["pixel_values"].shape == (1, tokens * pool**2, 3 * patch**2), name
        np.testing.assert_allclose(ours["image_pixels"], hf["pixel_values"], rtol=0, atol=1e-6, err_msg=name)
        np.testing.assert_array_equal(ours["image_positions"], hf["image_position_ids"], err_msg=name)
        assert counts == list(hf["num_soft_tokens_per_image"]), name


def test_several_images_of_a_document_equal_transformers_batch():
    cfg = _config(4, 2, 70)
    pictures = [_image(37, 53, seed=1), _image(200, 41, seed=2), _image(64, 64, seed=3)]
    hf = _processor(cfg)(images=pictures, return_tensors="np")
    counts, ours = image_docs.kind_of(cfg).encode(pictures, where="r")
    np.testing.assert_allclose(ours["image_pixels"], hf["pixel_values"], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(ours["image_positions"], hf["image_position_ids"])
    assert counts == list(hf["num_soft_tokens_per_image"])


def test_target_sizes_and_their_errors_equal_transformers():
    """Every (height, width) of a sweep, extremes and degenerate budgets included: the same size, or
    both refuse (ours in one ConfigError line naming the record)."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

    sizes = [(h, w) for h in (1, 2, 3, 7, 16, 41, 100, 333, 1000, 4096) for w in (1, 5, 8, 53, 200, 999, 5000)]
    for patch, pool, tokens in [*SETTINGS, (16, 3, 280), (14, 3, 1120), (4, 2, 0)]:
        for h, w in sizes:
            try:
                want = get_aspect_ratio_preserving_size(h, w, patch_size=patch, max_patches=tokens * pool**2,
                                                        pooling_kernel_size=pool)
            except ValueError:
                want = None
            if want is None:
                with pytest.raises(C.ConfigError) as e:
                    images.gemma4_size(h, w, patch_size=patch, pool_size=pool, max_soft_tokens=tokens,
                                       where="data.jsonl:9")
                assert str(e.value).startswith("data.jsonl:9: ") and "\n" not in str(e.value)
            else:
                assert images.gemma4_size(h, w, patch_size=patch, pool_size=pool, max_soft_tokens=tokens,
                                          where="r") == want, (patch, pool, tokens, h, w)


def test_a_budget_of_no_soft_tokens_is_refused_in_one_line_before_any_image():
    """(With a budget of one soft token or more no image resizes to 0 × 0: the processor's own error
    cannot arise from a recipe the config accepts.)"""
    with pytest.raises(C.ConfigError, match=r"^vision_encoder=gemma4_vit needs vision_tokens_per_image") as e:
        _config(4, 2, 0)
    assert "\n" not in str(e.value)


def test_doc_expands_each_placeholder_to_boi_its_soft_tokens_eoi_unsupervised():
    cfg = _config(4, 2, 70)
    pictures = [_image(200, 41, seed=1), _image(37, 90, seed=2)]  # wide, tall: different soft tokens
    n = [int(t) for t in _processor(cfg)(images=pictures, return_tensors="np")["num_soft_tokens_per_image"]]
    assert n[0] != n[1]
    ids = np.array([7, 8, IMG, 9, 10, IMG, 11], np.int32)
    mask = np.array([0, 0, 0, 1, 1, 1, 1], bool)
    out_ids, out_mask, positions, arrays = image_docs.doc_arrays(image_docs.kind_of(cfg), ids, mask, pictures, "r")
    run0, run1 = [BOI, *[IMG] * n[0], EOI], [BOI, *[IMG] * n[1], EOI]
    assert out_ids.tolist() == [7, 8, *run0, 9, 10, *run1, 11]
    assert out_mask.tolist() == [False, False, *[False] * len(run0), True, True, *[False] * len(run1), True]
    assert positions is None  # plain positions
    assert arrays["image_pixels"].shape == (2, 70 * 4, 48) and arrays["image_positions"].shape == (2, 70 * 4, 2)
    assert image_docs.text_expansion(cfg, None) is None  # the ids expand, never the text


@pytest.mark.parametrize("placeholders", [1, 3])
def test_images_and_placeholders_that_differ_in_number_are_one_line_naming_the_record(placeholders):
    ids = np.array([7, *[IMG] * placeholders, 8], np.int32)
    with pytest.raises(C.ConfigError) as e:
        image_docs.kind_of(_config()).doc(ids, np.ones(len(ids), bool), [_image(9, 9), _image(5, 12)],
                                          "data.jsonl:4")
    message = str(e.value)
    assert message.startswith(f"data.jsonl:4: 2 image(s) but {placeholders} image placeholder(s)")
    assert "\n" not in message


def test_packed_rows_keep_each_document_and_mark_empty_image_slots_minus_one():
    """The SFT pipeline's packing (its length struct from pack_lengths) and its row finish: a row of
    two documents with 1 + 2 images holds them in order; its fourth slot is empty, positions -1."""
    from maxlite.data.sft_pipeline import _finish

    cfg = _config(4, 2, 70, "max_images_per_row=4")
    kind = image_docs.kind_of(cfg)
    docs = []
    for d, pictures in enumerate([[_image(37, 53, seed=1)], [_image(200, 41, seed=2), _image(1, 300, seed=3)]]):
        ids, mask, _, arrays = kind.doc(np.array([1, 2, *[IMG] * len(pictures), 3], np.int32),
                                        np.ones(3 + len(pictures), bool), pictures, f"doc {d}")
        docs.append({"inputs": ids[:-1], "targets": ids[1:], "weights": mask[1:].astype(np.float32), **arrays})
    T = cfg.max_target_length
    lengths = {"inputs": T, "targets": T, "weights": T, **kind.pack_lengths(T)}
    packed = grain.experimental.FirstFitPackIterDataset(grain.MapDataset.source(docs).to_iter_dataset(),
                                                        length_struct=lengths, num_packing_bins=cfg.packing_bins,
                                                        seed=0, shuffle_bins=False)
    rows = list(packed.map(functools.partial(_finish, images=kind)))
    assert len(rows) == 1
    row = rows[0]
    want = kind.batch_shapes(1, T)
    assert {k: (tuple(row[k][None].shape), str(row[k].dtype)) for k in want} == want
    real = np.concatenate([d["image_positions"] for d in docs])
    np.testing.assert_array_equal(row["image_positions"][:3], real)
    np.testing.assert_array_equal(row["image_pixels"][:3], np.concatenate([d["image_pixels"] for d in docs]))
    assert (row["image_positions"][3] == -1).all() and (row["image_pixels"][3] == 0).all()


def test_synthetic_rows_carry_an_image_whose_soft_tokens_are_their_markers():
    from maxlite.data.synthetic import make_synthetic_iterator

    cfg = _config(4, 2, 70, "dataset_type=synthetic", "vocab_size=512", "max_target_length=32",
                  "per_device_batch_size=2")
    kind = image_docs.kind_of(cfg)
    batch = next(make_synthetic_iterator(cfg, "train", 0, 1))
    positions = batch["image_positions"]
    real = (positions >= 0).all(-1)
    assert positions.shape[1:] == (1, 70 * 4, 2) and batch["image_pixels"].shape[1:] == (1, 70 * 4, 48)
    assert (batch["image_pixels"][~real] == 0).all()
    markers = kind.synthetic_markers()
    for r in range(len(batch["inputs"])):
        n = int(real[r, 0].sum())
        cols, rows = positions[r, 0, :n].max(0) + 1
        assert cols * rows == n and cols != rows  # a whole grid, its two axes apart
        assert markers == [BOI, *[IMG] * (n // cfg.vision_pool_size**2), EOI]
        assert batch["inputs"][r, 1:1 + len(markers)].tolist() == markers
    assert math.prod(batch["positions"].shape) == math.prod(batch["inputs"].shape)  # plain positions
