"""Gemma 4 with its vision tower end to end against transformers: a random Gemma4ForConditionalGeneration
(tests/hf_models.py gemma4_vl: the every-trait Gemma 4 decoder, sliding window 6, with a 2-layer tower
on 4-pixel patches pooled 2×2, standardised soft tokens, every norm moved away from 1) saved with its
Gemma4ImageProcessorPil (a budget of 70 soft tokens) and imported with `hf import`. Images of odd
sizes, preprocessed by our code, are encoded by our tower (an aspect ratio of its own: a number of
soft tokens of its own), placed where the processor's placeholders stand, seen both ways within
each image by the sliding-window layers; the float32 logits and 16 greedy tokens equal
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

BOS, IMG, BOI, EOI = 2, 4000, 4001, 4002
BUDGET = 70  # soft tokens an image may take (the processor's max_soft_tokens)


def _processor():
    return transformers.Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=BUDGET, pooling_kernel_size=2)


def _random_model(bidirectional: bool, clipped: bool = False):
    config = hf_models.gemma4_vl(IMG, BOI, EOI, bidirectional)
    config.vision_config.use_clipped_linears = clipped
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    hf_models.gemma4_perturbed(model)
    with torch.no_grad():  # the tower's norms and its standardisation away from their 1 / 0 starts
        for name, b in model.named_buffers():
            if "std_" in name:
                b.copy_(torch.randn_like(b) * 0.3 + (1.0 if "scale" in name else 0.0))
            if name.endswith(("input_min", "output_min")):  # bounds that clamp some of the values passing
                b.fill_(-0.5 - torch.rand(()).item())
            if name.endswith(("input_max", "output_max")):
                b.fill_(0.5 + torch.rand(()).item())
        for name, p in model.named_parameters():
            if "vision_tower" in name and p.ndim == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model


def _import(tmp_path_factory, bidirectional: bool, clipped: bool = False):
    torch.manual_seed(0)
    model = _random_model(bidirectional, clipped)
    path = tmp_path_factory.mktemp("gemma4_vision")
    model.save_pretrained(str(path))
    _processor().save_pretrained(str(path))
    cfg, pure = hf.import_hf(str(path), ["dtype=float32", "max_target_length=256"])
    return model, cfg, pure, path


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return _import(tmp_path_factory, bidirectional=True)


def _theirs_ids(prompt: list[int], images) -> list[int]:
    """Gemma4Processor's expansion of each image placeholder, its soft-token count transformers'."""
    counts = iter(_processor()(images=images, return_tensors="np")["num_soft_tokens_per_image"])
    out = []
    for t in prompt:
        out += [BOI, *[IMG] * int(next(counts)), EOI] if t == IMG else [t]
    return out


def _theirs(model, ids, images, new_tokens: int = 16):
    got = _processor()(images=images, return_tensors="pt")
    inputs = dict(input_ids=torch.tensor([ids]), pixel_values=got["pixel_values"],
                  image_position_ids=got["image_position_ids"], mm_token_type_ids=(torch.tensor([ids]) == IMG).long())
    with torch.no_grad():
        logits = model(**inputs).logits[0].float().numpy()
        new = model.generate(**inputs, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist() if new_tokens else []
    return logits, new


def _relative(ours, theirs) -> float:
    """The bridge tests' bound: the norm of the difference over the norm of transformers' logits."""
    return float(np.linalg.norm(np.asarray(ours) - theirs) / np.linalg.norm(theirs))


def _ours(cfg, prompt, images):
    ids, _, positions, arrays = image_docs.doc_arrays(image_docs.kind_of(cfg), np.asarray(prompt, np.int32),
                                                      np.zeros(len(prompt), bool), images, "test")
    assert positions is None
    return ids.tolist(), arrays


def test_import_reads_the_tower_the_token_ids_and_the_processor(imported):
    _, cfg, pure, _ = imported
    assert (cfg.decoder_block, cfg.vision_encoder, cfg.vision_num_layers, cfg.vision_num_kv_heads,
            cfg.vision_pool_size, cfg.vision_tokens_per_image, cfg.vision_standardize, cfg.vision_bidirectional) == \
        ("gemma4", "gemma4_vit", 2, 1, 2, BUDGET, True, True)
    assert (cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.pad_token_id) == \
        (IMG, BOI, EOI, 0)
    assert pure["vision"]["positions"].shape == (2, 64, 32)


def test_logits_and_greedy_tokens_equal_transformers_with_an_image(imported):
    model, cfg, pure, _ = imported
    image = random_image(45, 70, 3)
    prompt = [BOS, 17, 42, IMG, 99, 7, 23]
    ids, arrays = _ours(cfg, prompt, [image])
    assert ids == _theirs_ids(prompt, [image])
    want, theirs = _theirs(model, ids, [image])
    got = logits_with_images(cfg, pure, ids, np.arange(len(ids)), arrays)
    assert _relative(got, want) <= 1e-5

    state = P.to_state(cfg, P.to_jax_inplace(P.to_pure(pure)))
    ours = generate_ids(cfg, state, [prompt], Sampling(max_new_tokens=16), images=[[image]]).tokens[0]
    assert ours == theirs and len(set(ours)) > 3, (ours, theirs)


def test_blockwise_attention_draws_each_image_both_ways_as_transformers(imported):
    """attention=blockwise in key blocks of 8: the sliding-window layers see the image's later tokens from
    key blocks ahead of a query's own; the logits equal transformers'."""
    from maxlite import config as C

    model, cfg, pure, _ = imported
    image = random_image(45, 70, 3)
    prompt = [BOS, 17, 42, IMG, 99, 7, 23]
    prompt += [11] * (-len(_theirs_ids(prompt, [image])) % 8)  # the sequence in whole blocks
    ids, arrays = _ours(cfg, prompt, [image])
    assert len(ids) % 8 == 0 and ids.count(IMG) > 9  # the image spans more than one block
    want, _ = _theirs(model, ids, [image], new_tokens=0)
    keys = {k: v for k, v in C.to_plain_dict(cfg).items() if k not in ("attention", "attention_block_size")}
    blockwise = C.load(["attention=blockwise", "attention_block_size=8"], **keys)
    assert _relative(logits_with_images(blockwise, pure, ids, np.arange(len(ids)), arrays), want) <= 1e-5


def test_a_causal_checkpoint_with_clipped_linears(tmp_path_factory, tmp_path):
    """use_bidirectional_attention unset: every layer causal over the image; use_clipped_linears: each
    tower linear's input and output clamped to its stored bounds (they clamp here); its export equal."""
    model, cfg, pure, _ = _import(tmp_path_factory, bidirectional=False, clipped=True)
    assert not cfg.vision_bidirectional and cfg.vision_clipped
    assert np.isfinite(pure["vision"]["layers"]["q_input_min"]).all()
    image = random_image(61, 37, 8)
    ids, arrays = _ours(cfg, [BOS, 5, IMG, 9, 10], [image])
    want, _ = _theirs(model, ids, [image], new_tokens=0)
    got = logits_with_images(cfg, pure, ids, np.arange(len(ids)), arrays)
    assert _relative(got, want) <= 1e-5
    hf.export_hf(cfg, pure, str(tmp_path / "out"), tokenizer="none")
    back = transformers.AutoModelForImageTextToText.from_pretrained(str(tmp_path / "out")).eval()
    assert back.config.vision_config.use_clipped_linears
    theirs = dict(model.named_buffers())
    for name, b in back.named_buffers():
        if name.endswith(("_min", "_max")):
            assert float(b) == float(theirs[name]), name


