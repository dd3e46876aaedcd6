"""Gemma 3 with its vision tower end to end against transformers: a random Gemma3ForConditionalGeneration
(2-layer SigLIP tower on 64-pixel images in 8-pixel patches, pooled 2×2 to 16 soft tokens; a decoder of
one sliding-window layer (window 6, shorter than an image) and one global layer; every norm and bias
drawn away from 0 and 1) saved with its Gemma3ImageProcessorPil and imported with `hf import`. An image
of odd size, preprocessed by our code, is encoded by our tower, its tokens placed where the soft tokens
stand and seen both ways within the image, and the float32 logits and 16 greedy tokens equal
transformers'; the export loads in transformers' AutoModelForImageTextToText with the same logits."""

import numpy as np
import pytest
import torch
import transformers

from maxlite.bridge import hf, params as P
from maxlite.data import image_docs
from maxlite.generate import Sampling, generate_ids
from tests import hf_models
from tests.vision_helpers import logits_with_images, random_image

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BOS, NL, BOI, EOI, IMG = 2, 108, 250, 251, 252
TOKENS = 16  # soft tokens per image
MEAN, STD = [0.45, 0.5, 0.55], [0.3, 0.25, 0.35]


def _config():
    return hf_models.gemma3_vl(TOKENS, BOI, EOI, IMG)


def _processor():
    return transformers.Gemma3ImageProcessorPil(size={"height": 64, "width": 64}, image_mean=MEAN, image_std=STD)


def _random_model():
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(_config()).eval()
    with torch.no_grad():  # norms (1 + w, or the tower's w) and biases away from their 0 / 1 starts; weights larger
        for name, p in model.named_parameters():
            if p.ndim == 1:
                tower_norm = "vision" in name and ("layer_norm" in name or "layernorm" in name)
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if tower_norm else 0.0))
            else:
                p.mul_(2.0)
    return model


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    model = _random_model()
    path = tmp_path_factory.mktemp("gemma3_vision")
    model.save_pretrained(str(path))
    _processor().save_pretrained(str(path))
    cfg, pure = hf.import_hf(str(path), ["dtype=float32", "max_target_length=128"])
    return model, cfg, pure, path


def _expanded(*texts: list[int]) -> list[int]:
    """Gemma3Processor's expansion of one start-of-image between the given pieces of text ids."""
    image = [NL, BOI, *[IMG] * TOKENS, EOI, NL]
    out = list(texts[0])
    for piece in texts[1:]:
        out += image + list(piece)
    return out


def _theirs(model, ids, images):
    pixels = _processor()(images=images, return_tensors="pt")["pixel_values"]
    inputs = dict(input_ids=torch.tensor([ids]), pixel_values=pixels, token_type_ids=(torch.tensor([ids]) == IMG).long())
    with torch.no_grad():
        logits = model(**inputs).logits[0].float().numpy()
        new = model.generate(**inputs, do_sample=False, max_new_tokens=16, min_new_tokens=16, eos_token_id=None,
                             pad_token_id=0)[0, len(ids):].tolist()
    return logits, new


def test_import_reads_the_tower_the_token_ids_and_the_processor(imported):
    _, cfg, _, _ = imported
    assert (cfg.decoder_block, cfg.vision_encoder, cfg.vision_num_layers, cfg.vision_image_size,
            cfg.vision_tokens_per_image) == ("gemma3", "siglip", 2, 64, TOKENS)
    assert (cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id) == (IMG, BOI, EOI)
    assert (list(cfg.image_mean), list(cfg.image_std)) == (MEAN, STD)


@pytest.mark.parametrize("size", [(45, 70)])
def test_logits_and_greedy_tokens_equal_transformers_with_an_image(imported, size):
    model, cfg, pure, _ = imported
    image = random_image(*size, seed=size[0])
    ids = _expanded([BOS, 17, 42], [99, 7, 23])
    want, theirs = _theirs(model, ids, [image])

    ours_ids, _, positions, arrays = image_docs.doc_arrays(image_docs.kind_of(cfg), np.asarray(ids, np.int32),
                                                          np.zeros(len(ids), bool), [image], "test")
    assert ours_ids.tolist() == ids and positions is None
    got = logits_with_images(cfg, pure, ours_ids, np.arange(len(ours_ids)), arrays)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())

    state = P.to_state(cfg, P.to_jax_inplace(P.to_pure(pure)))
    ours = generate_ids(cfg, state, [ids], Sampling(max_new_tokens=16), images=[[image]]).tokens[0]
    assert ours == theirs and len(set(ours)) > 3, (ours, theirs)


