"""Qwen3-VL-MoE end to end against transformers: a random Qwen3VLMoeForConditionalGeneration (2-layer
vision tower, patch 8, DeepStack at layers 0 and 1; 3 decoder layers, each 8 experts of width 24, top 2)
imported with `hf import`; an image whose sides are not multiples of the patch, preprocessed by our
code, is encoded by our tower, and the float32 logits and 16 greedy tokens equal transformers' for the
same image through its own image processor. The experts come in either layout (transformers 5 writes
them transposed from the published files); the export writes the published one, which transformers
loads to the same logits."""

import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from maxlite.bridge import hf, params as P
from maxlite.data import image_docs
from maxlite.generate import Sampling, generate_ids
from tests.hf_models import qwen3_vl_moe
from tests.vision_helpers import logits_with_images, qwen_processor, random_image

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IMAGE, START, END = 250, 252, 253
E, F = 8, 24  # 2F = 48 ≠ D = 64: the two expert layouts read apart


def _config():
    return qwen3_vl_moe(E, F, layers=3, positions=512, depth=2, init=0.2, temporal_patch_size=2, spatial_merge_size=2,
                        in_channels=3, initializer_range=0.2)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.Qwen3VLMoeForConditionalGeneration(_config()).eval()
    path = tmp_path_factory.mktemp("qwen3_vl_moe")
    model.save_pretrained(str(path / "hf"))
    qwen_processor().save_pretrained(str(path / "hf"))
    cfg, pure = hf.import_hf(str(path / "hf"), ["dtype=float32", "max_target_length=128"])
    return model, path, cfg, pure


def _inputs(model_ids_image):
    prompt, image = model_ids_image
    theirs_in = qwen_processor()(images=[image], return_tensors="pt")
    ids = []
    for t in prompt:
        ids += [t] * (int(np.prod(theirs_in["image_grid_thw"][0].tolist())) // 4 if t == IMAGE else 1)
    return ids, dict(input_ids=torch.tensor([ids]), pixel_values=theirs_in["pixel_values"],
                     image_grid_thw=theirs_in["image_grid_thw"], mm_token_type_ids=(torch.tensor([ids]) == IMAGE).int())


def _ours(cfg, pure, prompt, image):
    kind = image_docs.QwenImages(cfg)
    ids, _, rope, arrays = image_docs.doc_arrays(kind, np.asarray(prompt, np.int32), np.zeros(len(prompt), bool),
                                                 [image], "test")
    return ids, logits_with_images(cfg, pure, ids, rope, arrays)


def test_logits_and_greedy_tokens_equal_transformers_with_an_image(imported):
    model, _, cfg, pure = imported
    assert (cfg.decoder_block, cfg.num_experts, cfg.base_moe_mlp_dim, cfg.vision_deepstack_layers) == \
        ("qwen3_vl_moe", E, F, (0, 1))
    prompt, image = [1, 2, START, IMAGE, END, 17, 42, 99], random_image(45, 70, seed=45)
    ids, inputs = _inputs((prompt, image))
    with torch.no_grad():
        want = model(**inputs).logits[0].numpy()
        theirs = model.generate(**inputs, do_sample=False, max_new_tokens=16, min_new_tokens=16, eos_token_id=None,
                                pad_token_id=0)[0, len(ids):].tolist()
    ours_ids, got = _ours(cfg, pure, prompt, image)
    assert ours_ids.tolist() == ids
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    state = P.to_state(cfg, P.to_jax_inplace(P.to_pure(pure)))
    ours = generate_ids(cfg, state, [prompt], Sampling(max_new_tokens=16), images=[[image]]).tokens[0]
    assert ours == theirs and len(set(ours)) > 3, (ours, theirs)


def test_the_published_expert_layout_imports_the_same_and_the_export_writes_it(imported, tmp_path):
    model, path, cfg, pure = imported
    saved = load_file(str(path / "hf" / "model.safetensors"))
    name = "model.language_model.layers.0.mlp.experts."
    assert tuple(saved[name + "gate_up_proj"].shape) == (E, 2 * F, 64)  # transformers 5 writes them transposed
    published = {k: (v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v)
                 for k, v in saved.items()}
    (tmp_path / "published").mkdir()
    save_file(published, str(tmp_path / "published" / "model.safetensors"), metadata={"format": "pt"})
    for f in ("config.json", "preprocessor_config.json"):
        (tmp_path / "published" / f).write_text((path / "hf" / f).read_text())
    _, again = hf.import_hf(str(tmp_path / "published"), ["dtype=float32", "max_target_length=128"])
    mine, theirs = dict(P.leaves(P.to_pure(again))), dict(P.leaves(P.to_pure(pure)))
    assert mine.keys() == theirs.keys()
    for leaf in mine:
        np.testing.assert_array_equal(mine[leaf], theirs[leaf])

    hf.export_hf(cfg, pure, str(tmp_path / "back"))
    exported = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert tuple(exported[name + "gate_up_proj"].shape) == (E, 64, 2 * F)  # the published layout
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == \
        ["Qwen3VLMoeForConditionalGeneration"]
    back = transformers.AutoModelForImageTextToText.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    assert type(back) is type(model)
    _, inputs = _inputs(([1, START, IMAGE, END, 5], random_image(61, 37, seed=2)))
    with torch.no_grad():
        np.testing.assert_allclose(back(**inputs).logits.numpy(), model(**inputs).logits.numpy(), rtol=1e-6, atol=1e-6)


def test_experts_not_in_every_layer_are_refused_in_one_line(imported, tmp_path):
    _, path, _, _ = imported
    config = json.loads((path / "hf" / "config.json").read_text())
    config["text_config"]["mlp_only_layers"] = [0]
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        hf.import_hf(str(tmp_path / "hf"))
    assert str(err.value) == ("config.json: mlp_only_layers=[0], decoder_sparse_step=1: maxlite's Qwen3-VL-MoE has "
                              "experts in every layer")
