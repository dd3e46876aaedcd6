"""Gemma 3's SigLIP tower and projector against transformers' own (a tiny random model, float32),
the HF weight mapping both ways, and the planner's FLOPs against the traced program's matmuls."""

import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402

from maxlite.models.vision import siglip_hf  # noqa: E402
from maxlite.models.vision.siglip import SiglipSpec, SiglipTower, flops_per_image  # noqa: E402

# a 4×4 patch grid pooled 2×2 into 4 soft tokens; Gemma 3's checkpoints have no pooling head
VISION = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4, image_size=32,
              patch_size=8, vision_use_head=False)
TEXT = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            head_dim=24, vocab_size=300)


@pytest.fixture(scope="module")
def hf():
    """A random Gemma3ForConditionalGeneration whose vision and projector tensors are all seeded noise
    (HF initializes biases and the projector at zero, which would hide a lost bias or transpose)."""
    config = transformers.Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("model.language_model."):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen) + (1.0 if "norm" in name else 0.0))
    return model


def _state(model) -> dict:
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def _tower(model) -> SiglipTower:
    spec = SiglipSpec.from_hf(model.config)
    with nnx.use_eager_sharding(False):
        tower = SiglipTower(spec, rngs=nnx.Rngs(0))
    nnx.update(tower, siglip_hf.from_hf(_state(model), spec))
    return tower


def _pixels(*sizes) -> np.ndarray:
    """RGB noise images of odd sizes (w, h), resized and normalized by Gemma 3's image processor."""
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    side = VISION["image_size"]
    processor = transformers.Gemma3ImageProcessorPil(size={"height": side, "width": side})
    return processor(images=images, return_tensors="np")["pixel_values"]


def test_soft_tokens_match_transformers(hf):
    pixels = _pixels((45, 70))
    with torch.no_grad():
        want = hf.model.get_image_features(torch.from_numpy(pixels)).pooler_output.numpy()
    got = np.asarray(_tower(hf)(jnp.asarray(pixels)))
    assert got.shape == want.shape == (1, 4, TEXT["hidden_size"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_batch_equals_each_image_alone(hf):
    pixels = _pixels((45, 70), (70, 45))
    tower = _tower(hf)
    both = np.asarray(tower(jnp.asarray(pixels)))
    for i in range(2):
        np.testing.assert_allclose(both[i], np.asarray(tower(jnp.asarray(pixels[i:i + 1])))[0], rtol=1e-6, atol=1e-6)
    assert not np.allclose(both[0], both[1], atol=1e-2)  # two images, two answers


def test_hf_weights_round_trip_and_are_all_read(hf):
    spec = SiglipSpec.from_hf(hf.config)
    state = _state(hf)
    tower_names = {k for k in state if k.startswith(siglip_hf.IN_MEMORY)}
    assert set(siglip_hf.hf_names(spec)) == tower_names  # every tower tensor read, none invented
    ours = siglip_hf.from_hf(state, spec)
    with nnx.use_eager_sharding(False):
        shapes = jax.tree.map(np.shape, nnx.to_pure_dict(nnx.state(SiglipTower(spec, rngs=nnx.Rngs(0)))))
    assert jax.tree.map(np.shape, ours) == shapes
    back = siglip_hf.to_hf(ours, spec)
    assert back.keys() == tower_names
    for name in tower_names:
        np.testing.assert_array_equal(back[name], state[name], err_msg=name)


def test_checkpoint_file_layouts(hf, tmp_path):
    """transformers 5.25 saves the tower under SAVED_5's names, and loads Google's (HUB) layout
    into the same model."""
    from safetensors.numpy import load_file, save_file
    spec = SiglipSpec.from_hf(hf.config)
    ours = siglip_hf.from_hf(_state(hf), spec)
    hf.save_pretrained(tmp_path)
    (file,) = tmp_path.glob("*.safetensors")
    saved = load_file(file)
    assert set(siglip_hf.hf_names(spec, siglip_hf.SAVED_5)) == {k for k in saved if k.startswith(siglip_hf.SAVED_5)}
    jax.tree.map(np.testing.assert_array_equal, siglip_hf.from_hf(saved, spec, siglip_hf.SAVED_5), ours)

    hub = {k: v for k, v in saved.items() if not k.startswith(siglip_hf.SAVED_5)}
    save_file({**hub, **siglip_hf.to_hf(ours, spec, siglip_hf.HUB)}, file, metadata={"format": "pt"})
    loaded = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path).eval()
    jax.tree.map(np.testing.assert_array_equal, siglip_hf.from_hf(_state(loaded), spec), ours)


def test_spec_round_trips_through_the_hf_config(hf):
    spec = SiglipSpec.from_hf(hf.config)
    assert (spec.hidden_size, spec.depth, spec.num_heads, spec.mm_tokens_per_image, spec.text_hidden_size) == \
        (VISION["hidden_size"], VISION["num_hidden_layers"], VISION["num_attention_heads"], 4, TEXT["hidden_size"])
    assert SiglipSpec.from_hf(transformers.Gemma3Config(**spec.to_hf())) == spec
    with pytest.raises(ValueError, match="mm_tokens_per_image"):
        SiglipSpec.from_hf({**spec.to_hf(), "mm_tokens_per_image": 9})  # 3 does not divide the 4-patch grid


def _matmul_flops(jaxpr) -> int:
    """2·(output size)·(contracted size) summed over every dot_general of a jaxpr, a scan's body
    counted once per iteration."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
            continue
        times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if isinstance(inner, jax.extend.core.Jaxpr):
                total += times * _matmul_flops(inner)
    return total


def test_flops_per_image_counts_the_traced_matmuls(hf):
    tower = _tower(hf)
    pixels = jnp.zeros((1, 3, VISION["image_size"], VISION["image_size"]), jnp.float32)
    graph, state = nnx.split(tower)
    jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graph, s)(x))(state, pixels)
    assert _matmul_flops(jaxpr.jaxpr) == flops_per_image(tower.spec)


def test_sharded_params_give_the_same_tokens(hf):
    """The params split by their logical axes (mesh.RULES) over fsdp × tensor: the same soft tokens."""
    from jax.sharding import Mesh

    from maxlite.config import MESH_AXES
    from maxlite.state import param_shardings
    tower = _tower(hf)
    pixels = jnp.asarray(_pixels((45, 70), (70, 45)))
    graph, params = nnx.split(tower)
    shape = {"fsdp": 2, "tensor": 4}
    mesh = Mesh(np.asarray(jax.devices()).reshape([shape.get(a, 1) for a in MESH_AXES]), MESH_AXES)
    sharded = jax.device_put(params, param_shardings(params, mesh))
    assert sharded["layers"]["q"].sharding.spec == jax.sharding.PartitionSpec(None, ("fsdp", "context"), "tensor", None)
    got = jax.jit(lambda p, x: nnx.merge(graph, p)(x))(sharded, pixels)
    want = np.asarray(tower(pixels))
    # Split contractions sum in another order: an error of float32's rounding at the scale of the
    # largest token value (seen on CI's 2-core machine: 1.9e-6 on a value of 0.034, values up to 9.5).
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=2e-6 * np.abs(want).max())


def test_bfloat16_compute_stays_near_float32(hf):
    pixels = jnp.asarray(_pixels((45, 70)))
    want = np.asarray(_tower(hf)(pixels))
    spec = SiglipSpec.from_hf(hf.config)
    with nnx.use_eager_sharding(False):
        tower = SiglipTower(spec, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    nnx.update(tower, siglip_hf.from_hf(_state(hf), spec))
    got = tower(pixels)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=0.02 * np.abs(want).max())