def test_blockwise_attention_draws_each_image_both_ways_as_transformers(imported):
    """attention=blockwise in key blocks of 8: the image's 16 tokens reach two blocks ahead of its first,
    the sliding-window layer's window (6) is shorter than the image; the logits equal transformers'."""
    from maxlite import config as C

    model, cfg, pure, _ = imported
    ids = _expanded([BOS, 17, 42, 5, 6], [99, 7, 23, 8, 9, 10, 11])
    assert len(ids) == 32
    image = random_image(45, 70, 4)
    want, _ = _theirs(model, ids, [image])
    _, _, _, arrays = image_docs.doc_arrays(image_docs.kind_of(cfg), np.asarray(ids, np.int32),
                                            np.zeros(len(ids), bool), [image], "test")
    keys = {k: v for k, v in C.to_plain_dict(cfg).items() if k not in ("attention", "attention_block_size")}
    blockwise = C.load(["attention=blockwise", "attention_block_size=8"], **keys)
    got = logits_with_images(blockwise, pure, ids, np.arange(len(ids)), arrays)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_the_decode_prefill_sees_each_image_both_ways_as_transformers(imported):
    """The prefill's logits (the cache filled through the training attention) at every prompt token."""
    from flax import nnx

    from maxlite.models import decode
    from maxlite.state import abstract_params

    model, cfg, pure, _ = imported
    image = random_image(45, 70, 3)
    ids = _expanded([BOS, 17], [99, 7])
    want, _ = _theirs(model, ids, [image])
    _, _, _, arrays = image_docs.doc_arrays(image_docs.kind_of(cfg), np.asarray(ids, np.int32),
                                            np.zeros(len(ids), bool), [image], "test")
    graphdef, state = abstract_params(cfg)
    nnx.replace_by_pure_dict(state, pure)
    T = len(ids)

    @nnx.jit
    def prefill(m, tokens, images):
        x, _ = decode.forward(m, tokens, np.arange(T)[None], np.array([T], np.int32), decode.empty_cache(cfg, 1, T + 4),
                              decode.prefill_config(cfg, T), images)
        return m.logits(x)
    got = np.asarray(prefill(nnx.merge(graphdef, state), np.asarray(ids)[None], {k: v[None] for k, v in arrays.items()}))
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_two_images_in_one_prompt_and_a_batch_decode_as_each_alone(imported):
    model, cfg, pure, _ = imported
    images = [random_image(45, 70, 1), random_image(61, 37, 2)]
    ids = _expanded([BOS, 5], [9], [10, 11])
    want, theirs = _theirs(model, ids, images)
    state = P.to_state(cfg, P.to_jax_inplace(P.to_pure(pure)))
    other = _expanded([BOS, 3, 4], [8])
    together = generate_ids(cfg, state, [ids, other], Sampling(max_new_tokens=16), images=[images, images[:1]]).tokens
    assert together[0] == theirs, (together[0], theirs)
    assert together[1] == generate_ids(cfg, state, [other], Sampling(max_new_tokens=16), images=[images[:1]]).tokens[0]


def test_export_loads_in_transformers_with_the_same_logits(imported, tmp_path):
    model, cfg, pure, _ = imported
    hf.export_hf(cfg, pure, str(tmp_path / "out"), tokenizer="none")
    back = transformers.AutoModelForImageTextToText.from_pretrained(str(tmp_path / "out")).eval()
    processor = transformers.Gemma3ImageProcessorPil.from_pretrained(str(tmp_path / "out"))
    assert (list(processor.image_mean), processor.size["height"]) == (MEAN, 64)
    image = random_image(45, 70, 5)
    ids = _expanded([BOS, 17], [99, 7])
    pixels = processor(images=[image], return_tensors="pt")["pixel_values"]
    inputs = dict(input_ids=torch.tensor([ids]), pixel_values=pixels, token_type_ids=(torch.tensor([ids]) == IMG).long())
    with torch.no_grad():
        np.testing.assert_allclose(back(**inputs).logits.numpy(), model(**inputs).logits.numpy(), rtol=1e-5,
                                   atol=1e-5)