def test_the_decode_prefill_sees_each_image_as_transformers(imported):
    """The prefill's logits (the cache filled through the training attention) at every prompt token."""
    from flax import nnx

    from maxlite.models import decode
    from maxlite.state import abstract_params

    model, cfg, pure, _ = imported
    image = random_image(45, 70, 3)
    ids, arrays = _ours(cfg, [BOS, 17, IMG, 99, 7], [image])
    want, _ = _theirs(model, ids, [image], new_tokens=0)
    graphdef, state = abstract_params(cfg)
    nnx.replace_by_pure_dict(state, pure)
    T = len(ids)

    @nnx.jit
    def prefill(m, tokens, images):
        x, _ = decode.forward(m, tokens, np.arange(T)[None], np.array([T], np.int32), decode.empty_cache(cfg, 1, T + 4),
                              decode.prefill_config(cfg, T), images)
        return m.logits(x)
    got = np.asarray(prefill(nnx.merge(graphdef, state), np.asarray(ids)[None], {k: v[None] for k, v in arrays.items()}))
    assert _relative(got[0], want) <= 1e-5


def test_two_images_of_other_shapes_in_a_prompt_and_a_batch_decode_as_each_alone(imported):
    model, cfg, pure, _ = imported
    images = [random_image(45, 70, 1), random_image(61, 37, 2)]
    prompt = [BOS, 5, IMG, 9, IMG, 10, 11]
    ids, _ = _ours(cfg, prompt, images)
    assert ids == _theirs_ids(prompt, images) and ids.count(IMG) < 2 * BUDGET
    _, theirs = _theirs(model, ids, images)
    state = P.to_state(cfg, P.to_jax_inplace(P.to_pure(pure)))
    other = [BOS, 3, IMG, 4, 8]
    together = generate_ids(cfg, state, [prompt, other], Sampling(max_new_tokens=16),
                            images=[images, images[1:]]).tokens
    assert together[0] == theirs, (together[0], theirs)
    assert together[1] == generate_ids(cfg, state, [other], Sampling(max_new_tokens=16), images=[images[1:]]).tokens[0]


