"""The Qwen3-VL / Qwen3.5 vision tower against transformers' own: random tiny float32 models built
from configs (2 blocks, patch 8, merge 2, DeepStack after block 0 for Qwen3-VL), images made with
PIL from seeded noise and processed by HF's Qwen2VLImageProcessorPil (its Qwen3VLProcessor needs
torchvision), the tower run on a mesh (fsdp 2 × tensor 2) under maxlite's logical-axis rules."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

from maxlite import config as C
from maxlite.mesh import RULES
from maxlite.models.vision import qwen_vit_hf
from maxlite.models.vision.qwen_vit import QwenVisionSpec, QwenVisionTower, flops_per_patch, patch_layout, stack_layouts
from maxlite.schema import MESH_AXES
from tests.helpers import dot_equations

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=48, num_position_embeddings=16)
TEXT = dict(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=24,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 4, 4]})
SIZES = {"A": (45, 70), "B": (33, 50), "C": (60, 41)}  # (height, width) in pixels: none a multiple of 8


def hf_model(family: str):
    import torch
    import transformers as T

    torch.manual_seed(0)
    if family == "qwen3_vl":
        cfg = T.Qwen3VLConfig(vision_config={**VISION, "deepstack_visual_indexes": [0]}, text_config=TEXT)
        model = T.Qwen3VLForConditionalGeneration(cfg)
    else:
        text = {**TEXT, "layer_types": ["linear_attention", "full_attention"]}
        model = T.Qwen3_5ForConditionalGeneration(T.Qwen3_5Config(vision_config=VISION, text_config=text))
    # Random biases and norms too (HF initialises them to 0 and 1): a swapped or dropped one must show.
    with torch.no_grad():
        for name, p in model.model.visual.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5"])
def hf(request):
    return request.param, hf_model(request.param)


def pixels(name: str):
    """HF's pixel_values rows [N, C] and grid (t, h, w) of the seeded noise image `name`."""
    import transformers as T
    from PIL import Image

    h, w = SIZES[name]
    noise = np.random.default_rng(ord(name)).integers(0, 256, (h, w, 3), dtype=np.uint8)
    proc = T.Qwen2VLImageProcessorPil(patch_size=8, temporal_patch_size=2, merge_size=2,
                                      min_pixels=16 * 16, max_pixels=64 * 64)
    out = proc(images=[Image.fromarray(noise)], return_tensors="np")
    return out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])


def hf_outputs(model, rows, grid):
    """transformers' tower on one image: (tokens [M, O], DeepStack features [K, M, O])."""
    import torch

    with torch.no_grad():
        out = model.model.visual(torch.from_numpy(rows), grid_thw=torch.tensor([grid]))
    deepstack = getattr(out, "deepstack_features", None) or []
    return out.pooler_output.numpy(), np.stack([d.numpy() for d in deepstack]) if deepstack else np.zeros((0,))


def mesh():
    sizes = {a: 1 for a in MESH_AXES} | {"fsdp": 2, "tensor": 2}
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes),
                         devices=jax.devices()[:4])


def loaded_tower(model, max_frame_patches: int = 0):
    """Our tower with the HF model's vision weights (from_hf), and a jitted forward."""
    spec = dataclasses.replace(QwenVisionSpec.from_hf(model.config.vision_config), max_frame_patches=max_frame_patches)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    tower_mesh = mesh()
    with jax.set_mesh(tower_mesh), nnx.logical_axis_rules(RULES):
        tower = QwenVisionTower(spec, rngs=nnx.Rngs(1))
        ours = qwen_vit_hf.from_hf(state, spec, qwen_vit_hf.PREFIXES[type(model).__name__])
        nnx.update(tower, jax.tree.map(lambda old, new: jax.device_put(new, old.sharding),
                                       nnx.to_pure_dict(nnx.state(tower)), ours))
    forward = nnx.jit(lambda t, p, layout: t(p, layout))

    def run(pixels_BNC, layout):
        with jax.set_mesh(tower_mesh), nnx.logical_axis_rules(RULES):
            tokens, deepstack = forward(tower, jnp.asarray(pixels_BNC), {k: jnp.asarray(v) for k, v in layout.items()})
        return np.asarray(tokens), np.asarray(deepstack)
    return spec, tower, run


