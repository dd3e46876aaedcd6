"""maxlite.plan: the real train step compiled for TPU topologies on this CPU machine (needs libtpu)."""

import importlib.util
import math
import subprocess
import sys

import numpy as np
import pytest

from maxlite import config as C
from maxlite.models.layout import layer_stacks
from maxlite.plan import hlo, topology as T

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed: pip install 'maxlite[tpu]'")
GIB = 2**30


def _axes(**sizes) -> dict:
    """A plan's mesh dict: every axis of maxlite.config.MESH_AXES, 1 unless given."""
    return {a: sizes.get(a, 1) for a in C.MESH_AXES}


# ---- no compiler needed ----

def test_topology_names_and_hints():
    t = T.parse("v6e:4x4")
    assert (t.chip.name, t.num_chips, t.chips_per_slice) == ("v6e", 16, 16)
    assert T.parse("v5p:4x4x4", 2).num_chips == 128
    with pytest.raises(T.TopologyError, match=r"e\.g\. v6e:4x4"):
        T.parse("v6e-16")
    with pytest.raises(T.TopologyError, match=r"v5p:2x2x2"):
        T.parse("v5p-16")  # v5p-N counts TensorCores
    with pytest.raises(T.TopologyError, match="only TPU topologies are planned"):
        T.parse("h100:8")
    with pytest.raises(T.TopologyError, match="3 dimensions"):
        T.parse("v4:4x4")
    assert [x.name for x in T.bigger(T.parse("v6e:4x4"))][:3] == ["v6e:4x8", "v6e:8x8", "v6e:8x16"]


HLO = """HloModule m

%cond (p: (s32[], bf16[8,16])) -> pred[] {
  %p = (s32[], bf16[8,16]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[]{:T(128)} constant(6)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], bf16[8,16])) -> (s32[], bf16[8,16]) {
  %p = (s32[], bf16[8,16]) parameter(0)
  %x = bf16[2,16]{1,0} get-tuple-element(%p), index=1
  %stk = bf16[6,16]{1,0} get-tuple-element(%p), index=2
  %ds = bf16[1,16]{1,0} dynamic-slice(%stk, %x), dynamic_slice_sizes={1,16}
  %all-gather.1 = bf16[8,16]{1,0} all-gather(%x), channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dimensions={0}
  %cp = (bf16[8,16]{1,0}, bf16[8,16]{1,0}, u32[]) collective-permute-start(%all-gather.1), source_target_pairs={{0,1},{1,0}}
  %cpd = bf16[8,16]{1,0} collective-permute-done(%cp)
  ROOT %t = (s32[], bf16[8,16]) tuple(%i, %cpd)
}

ENTRY %main (a: bf16[8,16]) -> f32[4] {
  %w = (s32[], bf16[8,16]) while(%init), condition=%cond, body=%body
  %all-reduce.2 = f32[4]{0} all-reduce(%y), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
}
"""


def test_collectives_count_loop_iterations_and_bytes():
    c = hlo.collectives(HLO)
    gather = c["all-gather"]
    assert (gather.static, gather.count, gather.bytes) == (1, 6, 6 * 8 * 16 * 2)
    assert gather.moved == pytest.approx(6 * 8 * 16 * 2 * 3 / 4)  # group of 4 along axis_0
    assert (c["collective-permute"].count, c["collective-permute"].bytes) == (6, 6 * 256)
    reduce = c["all-reduce"]
    assert (reduce.count, reduce.bytes, reduce.moved) == (1, 16, 2 * 16 * 3 / 4)
    assert c["reduce-scatter"].count == 0
    # HBM traffic: operands + results of top-level ops, × 6 in the loop; the stacked [6, 16] buffer
    # is read one layer slice (32 B) per iteration
    gather, permute, dslice = 64 + 256, 256 + (256 + 256 + 4), (32 + 32 + 64)
    assert hlo.hbm_bytes(HLO) == 6 * (gather + permute + dslice) + 16


# An all-reduce as libtpu writes one it offloads to Ironwood's SparseCores (trimmed from a tpu7x:4x4x4
# compile: an all-gather of a weight as an all-reduce of its zero-padded copy), its strategy naming the
# X, Y and Z rings in both directions; and one that names no strategy (v5p, v6e).
RINGS = ("{\"phase_rings\":[{\"ring_type\":\"ICI_RING_TYPE_UNIDIR_CW\",\"ring_dim\":\"ICI_RING_DIM_X_MESH\"},"
         "{\"ring_type\":\"ICI_RING_TYPE_UNIDIR_CW\",\"ring_dim\":\"ICI_RING_DIM_Y_MESH\"},"
         "{\"ring_type\":\"ICI_RING_TYPE_UNIDIR_CW\",\"ring_dim\":\"ICI_RING_DIM_Z_MESH\"}]},"
         "{\"phase_rings\":[{\"ring_type\":\"ICI_RING_TYPE_UNIDIR_CCW\",\"ring_dim\":\"ICI_RING_DIM_Y_MESH\"}]}")
OFFLOADED_HLO = f"""HloModule o

ENTRY %main (a: bf16[1024,4096], b: bf16[1024,4096]) -> bf16[1024,4096] {{
  %a = bf16[1024,4096]{{1,0}} parameter(0)
  %b = bf16[1024,4096]{{1,0}} parameter(1)
  %all-reduce.1 = bf16[1024,4096]{{1,0:T(8,128)(2,1)}} all-reduce(%a), channel_id=1, replica_groups=mesh['axis_0'=128,'axis_1'=1] {{'axis_0'}}, use_global_device_ids=true, to_apply=%add, backend_config={{"device_type":"DEVICE_TYPE_SPARSECORE","collective_offload_config":{{"all_reduce_offload_config":{{"ici_strategy_config":{{"color_strategies":[{RINGS}]}}}}}}}}
  ROOT %all-reduce.2 = bf16[1024,4096]{{1,0}} all-reduce(%b), channel_id=2, replica_groups=mesh['axis_0'=128,'axis_1'=1] {{'axis_0'}}, use_global_device_ids=true, to_apply=%add
}}
"""