def test_export_loads_in_transformers_with_the_same_logits(imported, tmp_path):
    model, cfg, pure, _ = imported
    hf.export_hf(cfg, pure, str(tmp_path / "out"), tokenizer="none")
    back = transformers.AutoModelForImageTextToText.from_pretrained(str(tmp_path / "out")).eval()
    assert type(back).__name__ == "Gemma4ForConditionalGeneration"
    processor = transformers.Gemma4ImageProcessorPil.from_pretrained(str(tmp_path / "out"))
    assert (processor.max_soft_tokens, processor.patch_size, processor.pooling_kernel_size) == (BUDGET, 4, 2)
    image = random_image(45, 70, 5)
    ids = _theirs_ids([BOS, 17, IMG, 99, 7], [image])
    got = processor(images=[image], return_tensors="pt")
    inputs = dict(input_ids=torch.tensor([ids]), pixel_values=got["pixel_values"],
                  image_position_ids=got["image_position_ids"], mm_token_type_ids=(torch.tensor([ids]) == IMG).long())
    with torch.no_grad():
        assert _relative(back(**inputs).logits.numpy(), model(**inputs).logits.numpy()) <= 1e-5


def test_vision_encoder_empty_imports_the_text_model_alone(imported):
    """`vision_encoder=` on the import command line: the decoder alone, its logits transformers' on text."""
    model, _, _, path = imported
    cfg, pure = hf.import_hf(str(path), ["dtype=float32", "max_target_length=128", "vision_encoder=",
                                         "vision_bidirectional=false"])
    assert not cfg.vision_encoder and "vision" not in pure
    ids = [BOS, 17, 42, 99, 7, 23, 5, 9, 11]
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    assert _relative(logits_with_images(cfg, pure, ids, np.arange(len(ids)), {}), want) <= 1e-5


def test_what_the_tower_cannot_be_is_refused_in_one_line(imported, tmp_path):
    from maxlite import config as C

    _, cfg, _, path = imported
    keys = C.to_plain_dict(cfg)
    with pytest.raises(C.ConfigError, match="vision_bidirectional=true is Gemma 4's"):
        C.load([], **{**keys, "vision_encoder": ""})
    with pytest.raises(C.ConfigError, match="vision_encoder=gemma4_vit needs vision_tokens_per_image"):
        C.load([], **{**keys, "vision_tokens_per_image": 0})
    with pytest.raises(C.ConfigError, match="set pad_token_id"):
        C.load([], **{**keys, "pad_token_id": -1})
    with pytest.raises(C.ConfigError, match="attention=flash cannot draw vision_encoder=gemma4_vit's"):
        C.load(["attention=flash"], **{k: v for k, v in keys.items() if k != "attention"})


def test_synthetic_rows_with_an_image_train_the_decoder_and_leave_the_frozen_tower(imported, tmp_path):
    """Two training steps on synthetic rows (a random image each, its soft tokens between boi and eoi):
    finite losses, the decoder moves, the frozen tower does not."""
    import jax
    from flax import nnx

    from maxlite import build as build_lib, config as C, mesh as mesh_lib
    from maxlite.data.synthetic import make_synthetic_iterator

    _, cfg, _, _ = imported
    keys = {**C.to_plain_dict(cfg), "dataset_type": "synthetic", "max_target_length": 64, "per_device_batch_size": 1,
            "steps": 2, "base_output_directory": str(tmp_path), "run_name": "syn", "dtype": "float32"}
    built = build_lib.build(C.load([], **keys), jax.devices()[:1], num_processes=1)
    state, data = built.init_state(), make_synthetic_iterator(built.cfg, "train", 0, 1)
    batch = next(data)
    assert batch["image_pixels"].shape[-1] == 3 * 4 * 4 and (batch["inputs"] == IMG).sum() > 0
    before = jax.device_get(nnx.to_pure_dict(state.params))
    with jax.set_mesh(built.mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        for b in (batch, next(data)):
            state, metrics = built.train_step(state, {k: jax.device_put(v, built.batch_sharding) for k, v in b.items()})
            assert np.isfinite(float(metrics["loss"]))
    after = jax.device_get(nnx.to_pure_dict(state.params))
    assert np.array_equal(after["vision"]["patch"], before["vision"]["patch"])
    assert np.array_equal(after["vision"]["std_scale"], before["vision"]["std_scale"])
    assert not np.array_equal(after["embedding"], before["embedding"])
