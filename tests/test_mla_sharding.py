"""Every weight matrix of multi-head latent attention is split over fsdp: a matrix left whole is on
every device (DeepSeek-V3's query and key/value up-projections, 3.3 B parameters, were: 53 GB per
device with their gradients and Adam moments, which the planner's v5p plan showed)."""

import jax
import pytest
from flax import nnx

from maxlite import config as C, mesh as mesh_lib
from maxlite.models import mla

RULES = dict(mesh_lib.RULES)


def _mesh_axes(logical) -> set[str]:
    out = set()
    for name in logical:
        axes = RULES[name] if name is not None else None
        out.update((axes,) if isinstance(axes, str) else axes or ())
    return out


@pytest.mark.parametrize("q_lora_rank", [24, 0])  # DeepSeek-V3 / Kimi K2; DeepSeek-V2-Lite (no query latent)
def test_every_mla_matrix_is_split_over_fsdp(q_lora_rank):
    cfg = C.load(["base.yml", "base_emb_dim=32", "base_num_query_heads=2", "base_num_kv_heads=2",
                  "attention_type=mla", f"q_lora_rank={q_lora_rank}", "kv_lora_rank=16", "qk_nope_head_dim=12",
                  "qk_rope_head_dim=8", "v_head_dim=8"])
    with nnx.use_eager_sharding(False):
        module = nnx.eval_shape(lambda: mla.MLA(cfg, rngs=nnx.Rngs(params=0)))
    matrices = {"/".join(map(str, path)): p for path, p in nnx.iter_graph(module)
                if isinstance(p, nnx.Param) and p.ndim >= 2}
    assert {"kv_a", "kv_b", "o"} <= set(matrices) and ({"q_a", "q_b"} if q_lora_rank else {"q"}) <= set(matrices)
    whole = {name: p.out_sharding for name, p in matrices.items() if "fsdp" not in _mesh_axes(p.out_sharding)}
    assert not whole, f"MLA weights not split over fsdp (whole on every device): {whole}"