def test_an_op_on_the_x_y_and_z_rings_at_once_counts_a_third_of_its_bytes_on_one():
    """Ironwood's offloaded all-reduce runs its bytes over the three dimensions' rings at once, so one
    ring carries a third; the estimate's ICI time is that, not the whole on one ring, and it runs on the
    SparseCores beside the TensorCores' work."""
    from types import SimpleNamespace

    from maxlite.plan.estimate import estimate

    reduce = hlo.collectives(OFFLOADED_HLO)["all-reduce"]
    one = 2 * 1024 * 4096 * 2 * 127 / 128
    assert reduce.moved == pytest.approx(2 * one)
    assert reduce.ring_moved == pytest.approx(one / 3 + one)
    cfg = C.load(["base.yml", "model_name=tiny"])
    chip = T.parse("tpu7x:4x4x4").chip
    plan = SimpleNamespace(num_devices=128, flops_formula=0.0, hbm_bytes=0.0, dcn={}, param_bytes=0.0,
                           collectives={"all-reduce": reduce.to_dict()})
    e = estimate(plan, cfg, chip, 1)
    ring = chip.ring_gbps * 1e9
    assert e["ici_seconds"] == pytest.approx((one / 3 + one) / ring)
    assert e["collective_bytes_per_device"] == pytest.approx(2 * one)
    # the offloaded op runs on the SparseCores beside the TensorCores' work: the step is the larger of
    # the two, then the TensorCore collective after it
    assert e["ici_offloaded_seconds"] == pytest.approx(one / 3 / ring)
    assert e["bound"] == "ICI"
    for hbm in (0.0, 1e15):  # nothing to hide it behind; HBM traffic that hides it
        busy = estimate(SimpleNamespace(**{**vars(plan), "hbm_bytes": hbm}), cfg, chip, 1)
        assert busy["step_seconds"] == pytest.approx(max(busy["memory_seconds"], one / 3 / ring) + one / ring)


# The dropless expert exchange as the TPU compiler writes it (moe_parallel.Exchange, trimmed from a
# v6e compile): operands named without shapes; out: my 64 rows into a buffer of 4 senders × 64;
# back (in a loop of 3): the 256-row buffer into my 64 rows.
RAGGED_HLO = """HloModule r

%cond (p: (s32[], bf16[256,128])) -> pred[] {
  %p = (s32[], bf16[256,128]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], bf16[256,128])) -> (s32[], bf16[256,128]) {
  %p = (s32[], bf16[256,128]) parameter(0)
  %y = bf16[256,128]{1,0:T(8,128)(2,1)} get-tuple-element(%p), index=1
  %home = bf16[64,128]{1,0:T(8,128)(2,1)} broadcast(%zero), dimensions={}
  %r.2 = bf16[64,128]{1,0:T(8,128)(2,1)} ragged-all-to-all(%y, %home, %a, %b, %c, /*index=5*/%d), channel_id=2, replica_groups={{0,1,2,3}}
  ROOT %t = (s32[], bf16[256,128]) tuple(%i, %y)
}

ENTRY %main (param.2: bf16[64,128], param.3: s32[4]) -> bf16[256,128] {
  %param.2 = bf16[64,128]{1,0} parameter(0)
  %param.3 = s32[4]{0} parameter(1)
  %buffer.22 = bf16[256,128]{1,0:T(8,128)(2,1)} broadcast(%zero), dimensions={}
  %ragged_all_to_all.23 = bf16[256,128]{1,0:T(8,128)(2,1)} ragged-all-to-all(%param.2, %buffer.22, %off, %param.3, %off, /*index=5*/%param.3), channel_id=1, replica_groups={{0,1,2,3}}, backend_config={"collective_algorithm_config":{"emitter":"RaggedAllToAllEmitter"}}
  %w = (s32[], bf16[256,128]) while(%init), condition=%cond, body=%body
}
"""


def test_ragged_all_to_all_counts_the_rows_a_balanced_routing_moves():
    """Not the worst-case buffer: a device's own 64 rows go out, 3/4 of them to other devices, and
    64 rows come back (3 times in the loop); an all-to-all is not a ragged one."""
    c = hlo.collectives(RAGGED_HLO)
    ragged, rows = c["ragged-all-to-all"], 64 * 128 * 2
    assert (ragged.static, ragged.count, ragged.bytes) == (2, 4, 4 * rows)
    assert ragged.moved == pytest.approx(4 * rows * 3 / 4)
    assert c["all-to-all"].count == 0
    # HBM: each exchange reads the 64 rows it sends and writes the 64 it receives, not the 256-row
    # buffer; the zero buffers are written once per run (entry: 256 rows; the loop: 64 rows, 3 times)
    assert hlo.hbm_bytes(RAGGED_HLO) == 4 * 2 * rows + 4 * rows + 3 * rows