def test_images_and_their_placeholders_must_match(imported):
    _, cfg, pure, _ = imported
    state = P.to_state(cfg, P.to_jax_inplace(P.to_pure(pure)))
    with pytest.raises(ValueError, match=r"prompt 0: 2 image\(s\) but 1 image placeholder\(s\)"):
        generate_ids(cfg, state, [_expanded([BOS], [5])], Sampling(max_new_tokens=2),
                     images=[[random_image(40, 40, 0), random_image(40, 40, 1)]])


def test_attention_that_cannot_draw_image_blocks_is_refused(imported):
    """The kernels (flash, cudnn_flash) cannot draw an image's blocks: refused by name; `autoselected`
    picks XLA's two on every platform, blockwise at long sequences."""
    from maxlite import config as C
    from maxlite.models.names import resolve_attention

    _, cfg, _, _ = imported
    assert [resolve_attention("autoselected", p, 8192, 512, 512, image_blocks=True) for p in ("cpu", "gpu", "tpu")] \
        == ["blockwise"] * 3
    assert resolve_attention("autoselected", "tpu", 512, 512, 512, image_blocks=True) == "dot_product"
    keys = {k: v for k, v in C.to_plain_dict(cfg).items() if k != "attention"}
    for name in ("flash", "cudnn_flash"):
        with pytest.raises(C.ConfigError, match=f"attention={name} cannot draw vision_encoder=siglip's bidirectional"):
            C.load([f"attention={name}"], **keys)
    assert C.resolve(C.load([], **keys), 1, platform="gpu").attention == "dot_product"
    with pytest.raises(C.ConfigError, match="image blocks are not drawn across context shards"):
        C.resolve(C.load(["ici_context_parallelism=2", "ici_fsdp_parallelism=1"], **keys), 2, platform="cpu")


def test_vision_encoder_empty_imports_the_text_model_alone(imported):
    """`vision_encoder=` on the import command line: the decoder alone, its logits transformers' on text."""
    model, _, _, path = imported
    cfg, pure = hf.import_hf(str(path), ["dtype=float32", "max_target_length=128", "vision_encoder="])
    assert not cfg.vision_encoder and "vision" not in pure
    ids = [BOS, 17, 42, 99, 7, 23, 5, 9, 11]
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(logits_with_images(cfg, pure, ids, np.arange(len(ids)), {}), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_synthetic_rows_with_an_image_train_the_decoder_and_leave_the_frozen_tower(imported, tmp_path):
    """Two training steps on synthetic rows (one random image each, its soft tokens between boi and eoi):
    finite losses, the decoder moves, the frozen tower does not."""
    import jax
    from flax import nnx

    from maxlite import build as build_lib, config as C, mesh as mesh_lib
    from maxlite.data.synthetic import make_synthetic_iterator

    _, cfg, _, _ = imported
    keys = {**C.to_plain_dict(cfg), "dataset_type": "synthetic", "max_target_length": 32, "per_device_batch_size": 1,
            "steps": 2, "base_output_directory": str(tmp_path), "run_name": "syn", "dtype": "float32"}
    built = build_lib.build(C.load([], **keys), jax.devices()[:1], num_processes=1)
    state, data = built.init_state(), make_synthetic_iterator(built.cfg, "train", 0, 1)
    batch = next(data)
    assert batch["image_pixels"].shape == (1, 1, 3, 64, 64) and (batch["inputs"] == IMG).sum() == TOKENS
    before = jax.device_get(nnx.to_pure_dict(state.params))
    with jax.set_mesh(built.mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        for b in (batch, next(data)):
            state, metrics = built.train_step(state, {k: jax.device_put(v, built.batch_sharding) for k, v in b.items()})
            assert np.isfinite(float(metrics["loss"]))
    after = jax.device_get(nnx.to_pure_dict(state.params))
    assert np.array_equal(after["vision"]["patch"], before["vision"]["patch"])
    assert not np.array_equal(after["embedding"], before["embedding"])