def padded(rows_list, max_patches):
    """Images' pixel rows one after another, zero rows to max_patches."""
    rows = np.concatenate(rows_list)
    return np.concatenate([rows, np.zeros((max_patches - len(rows), rows.shape[1]), rows.dtype)])


def test_tokens_and_deepstack_equal_transformers(hf):
    family, model = hf
    spec, _, run = loaded_tower(model)
    assert len(spec.deepstack_visual_indexes) == (1 if family == "qwen3_vl" else 0)
    rows, grid = pixels("A")
    assert grid[1] * 8 != SIZES["A"][0] or grid[2] * 8 != SIZES["A"][1]  # the processor resized it
    want_tokens, want_deepstack = hf_outputs(model, rows, grid)
    max_patches = len(rows) + 16  # and padding after it
    tokens, deepstack = run(padded([rows], max_patches)[None], stack_layouts([patch_layout([grid], spec, max_patches)]))
    M = len(want_tokens)
    np.testing.assert_allclose(tokens[0, :M], want_tokens, rtol=1e-5, atol=1e-6)
    assert deepstack.shape[0] == len(spec.deepstack_visual_indexes)
    if deepstack.shape[0]:
        np.testing.assert_allclose(deepstack[:, 0, :M], want_deepstack, rtol=1e-5, atol=1e-6)