KERNEL_HLO = """HloModule k

%cond (p: (s32[], bf16[4,1024,128])) -> pred[] {
  %p = (s32[], bf16[4,1024,128]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], bf16[4,1024,128])) -> (s32[], bf16[4,1024,128]) {
  %p = (s32[], bf16[4,1024,128]) parameter(0)
  %q = bf16[4,1024,128]{2,1,0} get-tuple-element(%p), index=1
  %k = bf16[2,1024,128]{2,1,0} get-tuple-element(%p), index=2
  %v = bf16[2,1024,128]{2,1,0} get-tuple-element(%p), index=3
  %o = bf16[4,1024,128]{2,1,0} custom-call(%q, %k, %v), custom_call_target="tpu_custom_call", backend_config={"kernel_name":"splash_mha_fwd"}
  ROOT %t = (s32[], bf16[4,1024,128]) tuple(%i, %o)
}

ENTRY %main (a: bf16[4,1024,128]) -> bf16[4,1024,128] {
  %w = (s32[], bf16[4,1024,128]) while(%init), condition=%cond, body=%body
}
"""


def test_kernels_count_their_operands_and_results_not_scores():
    assert hlo.custom_calls(KERNEL_HLO) == {"tpu_custom_call": 3}  # once per loop iteration
    q = o = 4 * 1024 * 128 * 2
    kv = 2 * 1024 * 128 * 2
    assert hlo.hbm_bytes(KERNEL_HLO) == 3 * (q + 2 * kv + o)  # no 1024×1024 scores anywhere


def test_hardware_flops_count_remat_recompute_and_kernel_backward():
    from maxlite import config as C
    from maxlite.models.flops import train_flops_per_step
    from maxlite.plan.estimate import _per_layer_forward, hardware_flops

    def hw(*keys):
        cfg = C.resolve(C.load(["base.yml", "model_name=tiny", "max_target_length=1024", *keys]), 8, platform="tpu")
        return hardware_flops(cfg, train_flops_per_step(cfg)), _per_layer_forward(cfg)

    base = train_flops_per_step(C.resolve(C.load(["base.yml", "model_name=tiny",
                                                  "max_target_length=1024"]), 8))
    none, fwd = hw("remat_policy=none", "attention=dot_product")
    assert none == base
    full, _ = hw("remat_policy=full", "attention=dot_product")
    assert full == pytest.approx(base + sum(fwd.values()))
    assert hw("remat_policy=offload_layer_inputs", "attention=dot_product")[0] == full
    qkv, _ = hw("remat_policy=save_qkv_proj", "attention=dot_product")
    assert qkv == pytest.approx(full - fwd["qkv"])
    flash, _ = hw("remat_policy=none", "attention=flash")  # S and dP recomputed in dQ and dK/dV
    assert flash == pytest.approx(base + 1.5 * fwd["attention"])
    auto, _ = hw("remat_policy=none")  # autoselected is flash on TPU
    assert auto == flash


def test_quantized_flops_are_the_projections_forward_backward_and_recomputed():
    from maxlite import config as C
    from maxlite.models.flops import forward_flops_by_part
    from maxlite.plan.estimate import quantized_flops

    def q(*keys):
        cfg = C.resolve(C.load(["base.yml", "model_name=tiny", *keys]), 8)
        parts = forward_flops_by_part(cfg)
        return quantized_flops(cfg), parts["qkv"] + parts["out"] + parts["mlp"]

    assert q("remat_policy=full")[0] == 0.0  # no quantization
    none, projections = q("quantization=int8", "remat_policy=none")
    assert none == 3 * projections  # forward and both backward matmuls
    assert q("quantization=fp8", "remat_policy=full")[0] == 4 * projections  # + the forward again
    assert q("quantization=int8", "remat_policy=save_dots")[0] == none


def test_chips_carry_published_8_bit_peaks():
    v6e, v5e = T.CHIPS["v6e"], T.CHIPS["v5e"]
    assert (v6e.peak("bf16"), v6e.peak("int8"), v6e.peak("fp8")) == (918.0, 1836.0, 918.0)  # no fp8 units
    assert v5e.peak("int8") == 393.0