def test_video_frames_equal_transformers(hf):
    """A two-frame grid (a video: HF attends within each frame) from seeded pixel rows, then an image."""
    _, model = hf
    spec, _, run = loaded_tower(model)
    video = (2, 4, 6)
    rows = np.random.default_rng(1).standard_normal((math.prod(video), spec.patch_dim)).astype(np.float32)
    image_rows, image = pixels("B")
    want_tokens, want_deepstack = hf_outputs(model, rows, video)
    max_patches = len(rows) + len(image_rows) + 4
    layout = stack_layouts([patch_layout([video, image], spec, max_patches)])
    tokens, deepstack = run(padded([rows, image_rows], max_patches)[None], layout)
    M = len(want_tokens)
    np.testing.assert_allclose(tokens[0, :M], want_tokens, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tokens[0, M:M + len(image_rows) // 4], hf_outputs(model, image_rows, image)[0],
                               rtol=1e-5, atol=1e-6)
    if deepstack.shape[0]:
        np.testing.assert_allclose(deepstack[:, 0, :M], want_deepstack, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("band", ["dense", "banded"])
def test_images_in_one_row_and_a_padded_batch_equal_each_alone(hf, band):
    """Several images in a row and a padded batch give each image's transformers outputs: attention
    dense over the row, or in bands of the largest frame (banded_attention: 2-3 chunks a row here,
    frames across chunk boundaries)."""
    _, model = hf
    largest = max(math.prod(pixels(name)[1]) for name in SIZES)
    spec, _, run = loaded_tower(model, max_frame_patches=largest if band == "banded" else 0)
    images = {name: pixels(name) for name in SIZES}
    max_patches = 128
    batch_rows = [["A", "B"], ["B", "A", "C"]]  # A and C across the chunk boundaries at 48 and 96
    pixels_BNC = np.stack([padded([images[n][0] for n in names], max_patches) for names in batch_rows])
    layout = stack_layouts([patch_layout([images[n][1] for n in names], spec, max_patches) for names in batch_rows])
    tokens, deepstack = run(pixels_BNC, layout)
    for b, names in enumerate(batch_rows):
        start = 0
        for name in names:
            want_tokens, want_deepstack = hf_outputs(model, *images[name])
            M = len(want_tokens)
            np.testing.assert_allclose(tokens[b, start:start + M], want_tokens, rtol=1e-5, atol=1e-6, err_msg=name)
            if deepstack.shape[0]:
                np.testing.assert_allclose(deepstack[:, b, start:start + M], want_deepstack, rtol=1e-5, atol=1e-6)
            start += M


def test_hf_weights_round_trip_exactly_and_all_are_consumed(hf):
    _, model = hf
    spec = QwenVisionSpec.from_hf(model.config.vision_config)
    prefix = qwen_vit_hf.PREFIXES[type(model).__name__]
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    vision = {k: v for k, v in state.items() if k.startswith(prefix)}
    ours = qwen_vit_hf.from_hf(state, spec, prefix)
    with jax.set_mesh(mesh()), nnx.logical_axis_rules(RULES):
        tower = QwenVisionTower(spec, rngs=nnx.Rngs(0))
    assert jax.tree.map(np.shape, ours) == jax.tree.map(np.shape, nnx.to_pure_dict(nnx.state(tower)))
    nnx.update(tower, ours)
    back = qwen_vit_hf.to_hf(nnx.state(tower), spec, prefix)
    assert back.keys() == vision.keys()
    for name, value in vision.items():
        assert back[name].dtype == value.dtype and np.array_equal(back[name], value), name
    with pytest.raises(ValueError, match="does not have"):
        qwen_vit_hf.from_hf({**state, prefix + "blocks.9.norm1.weight": vision[prefix + "blocks.0.norm1.weight"]},
                            spec, prefix)
    with pytest.raises(ValueError, match="lacks 1"):
        qwen_vit_hf.from_hf({k: v for k, v in state.items() if k != prefix + "merger.norm.bias"}, spec, prefix)


def test_spec_round_trips_the_hf_vision_config(hf):
    _, model = hf
    config = model.config.vision_config
    spec = QwenVisionSpec.from_hf(config)
    rebuilt = type(config)(**spec.to_hf()).to_dict()
    assert {k: v for k, v in rebuilt.items() if k != "transformers_version"} == \
           {k: v for k, v in config.to_dict().items() if k != "transformers_version"}


def test_flops_per_patch_counts_the_towers_matmuls(hf):
    """Every dot of the traced forward on one image filling its row (dense attention is then the
    image's own), against the formula."""
    _, model = hf
    spec = QwenVisionSpec.from_hf(model.config.vision_config)
    grid = (1, 6, 8)
    N = math.prod(grid)
    with jax.set_mesh(mesh()), nnx.logical_axis_rules(RULES):
        tower = QwenVisionTower(spec, rngs=nnx.Rngs(0))
    layout = stack_layouts([patch_layout([grid], spec, N)])
    graph, state = nnx.split(tower)
    jaxpr = jax.make_jaxpr(lambda s, p, l: nnx.merge(graph, s)(p, l))(state, jnp.zeros((1, N, spec.patch_dim)), layout)
    flops = 0
    for eqn in dot_equations(jaxpr.jaxpr):
        (contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        flops += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
    assert flops / N == pytest.approx(flops_per_patch(spec, N), rel=1e-12)


def test_patch_layout_refuses_what_does_not_fit():
    spec = QwenVisionSpec(**VISION, in_channels=3)
    with pytest.raises(ValueError, match=r"^2 images hold 96 patches, more than max_patches=64: [^\n]*$"):
        patch_layout([(1, 6, 8), (1, 6, 8)], spec, 64)
    with pytest.raises(ValueError, match="multiple of spatial_merge_size"):
        patch_layout([(1, 6, 8)], spec, 50)
    with pytest.raises(ValueError, match=r"^image grid 6×8 patches is more than the pixel budget's 36 patches"):
        patch_layout([(1, 6, 8)], dataclasses.replace(spec, max_frame_patches=36), 64)  # banded in 36s: cut


def test_bfloat16_compute_stays_near_float32_and_padding_keeps_gradients_finite():
    """Padding rows attend only padding: no row of scores is all masked, so no NaN reaches a gradient."""
    spec = QwenVisionSpec(**VISION, in_channels=3, deepstack_visual_indexes=(0,))
    layout = {k: jnp.asarray(v) for k, v in stack_layouts([patch_layout([(1, 6, 8)], spec, 64)]).items()}
    pixels_BNC = jax.random.normal(jax.random.key(0), (1, 64, spec.patch_dim))
    with jax.set_mesh(mesh()), nnx.logical_axis_rules(RULES):
        towers = [QwenVisionTower(spec, rngs=nnx.Rngs(0), dtype=dt) for dt in (jnp.float32, jnp.bfloat16)]
        (tokens32, _), (tokens16, deep16) = (nnx.jit(lambda t: t(pixels_BNC, layout))(t) for t in towers)
        graph, state = nnx.split(towers[1])
        loss = lambda s: nnx.merge(graph, s)(pixels_BNC, layout)[0].astype(jnp.float32).sum()  # noqa: E731
        grads = jax.jit(jax.grad(loss))(state)
    assert tokens16.dtype == deep16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(tokens16, np.float32), tokens32, atol=0.02 * float(jnp.abs(tokens32).max()))
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))