def test_without_libtpu_one_line_install_hint():
    code = ("import sys; sys.modules['libtpu'] = None\n"
            "from maxlite.plan.__main__ import main\n"
            "sys.exit(main(['base.yml', 'model_name=tiny', '--topology', 'v6e:2x2']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == "maxlite: error: planning for TPU needs libtpu: pip install 'maxlite[tpu]'"


def test_bad_topology_is_one_line_exit_2():
    r = subprocess.run([sys.executable, "-m", "maxlite.plan", "base.yml", "model_name=tiny",
                        "--topology", "v6e-16"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "maxlite: error: topology 'v6e-16': name the chip and its slice shape, e.g. v6e:4x4"]


# ---- compiled for TPU (libtpu) ----

@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    from maxlite.plan.compile import compile_plan
    # one sequence per chip: the same program at half the batch (less compile); its HLO kept (--dump-hlo)
    dump = tmp_path_factory.mktemp("hlo")
    plan = compile_plan(["base.yml", "model_name=tiny", "ici_fsdp_parallelism=8",
                         "ici_tensor_parallelism=2", "per_device_batch_size=1"], T.parse("v6e:4x4"), dump_hlo=str(dump))
    plan.dumped = dump
    return plan


@needs_libtpu
def test_the_dumped_program_is_the_one_whose_collectives_the_estimate_read(tiny_plan):
    """`--dump-hlo DIR` keeps the compiled step as text: reading its collectives again gives the plan's."""
    texts = sorted(tiny_plan.dumped.glob("*train_step*after_optimizations.txt"))
    assert len(texts) == 1
    again = hlo.collectives(texts[0].read_text())
    assert {k: (c.count, c.bytes) for k, c in again.items()} == \
        {k: (c["count"], c["bytes"]) for k, c in tiny_plan.collectives.items()}


@needs_libtpu
def test_tiny_fits_v6e_4x4_with_expected_shardings(tiny_plan):
    p = tiny_plan
    assert p.fits and p.num_devices == 16
    assert p.mesh == _axes(fsdp=8, tensor=2)
    s = p.param_shardings
    embed = "('fsdp', 'context')"  # the model dim over fsdp × context (context 1 here)
    assert s["layers/attn/q"] == f"[4, 256, 4, 64] ('stage', {embed}, 'tensor', None)"  # layers on the pipeline axis (1)
    assert s["layers/mlp/down"] == f"[4, 768, 256] ('stage', 'tensor', {embed})"
    assert s["embedding"] == f"[4096, 256] ('tensor', {embed})"
    assert 0 < p.peak_bytes < T.CHIPS["v6e"].hbm_bytes
    assert p.collectives["all-gather"]["count"] > p.collectives["all-gather"]["static"]  # per layer
    assert p.estimate["is_estimate"] and p.estimate["step_seconds"] > 0
    # autoselected attention on TPU is the splash kernel: fwd, dQ and dK/dV per layer (4 layers)
    assert p.recipe["attention"] == "flash" and p.recipe["attention_requested"] == "autoselected"
    assert p.custom_calls.get("tpu_custom_call", 0) >= 3 * 4


@needs_libtpu
def test_a_rejected_plan_says_by_how_much_it_is_over(tiny_plan):
    import dataclasses

    from maxlite.plan import search

    assert search._why_not(tiny_plan) == ""  # it fits
    over = dataclasses.replace(tiny_plan, fits=False, peak_bytes=40 * GIB, usable_bytes=31.25 * GIB)
    assert search._why_not(over) == "needs 40.00 GiB of 31.25 (over by 8.75)"
    failed = dataclasses.replace(tiny_plan, fits=False, peak_bytes=None, error="RESOURCE_EXHAUSTED: no room")
    assert search._why_not(failed) == "RESOURCE_EXHAUSTED: no room"


@needs_libtpu
@pytest.mark.slow
def test_offloaded_layer_inputs_are_host_memory_not_the_hbm_peak():
    """64 layers whose inputs (bf16 [2, 4096, 256] each) go to host memory: libtpu's peak figure is then
    arguments + host temporaries, above what HBM holds; the plan counts them as host memory (the
    pipelined-out 405B plan read 40.41 GiB of 32 and compiled)."""
    from maxlite.plan.compile import compile_plan

    args = ["base.yml", "model_name=tiny", "max_target_length=4096", "per_device_batch_size=2",
            "base_num_decoder_layers=64", "remat_policy=offload_layer_inputs"]
    p = compile_plan(args, T.parse("v6e:2x2"))
    emb = C.load(args).base_emb_dim
    assert p.fits and p.host_bytes == 64 * 2 * 4096 * emb * 2
    # HBM's figure leaves them out: libtpu's own peak was the arguments (this state) + the host bytes
    assert p.peak_bytes < p.param_bytes + p.optimizer_bytes + p.host_bytes


@needs_libtpu
def test_a_vision_plan_compiles_the_tower_on_its_images():
    """A Qwen-ViT recipe's plan holds its image arrays (1024 patches a row) and compiles the tower over
    them: the compiled step's FLOPs over the same recipe without the tower grow by about what the
    formula counts for the tower (per device; XLA also counts its norms, activations and softmax)."""
    from maxlite.plan.compile import compile_plan
    from tests.helpers import shrunk

    args = [*shrunk("qwen3-vl-2b"), "max_target_length=512", "max_image_patches=1024", "image_max_pixels=1048576"]
    vision, text = (compile_plan(a, T.parse("v6e:2x2")) for a in (args, [*args, "vision_encoder="]))
    assert vision.fits and text.fits
    assert vision.batch_bytes - text.batch_bytes >= 1024 * 3 * 2 * 8 * 8 * 4  # at least the pixels of a row
    tower_formula = (vision.flops_formula - text.flops_formula) / vision.num_devices
    assert vision.flops_compiler - text.flops_compiler == pytest.approx(tower_formula, rel=0.35)


@needs_libtpu
def test_with_bfloat16_gradients_no_expert_tensor_is_whole_in_float32():
    """grad_dtype=bfloat16 on float32 weights: the experts are cast while sharded as stored, so the
    v6e program gathers them in bfloat16 and reduce-scatters their gradient in bfloat16 before widening
    each shard. Before, the cast's backward widened the whole gathered gradient ([E, D, F] in float32
    on every device: 14 GiB per tensor for DeepSeek-V3 on tpu7x, which kept its Ironwood recipe out)."""
    import re

    from maxlite.plan import compile as plan_compile

    texts = []
    collectives = plan_compile.hlo.collectives
    args = ["base.yml", "model_name=tiny-moe", "num_experts=8", "base_moe_mlp_dim=256", "base_emb_dim=256",
            "ici_fsdp_parallelism=4", "dtype=bfloat16", "grad_dtype=bfloat16", "max_target_length=128",
            "per_device_batch_size=1", "base_num_decoder_layers=2"]
    try:
        plan_compile.hlo.collectives = lambda text: (texts.append(text), collectives(text))[1]
        plan = plan_compile.compile_plan(args, T.parse("v6e:2x2"))
    finally:
        plan_compile.hlo.collectives = collectives
    E, D, F = 8, 256, 256
    whole = [(name, dims) for name, dims in re.findall(r"%(\S+) = f32\[([\d,]+)\]", texts[0])
             if [int(n) for n in dims.split(",") if n != "1"] in ([E, D, F], [E, F, D])]
    assert plan.fits and not whole, whole


@needs_libtpu
def test_a_stack_of_one_unit_holds_no_more_under_remat_than_unrolled_layers():
    """A layer pattern with no shorter period (Nemotron-H: Mamba-2, attention and MLP layers in an
    irregular order) is one scanned unit, whose one-step scan XLA inlines: the forward pass and the
    backward's recomputation then share one program, and each layer's remat must keep them apart
    (prevent_cse) or common-subexpression elimination keeps every activation alive. The v6e program's
    temporaries equal those of the same layers unrolled. Before: 17.50 against 16.04 MiB here (no remat
    at all: 17.92); Nemotron-H-8B on v6e:2x4 at 8,192 tokens needed 62.41 GiB and now fits in 28.67."""
    from maxlite.plan import compile as plan_compile
    from tests.helpers import shrunk

    args = shrunk("nemotron-h-8b") + ["max_target_length=2048", "per_device_batch_size=1", "ici_fsdp_parallelism=4",
                                      "vocab_size=256", "remat_policy=full"]
    assert [(u.count, len(u.unit)) for u in layer_stacks(C.load(args))] == [(1, 3)]
    scanned = plan_compile.compile_plan(args, T.parse("v6e:2x2"))
    unrolled = plan_compile.compile_plan(args + ["scan_layers=false"], T.parse("v6e:2x2"))
    assert scanned.fits and unrolled.fits
    assert scanned.temp_bytes <= unrolled.temp_bytes * 1.01, (scanned.temp_bytes, unrolled.temp_bytes)


def test_the_memory_usage_report_is_read_largest_first():
    """XLA's memory-usage report (a libtpu dump's format, abridged): the default memory space's rows,
    by size, with the values sharing each; other memory spaces and the summary line are not rows."""
    from maxlite.plan import buffers

    report = """Memory Space: default (color=0)
Total bytes: 184135616448 (171.49GiB)
  cumulative_size;       size;       offset; used_by_n_values; shapes_list
  ------------------------------------------------------------
   16.00GiB(  9%);   16.00GiB;      6832128;                8; bf16[4,8,8192,512], 5×bf16[16,8,8192,8192]
  104.00GiB( 59%);    8.00GiB; 103086047232;                5; 5×f32[16,8,8192,2048]
  104.50GiB( 60%);  512.00MiB; 103086047232;                1; bf16[8192,32768]
  The rest 622 values are less than 5% of the total size and not shown.

  cumulative_size;       size;       offset; used_by_n_values; shapes_list
  ------------------------------------------------------------
  256.00MiB(100%);  256.00MiB;            0;                2; 2×f32[131072,512]
"""
    rows = buffers.parse(report)
    assert rows == [{"bytes": 16 * 2**30, "values": 8, "shapes": "bf16[4,8,8192,512], 5×bf16[16,8,8192,8192]"},
                    {"bytes": 8 * 2**30, "values": 5, "shapes": "5×f32[16,8,8192,2048]"},
                    {"bytes": 512 * 2**20, "values": 1, "shapes": "bf16[8192,32768]"}]


@needs_libtpu
def test_a_plan_that_does_not_fit_names_its_largest_buffers(capsys):
    """libtpu's out-of-memory error is one total; the planner reads the compiler's buffer assignment of
    the same compilation and lists the largest allocations. Without remat, dot-product attention's
    scores, [batch, heads, T, T] per layer, are what overflows: they lead the list."""
    from maxlite.plan import compile as plan_compile, report

    args = ["base.yml", "model_name=tiny", "attention=dot_product", "remat_policy=none", "max_target_length=4096",
            "per_device_batch_size=8", "ici_fsdp_parallelism=4", "base_num_query_heads=8", "base_num_kv_heads=8"]
    plan = plan_compile.compile_plan(args, T.parse("v5e:2x2"))
    assert not plan.fits and plan.largest_buffers
    sizes = [b["bytes"] for b in plan.largest_buffers]
    assert sizes == sorted(sizes, reverse=True) and sum(sizes) <= plan.peak_bytes
    assert ",4096,4096]" in plan.largest_buffers[0]["shapes"], plan.largest_buffers[0]
    text = report.text(plan, T.parse("v5e:2x2").chip)
    assert "largest buffers" in text and plan.largest_buffers[0]["shapes"] in text


@needs_libtpu
def test_a_pipeline_offloads_each_iterations_stage_input():
    """remat_policy=offload_layer_inputs in a pipeline (8 layers in 2 stages across 2 slices, 2 repeats:
    2 layers per stage and repeat; 2 micro-batches): each of the schedule's R·M + P − 1 = 5 iterations
    sends its stage's input, bf16 [rows, T, D], to host memory, not each layer's, and the stage's layers
    are recomputed from it; per chip 2 rows (16 sequences over a slice's 4 chips, in 2 micro-batches).
    Offloading every layer's input inside the pipeline's loops instead would hold two per iteration here,
    and is what libtpu refuses for the next test's layout."""
    from maxlite.plan.compile import compile_plan

    args = ["base.yml", "model_name=tiny", "max_target_length=512", "per_device_batch_size=2",
            "base_num_decoder_layers=8", "dcn_pipeline_parallelism=2", "dcn_data_parallelism=1",
            "num_pipeline_repeats=2", "remat_policy=offload_layer_inputs", "attention=dot_product"]
    p = compile_plan(args, T.parse("v6e:2x2", 2))
    assert not p.error and p.fits
    assert p.host_bytes == 5 * 2 * 512 * C.load(args).base_emb_dim * 2


@needs_libtpu
def test_a_layout_the_compiler_fails_on_is_reported_in_one_line(capsys):
    """libtpu (the pinned 0.0.42.1) fails with INTERNAL on every layer's input offloaded inside this
    pipeline's loops (a bitcast between memory spaces; the pipelined 405B plan met it): the planner says
    so in its verdict and exits 1, and a sweep's row carries the line, rather than a traceback ending
    the search. If a libtpu upgrade compiles this layout, pick another the compiler refuses."""
    from maxlite.plan.__main__ import main

    args = ["base.yml", "model_name=llama3.1-8b", "per_device_batch_size=1", "max_target_length=4096",
            "dcn_pipeline_parallelism=2", "dcn_data_parallelism=1", "num_pipeline_repeats=2",
            "remat_policy=offload_layer_inputs", "set_remat_policy_on_pipeline_iterations=false",
            "--topology", "v6e:2x2", "--num-slices", "2", "--no-suggest"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "llama3.1-8b on v6e:2x2 × 2 slices (8 chips): NOT COMPILED" in out
    assert "compiler           the compiler failed: INTERNAL: " in out and "Traceback" not in out


def test_parameter_bytes_equal_eval_shape_count_times_dtype(tiny_plan):
    from maxlite import config as C
    from maxlite.state import abstract_params

    cfg = C.load(["base.yml", "model_name=tiny"])
    _, params = abstract_params(cfg)
    leaves = [x for x in __import__("jax").tree.leaves(params)]
    count = sum(math.prod(x.shape) for x in leaves)
    assert tiny_plan.param_count == count
    assert tiny_plan.param_bytes_total == count * np.dtype(cfg.weight_dtype).itemsize == count * 4
    # each device holds a 1/16 shard of every matrix (norm scales are replicated: a little more)
    assert count * 4 / 16 <= tiny_plan.param_bytes < count * 4 / 16 * 1.05
    assert tiny_plan.optimizer_bytes >= 2 * tiny_plan.param_bytes  # AdamW mu + nu


@needs_libtpu
def test_two_slices_put_data_across_dcn():
    from maxlite.plan.compile import compile_plan

    # one sequence per chip: the same program at half the batch (a third less compile)
    p = compile_plan(["base.yml", "model_name=tiny", "weight_dtype=bfloat16", "per_device_batch_size=1"],
                     T.parse("v6e:2x2", 2))
    assert p.fits and p.num_devices == 8
    assert p.dcn == _axes(data=2) and p.ici == _axes(fsdp=4)
    assert p.mesh == _axes(data=2, fsdp=4)
    assert p.data_axis_slices == [[0], [1]]  # each data row lies in one slice: data crosses slices
    assert p.param_bytes_total == p.param_count * 2  # bfloat16 weights
    assert p.estimate["dcn_seconds"] > 0


@needs_libtpu
def test_405b_on_v6e_2x2_does_not_fit_with_numbers(capsys):
    from maxlite.plan.__main__ import main

    assert main(["base.yml", "model_name=llama3.1-405b", "--topology", "v6e:2x2", "--no-suggest"]) == 1
    out = capsys.readouterr().out
    assert "llama3.1-405b on v6e:2x2 (4 chips): DOES NOT FIT" in out
    assert "usable 31.25 GiB: over by" in out
    assert "params + gradients + optimizer alone: 1,511.92 GiB per device" in out


@needs_libtpu
def test_json_output(capsys):
    import json

    from maxlite.plan.__main__ import main

    # one sequence per chip: the same program at half the batch (a quarter less compile)
    assert main(["base.yml", "model_name=tiny", "per_device_batch_size=1", "--topology", "v5e:2x2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["fits"] and out["plan"]["mesh"] == _axes(fsdp=4)
    assert out["plan"]["estimate"]["is_estimate"] is True


@needs_libtpu
@pytest.mark.slow
def test_llama3_8b_fits_v6e_4x4_tutorial_mesh():
    from maxlite.plan.compile import compile_plan

    p = compile_plan(["base.yml", "model_name=llama3-8b", "per_device_batch_size=1",
                      "max_target_length=4096", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=4"],
                     T.parse("v6e:4x4"))
    assert p.fits and p.mesh == _axes(fsdp=4, tensor=4)
    # the layer stack's dim over `stage` and embed over fsdp + context (both size 1 here): the rules
    # name every axis a dim may use
    assert p.param_shardings["layers/attn/k"] == "[32, 4096, 8, 128] ('stage', ('fsdp', 'context'), 'tensor', None)"
    assert p.param_shardings["unembedding"] == "[4096, 128256] (('fsdp', 'context'), 'tensor')"
    assert 8.0e9 < p.param_count < 8.1e9
    assert p.peak_bytes < 31.25 * GIB


@needs_libtpu
@pytest.mark.slow
def test_sweep_ranks_fitting_meshes():
    from maxlite.plan import report, search

    rows = search.sweep(["base.yml", "model_name=tiny"], T.parse("v6e:2x2"), ("full", "save_dots"),
                        ("", "int8"), progress=lambda _: None, stages_in_slice=(2,))
    print("\n".join(report.sweep_lines(rows)))
    compiled = [r for r in rows if not r["skipped"]]
    unstaged = [r for r in compiled if r["pipeline"] is None and not any("num_vocab_tiling" in o for o in r["overrides"])]
    meshes = {(r["mesh"]["data"], r["mesh"]["fsdp"], r["mesh"]["tensor"]) for r in unstaged}
    assert meshes == {(1, 4, 1), (1, 2, 2), (2, 2, 1)}
    assert len([r for r in unstaged if r["fits"]]) == 7
    steps = [r["step_seconds"] for r in rows if r["fits"]]
    assert steps == sorted(steps)
    # the layouts not compiled, each with its reason: 8 devices of mesh on a 4-device slice; tensor 4
    refused = {(o[0], o[2]): r["why"] for r in rows if r["skipped"] and r["overrides"][0].startswith("ici_data")
               for o in [r["overrides"]]}
    assert set(refused) == {("ici_data_parallelism=1", "ici_tensor_parallelism=8"),
                            ("ici_data_parallelism=2", "ici_tensor_parallelism=4"),
                            ("ici_data_parallelism=1", "ici_tensor_parallelism=4")}
    assert refused[("ici_data_parallelism=2", "ici_tensor_parallelism=4")] == \
        "not possible: data × context × tensor = 8 does not divide the slice's 4 devices"
    assert all(why.startswith("not possible: ") for why in refused.values())
    assert rows[-1]["skipped"] and all(not r["skipped"] for r in rows[:len(compiled)])  # refused ones last
    # finer vocabulary tiles (2× and 4× its loss chunks) tried on the fastest that fits
    tiled = [r for r in compiled if any("num_vocab_tiling" in o for o in r["overrides"])]
    first = min((r for r in unstaged if r["fits"] and not r["quantization"]), key=lambda r: r["step_seconds"])
    assert sorted(r["overrides"][-1] for r in tiled) == [f"num_vocab_tiling={2 * first['loss_chunks']}",
                                                           f"num_vocab_tiling={4 * first['loss_chunks']}"]
    assert all(r["overrides"][:-1] == first["overrides"] for r in tiled)
    # pipeline layouts (2 stages) with the remat policy of the fastest mesh
    staged = [r for r in rows if r["pipeline"] is not None]
    fastest = min((r for r in unstaged if r["fits"] and not r["quantization"]), key=lambda r: r["step_seconds"])
    assert {r["mesh"]["stage"] for r in staged} == {2}
    assert {r["remat_policy"] for r in staged} == {fastest["remat_policy"]}
    # int8 tried once, on the fastest bf16 mesh × remat
    plain = [r for r in rows if not r["quantization"]]
    (int8,) = [r for r in rows if r["quantization"] == "int8"]
    assert (int8["mesh"], int8["remat_policy"]) == (plain[0]["mesh"], plain[0]["remat_policy"])


@needs_libtpu
@pytest.mark.slow
def test_suggestions_are_compiled_and_the_smaller_micro_batch_fits():
    from maxlite.plan import search
    from maxlite.plan.compile import compile_plan

    # 96 sequences of 8192 per chip: about 20 GiB with the default flash attention and chunked loss
    # (8 had stopped being too big once those became the TPU defaults)
    args = ["base.yml", "model_name=tiny", "per_device_batch_size=96", "max_target_length=8192"]
    topology = T.parse("v5e:2x2")
    base = compile_plan(args, topology)
    assert not base.fits and base.usable_bytes == pytest.approx(15.75 * GIB)
    assert base.over_bytes > 0
    rows = search.suggest(args, topology, base, progress=lambda _: None)
    batch = next(r for r in rows if r["change"].startswith("per_device_batch_size=48"))
    assert batch["fits"] and batch["peak_bytes"] < base.usable_bytes
    assert "per_device_batch_size=48 gradient_accumulation_steps=2" in batch["command"]
    more_chips = [r for r in rows if r["change"].startswith("topology")]
    assert len(more_chips) == 1 and not more_chips[0]["fits"]  # the per-device batch is the problem
    (offload,) = [r for r in rows if r["change"].endswith("(remat_policy=offload_layer_inputs)")]
    assert not offload["skipped"] and "remat_policy=offload_layer_inputs" in offload["command"]
    assert not any("num_pipeline_repeats" in r["change"] for r in rows)  # no stages, no schedule to change



@needs_libtpu
def test_an_int8_plan_compiles_and_runs_its_projections_at_the_int8_peak():
    """The quantized step compiles for v6e; its compute term spends the projections' FLOPs (forward
    and backward) at v6e's int8 peak, twice bf16's, and the rest as before."""
    from maxlite.models.flops import forward_flops_by_part
    from maxlite.plan.compile import compile_plan, resolve

    # tiny at its own sequence length (256 tokens: 512 cost twice the compile for the same claim), one
    # sequence per chip; no remat, so each projection is its forward and two backward matmuls
    args = ["base.yml", "model_name=tiny", "remat_policy=none", "per_device_batch_size=1"]
    topo = T.parse("v6e:2x2")
    plain, int8 = compile_plan(args, topo), compile_plan([*args, "quantization=int8"], topo)
    assert plain.fits and int8.fits and int8.recipe["quantization"] == "int8"
    parts = forward_flops_by_part(resolve(args, topo))
    projections = 3 * (parts["qkv"] + parts["out"] + parts["mlp"]) / int8.num_devices
    v6e = topo.chip
    saved = projections / (v6e.peak_tflops * 1e12) - projections / (v6e.peak("int8") * 1e12)
    assert int8.estimate["compute_seconds"] == pytest.approx(plain.estimate["compute_seconds"] - saved)
    assert int8.estimate["quantized_flops_per_device"] == pytest.approx(projections)


@needs_libtpu
def test_offload_policy_moves_layer_inputs_to_host_and_flash_is_a_kernel():
    """Lowered (not compiled) for v6e: the offload policy names pinned host memory; autoselected
    attention is the splash kernel and no [T, T] scores appear."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from maxlite import mesh as mesh_lib, optim, state as state_lib, step as step_lib
    from maxlite.plan.compile import resolve

    topo = T.parse("v6e:2x2")
    cfg = resolve(["base.yml", "model_name=tiny", "max_target_length=512", "base_num_decoder_layers=2",
                   "remat_policy=offload_layer_inputs"], topo)
    mesh = mesh_lib.make_mesh(cfg, devices=T.devices(topo))
    tx, schedule = optim.make_optimizer(cfg), optim.learning_rate_schedule(cfg)
    graphdef, abstract, shardings = state_lib.abstract_state(cfg, mesh, tx)
    bs = mesh_lib.batch_sharding(mesh)
    shape = (cfg.global_batch_size, cfg.max_target_length)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "weights" else jnp.int32, sharding=bs)
             for k in ("inputs", "targets", "positions", "segment_ids", "weights")}
    state_in = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, shardings)
    step = step_lib.jit_train_step(cfg, graphdef, tx, schedule, shardings, bs)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        text = step.lower(state_in, batch).as_text()
    assert "pinned_host" in text
    assert "tpu_custom_call" in text
    assert "512x512" not in text


def test_sweep_splits_long_sequences_over_the_context_axis_too():
    from maxlite.plan import search

    def meshes(args):
        rows = search.sweep_candidates(args, T.parse("v6e:2x4"), ("full",))
        return {tuple(int(o.split("=")[1]) for o in r[:3]) for r in rows}  # (data, context, tensor)

    short = meshes(["base.yml", "model_name=tiny"])
    assert {c for _, c, _ in short} == {1}
    # 32k tokens, half a sequence per chip: only meshes whose context (or tensor) axis makes it whole
    long = meshes(["base.yml", "model_name=tiny", "max_target_length=32768", "per_device_batch_size=0.5"])
    assert {(1, 2, 1), (1, 4, 1), (1, 4, 2), (1, 1, 2)} <= long and (1, 1, 1) not in long
    assert all(c * t % 2 == 0 for _, c, t in long)


def test_pipeline_repeats_go_up_to_one_layer_per_stage_per_repeat():
    from maxlite.plan import search

    assert search.pipeline_repeats(4, 2) == [1, 2]
    assert search.pipeline_repeats(4, 4) == [1]
    assert search.pipeline_repeats(24, 2) == [1, 2, 3, 12]  # 12 per stage: 1, 2, 3, 4, 6, 12 thinned
    assert search.pipeline_repeats(126, 2) == [1, 3, 7, 63]  # Llama 3.1 405B over 2 stages: 63 per stage
    assert search.pipeline_repeats(6, 4) == [1]  # the layers do not split into the stages


def test_sweep_tries_pipeline_stages_repeats_and_micro_batches():
    """4 layers, 2 sequences per device, two v6e-8 slices: one stage per slice, or 2 or 4 stages in
    each; a layout stays where the layers split into stages × repeats and each batch shard's
    sequences (2 × stages) into the micro-batches."""
    from maxlite.plan import search

    args = ["base.yml", "model_name=tiny", "per_device_batch_size=2"]
    rows = search.pipeline_candidates(args, T.parse("v6e:2x4", 2), "minimal")
    keys = ("dcn_pipeline_parallelism", "ici_pipeline_parallelism", "num_pipeline_repeats", "num_pipeline_microbatches")
    found = {tuple(int(dict(o.split("=") for o in r).get(k, 1)) for k in keys) for r in rows}
    assert found == {(2, 1, 1, 2), (2, 1, 1, 4), (2, 1, 2, 2), (2, 1, 2, 4),  # across the slices
                     (1, 2, 1, 2), (1, 2, 1, 4), (1, 2, 2, 2), (1, 2, 2, 4),  # 2 in each slice
                     (1, 4, 1, 4), (1, 4, 1, 8)}  # 4 in each: 4 layers, no second repeat
    assert all("remat_policy=minimal" in r and "ici_fsdp_parallelism=-1" in r for r in rows)
    across = [r for r in rows if "dcn_pipeline_parallelism=2" in r]
    assert all("dcn_data_parallelism=1" in r for r in across)  # the slices hold stages, not replicas


def test_pipeline_across_slices_moves_activations_not_weights():
    """The estimate's DCN bytes, three ways over two v6e-256 slices (no compile): data parallel
    all-reduces the gradients, fsdp gathers the other slice's weights, the pipeline sends one
    micro-batch's hidden states per iteration; its bubble lengthens the step."""
    from types import SimpleNamespace

    from maxlite.plan.estimate import estimate

    topo = T.parse("v6e:16x16", 2)
    base = ["base.yml", "model_name=llama3.1-405b", "max_target_length=8192", "per_device_batch_size=1"]
    ways = {"data": [], "fsdp": ["dcn_fsdp_parallelism=2", "dcn_data_parallelism=1"],
            "pipeline": ["dcn_pipeline_parallelism=2", "dcn_data_parallelism=1"]}
    out = {}
    for name, extra in ways.items():
        cfg = C.resolve(C.load([*base, *extra]), 512, 2)
        shards = cfg.axis_size("fsdp") * cfg.axis_size("stage")  # what splits the weights
        plan = SimpleNamespace(num_devices=512, flops_formula=1e18, hbm_bytes=0.0, collectives={},
                               dcn=dict(zip(C.MESH_AXES, cfg.parallelism("dcn"))), param_bytes=4 * 405e9 / shards)
        out[name] = estimate(plan, cfg, topo.chip, 2)
    dcn = {name: e["dcn_bytes_per_device"] for name, e in out.items()}
    assert dcn["pipeline"] == out["pipeline"]["pipeline_p2p_bytes_per_device"] > 0
    assert dcn["pipeline"] < dcn["data"] < dcn["fsdp"]
    pipeline = out["pipeline"]
    assert pipeline["bubble_fraction"] == pytest.approx((2 - 1) / (2 + 2 - 1))  # P = M = 2, R = 1
    assert pipeline["step_seconds"] == pytest.approx(pipeline["compute_seconds"] / (1 - pipeline["bubble_fraction"])
                                                     + pipeline["dcn_seconds"])
    assert out["data"]["bubble_fraction"] == 0