def test_banded_attention_trains_like_dense():
    """Gradients through the banded tower (chunks recomputed in the backward pass, a padded tail)
    equal the dense tower's, and are finite."""
    dense = QwenVisionSpec(**VISION, in_channels=3, deepstack_visual_indexes=(0,))
    layout = {k: jnp.asarray(v) for k, v in stack_layouts([patch_layout([(1, 4, 6), (1, 6, 8)], dense, 80)]).items()}
    pixels_BNC = jax.random.normal(jax.random.key(0), (1, 80, dense.patch_dim))
    grads = []
    for spec in (dense, dataclasses.replace(dense, max_frame_patches=48)):  # 2 chunks of 48, a tail of 16
        with jax.set_mesh(mesh()), nnx.logical_axis_rules(RULES):
            graph, state = nnx.split(QwenVisionTower(spec, rngs=nnx.Rngs(0)))
            loss = lambda s: sum(x.sum() for x in nnx.merge(graph, s)(pixels_BNC, layout))  # noqa: E731
            grads.append(jax.device_get(jax.jit(jax.grad(loss))(state)))
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        assert np.isfinite(b).all()
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


def test_a_steps_flops_count_the_tower_as_vision_train_trains_it():
    """The formula's tower share (train_flops_per_step − the same step without the tower's images),
    frozen against all, moves as the compiled step's FLOPs do: a frozen tower runs its forward only
    (XLA drops the backward nothing needs), a trained one its backward too (2 more matmuls each)."""
    from maxlite.data.synthetic import make_synthetic_iterator
    from maxlite.models.flops import train_flops_per_step
    from tests.helpers import build, shrunk

    def tower_share(vision_train: str) -> tuple[float, float]:
        argv = [*shrunk("qwen3-vl-2b"), "max_image_patches=16", "image_max_pixels=1048576",
                f"vision_train={vision_train}"]
        cfg, mesh_, state, step, _ = build(argv, 1)
        batch = next(make_synthetic_iterator(cfg, "train", 0, 1))  # one 4 × 4-patch image per row
        text = {k: v for k, v in batch.items() if not k.startswith("image_")}
        with jax.set_mesh(mesh_), nnx.logical_axis_rules(RULES):
            compiled = [step.lower(state, b).compile().cost_analysis()["flops"] for b in (batch, text)]
        without = train_flops_per_step(C.load([*argv, "vision_encoder="]))
        return compiled[0] - compiled[1], train_flops_per_step(cfg) - without

    (frozen_xla, frozen), (all_xla, trained) = tower_share("frozen"), tower_share("all")
    assert frozen > 0 and trained / frozen == pytest.approx(all_xla / frozen_xla, rel=0.15)
