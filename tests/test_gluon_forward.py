"""The Gluon (sm_90) forward: compiled for Hopper on the CPU, run against the oracle on the GPU.

CPU (CI): every shipped configuration compiles for sm_90a with the wheel's
ptxas, without spills, inside Hopper's shared memory, and keeps its design
(warp specialization, the wgmma that stays in flight under the softmax,
CAUSAL / PINGPONG folded into the partitions at compile time);
`gluon_supports` names every reason it refuses. GPU (`-m gpu`): awkward shapes
against the float64 oracle with the shared error rule.
"""

from __future__ import annotations

import re
import subprocess

import pytest
import torch
import triton
from error_rule import assert_matches_oracle
from hard_inputs import own_key_scores_far_below_the_rest
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

import exattn
from exattn.backends.triton import GLUON_HEAD_DIMS
from exattn.backends.triton import gluon_forward as gf
from exattn.problem import AttentionParams
from exattn.reference import attention_ref

HOPPER_SHARED_BYTES = 232448
TYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def compile_gluon_for_sm90(kernel, args, constants: dict):
    """`kernel` compiled for sm_90a from the arguments a launch passes: positional `args` (tensors,
    stride tuples, scalars, host TMA descriptors) and `constants` (constexprs, num_warps, maxnreg)."""
    constants = dict(constants)
    options = {name: constants.pop(name) for name in ("num_warps", "maxnreg")}
    signature, constexprs = {}, dict(constants)
    for i, (name, arg) in enumerate(zip(kernel.arg_names, [*args, *constants.values()], strict=True)):
        if name in constants:
            signature[name] = "constexpr"
        elif isinstance(arg, torch.Tensor):
            signature[name] = "*" + {torch.float32: "fp32", torch.int32: "i32"}.get(arg.dtype, TYPE_NAMES.get(arg.dtype))
        elif isinstance(arg, tuple):  # strides, the last one 1
            signature[name] = ("i64",) * (len(arg) - 1) + ("constexpr",)
            constexprs[(i, len(arg) - 1)] = 1
        elif isinstance(arg, float):
            signature[name] = "fp32"
        elif isinstance(arg, int):
            signature[name] = "i32"
        else:
            signature[name] = mangle_type(arg)
    source = GluonASTSource(kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def compile_for_sm90(dim: int, causal: bool, dtype: torch.dtype):
    """The kernel as `gluon_forward` launches it (arguments from `forward_arguments`, host TMA
    descriptors over CPU tensors), compiled for sm_90a."""
    q, k, v = (torch.empty(2, heads, 300, dim, dtype=dtype) for heads in (4, 2, 2))
    args, _ = gf.forward_arguments(q, k, v, torch.empty_like(q), torch.empty(2, 4, 300), 0.5, causal, programs=4)
    return compile_gluon_for_sm90(gf.gluon_forward_kernel, args, gf.kernel_constants(dim, causal))


def resource_usage(kernel, tmp_path) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL of the cubin, read by the wheel's cuobjdump."""
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    report = subprocess.run(
        [triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(cubin)],
        capture_output=True, text=True, check=True,
    ).stdout
    return {key: int(value) for key, value in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", report)}


def assert_warp_specialized_tma_kernel(kernel, tmp_path, parked_bytes: int, overlap: str) -> str:
    """The checks every Gluon prefill kernel passes, returning its PTX: no spills beyond `parked_bytes` of
    stack, shared memory within Hopper's, warp specialization, the wgmma kept in flight across the
    exponentials (`overlap` names what overlaps), TMA loads of 4-D boxes and descriptors made on the host."""
    usage = resource_usage(kernel, tmp_path)
    assert usage["LOCAL"] == 0 and usage["STACK"] <= parked_bytes, f"register spills: {usage}"
    assert kernel.metadata.shared <= HOPPER_SHARED_BYTES, kernel.metadata.shared
    ptx = kernel.asm["ptx"]
    assert "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx, "no warp specialization"
    assert "wgmma.wait_group.sync.aligned 1;" in ptx, f"{overlap} no longer overlaps"
    assert "cp.async.bulk.tensor.4d" in ptx, "no TMA loads of 4-D boxes"
    assert "tensormap.replace" not in ptx, "descriptors are made on the host, not per program"
    return ptx


# Other schedules than the shipped ones: (head dim, GluonConfig fields to replace).
SCHEDULES = [(64, {"consumers": 2, "stages": 4}), (64, {"pingpong": True}), (128, {"pingpong": True}),
             (64, {"consumers": 2, "stages": 4, "persistent": True}), (128, {"persistent": True}),
             (64, {"one_key_loop": False}), (128, {"one_key_loop": True}), (64, {"block_n": 64}),
             (128, {"block_n": 64, "one_key_loop": True})]


# Stack bytes ptxas may park for a schedule, measured faster than its spill-free form: the short d = 128
# causal schedule's one key loop (8 bytes) against two loops, kernel time 1.07x / 1.04x / 1.01x at
# 512 / 1k / 2k (H200, bf16, batch * N = 16k).
PARKED_BYTES = {(128, True, "short"): 8}


@pytest.mark.parametrize("dim,causal,dtype,changes", [
    (64, False, torch.bfloat16, {}), (64, True, torch.bfloat16, {}), (64, True, torch.float16, {}),
    (128, False, torch.bfloat16, {}), (128, True, torch.bfloat16, {}), (128, True, torch.float16, {}),
] + [(dim, True, torch.bfloat16, changes) for dim, changes in SCHEDULES]
  + [(dim, causal, torch.bfloat16, "short") for dim in gf.SHORT_CONFIGS for causal in (False, True)])
def test_compiles_for_sm90_without_spills(dim, causal, dtype, changes, tmp_path, monkeypatch):
    schedule = gf.SHORT_CONFIGS[dim] if changes == "short" else gf.CONFIGS[dim]._replace(**changes)
    monkeypatch.setitem(gf.CONFIGS, dim, schedule)
    kernel = compile_for_sm90(dim, causal, dtype)
    parked = PARKED_BYTES.get((dim, causal, changes if isinstance(changes, str) else None), 0)
    ptx = assert_warp_specialized_tma_kernel(kernel, tmp_path, parked, "P V with the softmax")
    short = {torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]
    assert f"cvt.rn.{short}x2.f32" in ptx and f"cvt.rn.{short}.f32" not in ptx, \
        "P and O converted one element at a time (ptxas re-pairs those with a PRMT each: `paired_cast`)"
    ttgir = kernel.asm["ttgir"]
    assert ttgir.count("ttg.warp_specialize(") == 1
    assert not re.search(r"%arg\d+: i1 ", ttgir), "a constexpr reached the partitions as a run-time flag"


def rule_placeholders(batch=2, heads=4, n=300) -> tuple:
    """`gluon_forward.rule_arguments` of every rule, over CPU tensors (compile tests)."""
    ids = torch.zeros(batch, n, dtype=torch.int32)
    segment_table = torch.zeros(batch, gf.ceil_div(n, 64), 4, dtype=torch.int32)
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    return (3, 0, 0.5, torch.empty(batch, heads), heads, 1, torch.empty(heads), torch.zeros(batch, dtype=torch.int32),
            ids, n, 1, ids, n, 1, segment_table, cu, cu)


# RULES bits (`gluon_forward.rule_bits`) compiled for each head dim: every rule, packing, both together.
RULE_SETS = {"window softcap alibi sinks": 15, "window softcap sinks": 11, "prefix segments": 48, "every rule": 63, "packed": 64,
             "packed with rules": 79}


@pytest.mark.parametrize("rules,schedule", [(rules, "long") for rules in RULE_SETS] + [("packed", "short")])
@pytest.mark.parametrize("dim,causal", [(64, True), (128, True), (128, False)])
def test_rule_variants_compile_for_sm90(dim, causal, rules, schedule, tmp_path):
    """The score rules and packing keep the kernel's design; spills stay small (the d = 64 kernel's three
    consumer warpgroups have 160 registers each). Packing alone also takes the short schedules."""
    cfg = gf.SHORT_CONFIGS[dim] if schedule == "short" else gf.CONFIGS[dim]
    q, k, v = (torch.empty(2, heads, 300, dim, dtype=torch.bfloat16) for heads in (4, 2, 2))
    args, _ = gf.forward_arguments(q, k, v, torch.empty_like(q), torch.empty(2, 4, 300), 0.5, causal, programs=4,
                                   rule_tensors=rule_placeholders(), cfg=cfg)
    kernel = compile_gluon_for_sm90(gf.gluon_forward_kernel, args,
                                    gf.kernel_constants(dim, causal, RULE_SETS[rules], cfg))
    usage = resource_usage(kernel, tmp_path)
    assert usage["LOCAL"] == 0 and usage["STACK"] <= 128, f"register spills: {usage}"
    ptx = kernel.asm["ptx"]
    assert "setmaxnreg.inc" in ptx and "wgmma.wait_group.sync.aligned 1;" in ptx
    assert ("tanh.approx.f32" in ptx) == bool(RULE_SETS[rules] & gf.SOFTCAP.value)
    if RULE_SETS[rules] & gf.ALIBI.value:  # a split distance (`splits_alibi`) takes no |distance| per score
        split = dim == 128 and causal and not RULE_SETS[rules] & (gf.PREFIX.value | gf.RIGHT.value)
        assert ("abs.f32" in ptx) != split
    if dim == 128:  # no score's ALiBi distance converts by cvt (`int_as_float`): a few scalar conversions
        assert len(re.findall(r"cvt\.rn\.f32\.[su]32", ptx)) <= 8


def test_int_as_float_is_exact_below_two_to_the_22():
    """`int_as_float`'s arithmetic, on the host: every int32 |n| < 2^22 added to the bits of 1.5 * 2^23,
    read as float32, less 1.5 * 2^23, is float(n) exactly; past the range it is not."""
    n = torch.arange(-(1 << 22), 1 << 22, dtype=torch.int32)
    as_float = (n + gf.INT_AS_FLOAT.value).view(torch.float32) - 12582912.0
    assert torch.equal(as_float, n.to(torch.float32))
    beyond = torch.tensor([(1 << 22) + 1, -(1 << 22) - 1], dtype=torch.int32)
    assert ((beyond + gf.INT_AS_FLOAT.value).view(torch.float32) - 12582912.0 != beyond.float()).all()


def cpu_inputs(dtype=torch.bfloat16, dim=64, heads=(2, 2)):
    q = torch.randn(1, heads[0], 8, dim).to(dtype)
    k = torch.randn(1, heads[1], 8, dim).to(dtype)
    return q, k, torch.randn(1, heads[1], 8, dim).to(dtype)


def test_supports_names_every_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = cpu_inputs(torch.float32, dim=81, heads=(3, 2))
    q, k = q[..., :80], k[..., :80]  # rows of 81 floats: not 16-byte aligned
    params = AttentionParams(scale=-1.0, window=(4, 0), dropout_p=0.1, block_m=64)
    reasons = " | ".join(gf.gluon_supports(q, k, v[..., :48], torch.ones(8, 8, dtype=torch.bool), params))
    for words in ("CUDA", "float32", "D=80, Dv=48", "mask", "dropout_p=0.1",
                  "scale=-1.0", "block_m=64", "multiple of key/value heads", "TMA"):
        assert words in reasons, (words, reasons)
    assert "window" not in reasons  # every window is the kernel's


@pytest.mark.parametrize("interpret,words", [("0", "CUDA"), ("1", "TRITON_INTERPRET")])
def test_supports_only_names_the_device_for_good_cpu_inputs(interpret, words, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    q, k, v = cpu_inputs()
    reasons = gf.gluon_supports(q, k, v, None, AttentionParams(scale=0.125, window=(-1, 0)))
    assert len(reasons) == 1 and words in reasons[0], reasons
    with pytest.raises(ValueError, match=words):
        gf.gluon_forward(q, k, v, AttentionParams(scale=0.125))


@pytest.mark.parametrize("version,expected", [("3.6.0", True), ("3.6.1+git1234", True), ("3.5.1", False), ("3.7.0", False)])
def test_gluon_only_with_the_triton_it_was_written_for(version, expected, monkeypatch):
    from exattn.backends.triton import gluon_written_for_this_triton

    monkeypatch.setattr(triton, "__version__", version)
    assert gluon_written_for_this_triton() is expected


@pytest.mark.parametrize("head_dim,len_q,expected", [(64, 1, True), (128, 1, True), (96, 65536, False)])
def test_gluon_forward_only_where_measured_faster(head_dim, len_q, expected):
    from exattn.backends.triton import GLUON_FORWARD_MIN_LEN, gluon_length_ok

    assert gluon_length_ok(GLUON_FORWARD_MIN_LEN, head_dim, len_q) is expected

# ---------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = [torch.bfloat16, torch.float16]


def gpu_inputs(b, hq, hk, nq, nk, d, dtype, layout="bhnd", logit_scale=1.0, with_dout=False):
    """q, k, v (and dout) on the GPU; layout "bnhd" gives (B, N, H, D) storage seen as (B, H, N, D)."""
    def one(h, n, scale=1.0):
        if layout == "bnhd":
            x = torch.randn(b, n, h, d, device="cuda").transpose(1, 2)
        else:
            x = torch.randn(b, h, n, d, device="cuda")
        return (x * scale).to(dtype)
    tensors = (one(hq, nq, logit_scale), one(hk, nk), one(hk, nk))
    return tensors + (one(hq, nq),) if with_dout else tensors


def check(q, k, v, causal):
    params = AttentionParams(scale=q.shape[-1] ** -0.5, window=(-1, 0) if causal else (-1, -1))
    assert gf.gluon_supports(q, k, v, None, params) == []
    out, lse = gf.gluon_forward(q, k, v, params)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    naive = exattn.attention(q, k, v, causal=causal, backend="naive", return_lse=True)
    ref = attention_ref(q, k, v, causal=causal, return_lse=True)
    for name, ours, base, r in zip(("out", "lse"), (out, lse), naive, ref):
        assert_matches_oracle(name, ours, base, r, q.dtype)
    return out, lse


SHAPES = [  # (B, Hq, Hk, Nq, Nk)
    (1, 2, 2, 1, 1),
    (2, 4, 1, 1, 300),      # one query row, MQA
    (1, 2, 2, 64, 64),
    (1, 6, 2, 77, 211),     # GQA, Nq < Nk, ragged
    (2, 2, 1, 257, 129),    # Nq > Nk: causal rows with no key
    (1, 2, 2, 300, 300),
    (1, 3, 3, 200, 17),
    (1, 2, 2, 1000, 1000),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_oracle(dtype, d, causal, shape):
    """Through the schedule `forward_config` picks: every shape here is short."""
    torch.manual_seed(hash((d, causal) + shape) % 2**31)
    check(*gpu_inputs(*shape, d, dtype), causal)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", sorted(gf.SHORT_CONFIGS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_long_schedule_matches_oracle_on_short_shapes(dtype, d, causal, shape, monkeypatch):
    """CONFIGS[d], which the head dims with a short schedule take only for long rows, on the same shapes."""
    monkeypatch.delitem(gf.SHORT_CONFIGS, d)
    assert gf.forward_config(d, shape[3], shape[4], causal, 0) is gf.CONFIGS[d]
    torch.manual_seed(hash((d, causal) + shape) % 2**31)
    check(*gpu_inputs(*shape, d, dtype), causal)


def test_short_problems_take_the_short_schedule():
    """SHORT_CONFIGS for problems without score rules whose rows see at most SHORT_MEAN_KEYS keys on average."""
    short, long = gf.SHORT_CONFIGS[64], gf.CONFIGS[64]
    assert gf.forward_config(64, 1024, 1024, False, 0) is short
    assert gf.forward_config(64, 2048, 2048, False, 0) is long
    assert gf.forward_config(64, 2048, 2048, True, 0) is short
    assert gf.forward_config(64, 4096, 4096, True, 0) is long
    assert gf.forward_config(64, 1, 1024, True, 0) is short and gf.forward_config(64, 1, 1025, True, 0) is long
    assert gf.forward_config(64, 1500, 700, True, 0) is short  # Nq > Nk under causal
    assert gf.forward_config(64, 512, 512, True, gf.SOFTCAP.value) is long
    assert gf.forward_config(64, 512, 512, False, gf.VARLEN.value) is short  # packing: the longest sequence's
    assert gf.forward_config(64, 512, 512, False, gf.VARLEN.value | gf.ALIBI.value) is long
    assert gf.forward_config(64, 512, 512, True, gf.VARLEN.value, ragged=True) is short
    assert gf.forward_config(128, 512, 512, True, gf.VARLEN.value) is gf.SHORT_CONFIGS[128]
    assert gf.forward_config(128, 512, 512, True, gf.VARLEN.value, ragged=True) is gf.RAGGED_SHORT_CONFIGS[128]
    assert gf.RAGGED_SHORT_CONFIGS[128].block_n == 64
    assert gf.forward_config(128, 4096, 4096, True, gf.VARLEN.value, ragged=True) is gf.CONFIGS[128]
    assert gf.forward_config(128, 2048, 2048, True, 0) is gf.SHORT_CONFIGS[128]
    assert gf.forward_config(128, 4096, 4096, True, 0) is gf.CONFIGS[128]
    for cfg in gf.SHORT_CONFIGS.values():
        assert gf.persistent_grid(cfg, causal=True) and gf.persistent_grid(cfg, causal=False)


def test_packed_problems_of_equal_lengths_take_the_dense_schedule():
    """Packed (total, H, D) tensors: the longest sequence's lengths, and ragged unless the totals show
    every sequence at that length."""
    from exattn.backends.triton.passes import Packing

    cu = torch.tensor([0, 512, 1024, 1536, 2048], dtype=torch.int32)
    equal = torch.empty(2048, 4, 128)
    packing = Packing(cu, cu, 512, 512)
    assert gf.launch_config(equal, equal, True, gf.VARLEN.value, packing) is gf.SHORT_CONFIGS[128]
    ragged = Packing(cu, cu, 600, 512)
    assert gf.launch_config(equal, equal, True, gf.VARLEN.value, ragged) is gf.RAGGED_SHORT_CONFIGS[128]
    narrow = equal[:, :, :64]
    assert gf.launch_config(narrow, narrow, True, gf.VARLEN.value, ragged) is gf.RAGGED_SHORT_CONFIGS[64]
    dense = torch.empty(4, 4, 512, 128)
    assert gf.launch_config(dense, dense, True, 0, None) is gf.SHORT_CONFIGS[128]
    assert gf.launch_config(dense, torch.empty(4, 4, 4096, 128), True, 0, None) is gf.CONFIGS[128]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("d", sorted(gf.SHORT_CONFIGS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(4, 16, 4, 1024, 1024), (3, 6, 3, 1500, 700), (2, 8, 8, 2048, 2048)],
                         ids=lambda s: "x".join(map(str, s)))
def test_short_schedule_strides_over_many_tiles(d, causal, shape):
    """The short schedule's persistent grid over more work tiles than SMs, causal included."""
    torch.manual_seed(hash((d, causal) + shape) % 2**31)
    q, k, v = gpu_inputs(*shape, d, torch.bfloat16)
    cfg = gf.forward_config(d, shape[3], shape[4], causal, 0)
    if shape[3] == 2048 and not causal:
        assert cfg is gf.CONFIGS[d]
    else:
        assert cfg is gf.SHORT_CONFIGS[d]
        (programs,) = gf.forward_arguments(q, k, v, q, q, 0.5, causal, cfg=cfg)[1]
        assert programs == torch.cuda.get_device_properties(0).multi_processor_count
    check(q, k, v, causal)


# Persistent grids (one program per SM striding over the work tiles; full attention only): more
# tiles than SMs, one tile, ragged lengths.
PERSISTENT = {64: {"persistent": True, "consumers": 2, "stages": 4}, 128: {"persistent": True}}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("shape", [(1, 2, 2, 1, 1), (2, 8, 2, 2100, 2100), (3, 6, 3, 1500, 700), (1, 4, 1, 77, 3000)],
                         ids=lambda s: "x".join(map(str, s)))
def test_persistent_grid_matches_oracle(dtype, d, shape, monkeypatch):
    monkeypatch.setitem(gf.CONFIGS, d, gf.CONFIGS[d]._replace(**PERSISTENT[d]))
    torch.manual_seed(hash((d,) + shape) % 2**31)
    q, k, v = gpu_inputs(*shape, d, dtype)
    (programs,) = gf.forward_arguments(q, k, v, q, q, 0.5, causal=False)[1]
    assert programs <= torch.cuda.get_device_properties(0).multi_processor_count
    check(q, k, v, causal=False)


def test_persistent_grid_only_for_full_attention():
    cfg = gf.GluonConfig(128, 2, persistent=True)
    assert gf.persistent_grid(cfg, causal=False) and not gf.persistent_grid(cfg, causal=True)
    assert not gf.persistent_grid(cfg._replace(persistent=False), causal=False)
    assert gf.persistent_grid(cfg._replace(persistent_causal=True), causal=True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_a_negative_scale_takes_each_rows_true_maximum(d, causal):
    """The kernel scales each tile's row maximum of the raw scores; a negative scale runs as -q with |scale|
    (`passes.with_positive_scale`): logits of about +-100 stay finite and match the oracle."""
    torch.manual_seed(13)
    q, k, v = gpu_inputs(1, 4, 2, 333, 515, d, torch.bfloat16, logit_scale=8.0)
    params = AttentionParams(scale=-0.3, window=(-1, 0) if causal else (-1, -1))
    out, lse = gf.gluon_forward(q, k, v, params)
    naive = exattn.attention(q, k, v, causal=causal, scale=-0.3, backend="naive", return_lse=True)
    ref = attention_ref(q, k, v, causal=causal, scale=-0.3, return_lse=True)
    for name, ours, base, r in zip(("out", "lse"), (out, lse), naive, ref):
        assert_matches_oracle(name, ours, base, r, q.dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
def test_fully_masked_rows_give_zero_and_minus_inf(dtype, d):
    torch.manual_seed(3)
    q, k, v = gpu_inputs(1, 2, 2, 300, 70, d, dtype)
    out, lse = check(q, k, v, causal=True)
    empty = 300 - 70  # rows i with i + Nk - Nq < 0
    assert (out[:, :, :empty] == 0).all() and (lse[:, :, :empty] == float("-inf")).all()
    assert torch.isfinite(lse[:, :, empty:]).all()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n_q,n_k", [(130, 200), (300, 333)])
def test_rows_whose_first_tiles_are_masked_keep_very_negative_scores(dtype, d, n_q, n_k):
    """A row's running max stays -inf through the key tiles it cannot see (window (0, 0): its own
    key only, which scores about -200 |k|): a shift of 0 there underflows the row's mass."""
    torch.manual_seed(12)
    q, k, v = own_key_scores_far_below_the_rest(n_q, n_k, d, dtype, device="cuda")
    out, lse = gf.gluon_forward(q, k, v, AttentionParams(scale=d ** -0.5, window=(0, 0)))
    own = (q.double() * k[:, :, n_k - n_q:].double()).sum(-1) * d ** -0.5
    assert own.max() < -400
    torch.testing.assert_close(out, v[:, :, n_k - n_q:], rtol=0, atol=0)
    torch.testing.assert_close(lse.double(), own, rtol=1e-5, atol=0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_huge_logits_and_strided_inputs(dtype, d, causal):
    torch.manual_seed(4)
    check(*gpu_inputs(2, 4, 2, 333, 515, d, dtype, layout="bnhd", logit_scale=60.0), causal)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence_many_pipeline_rounds(d, causal):
    torch.manual_seed(5)
    check(*gpu_inputs(1, 2, 1, 2048, 4100, d, torch.bfloat16), causal)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("d,changes", SCHEDULES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_other_schedules_match_oracle(d, changes, causal, monkeypatch):
    monkeypatch.setitem(gf.CONFIGS, d, gf.CONFIGS[d]._replace(**changes))
    torch.manual_seed(6)
    for shape in [(1, 4, 2, 1000, 1000), (2, 2, 1, 257, 129), (1, 2, 2, 1, 300)]:
        check(*gpu_inputs(*shape, d, torch.bfloat16), causal)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("d", GLUON_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_triton_backend_uses_gluon_with_correct_gradients(d, causal, monkeypatch):
    from exattn.backends import triton as triton_backend
    from exattn.backends.triton import settings

    monkeypatch.setitem(triton_backend.GLUON_FORWARD_MIN_LEN, d, 333)  # this test's query length
    calls = []
    real = gf.run_gluon_forward
    monkeypatch.setattr(gf, "run_gluon_forward", lambda *args: calls.append(1) or real(*args))
    torch.manual_seed(7)
    q, k, v = (x.requires_grad_() for x in gpu_inputs(2, 4, 2, 333, 515, d, torch.bfloat16))
    dout = torch.randn(2, 4, 333, d, device="cuda", dtype=torch.bfloat16)
    grads = {}
    for backend in ("triton", "naive"):
        out = exattn.attention(q, k, v, causal=causal, backend=backend)
        grads[backend] = (out, *torch.autograd.grad(out, (q, k, v), dout))
    assert len(calls) == 1  # the triton backend's forward went through Gluon
    ref_inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out = attention_ref(*ref_inputs, causal=causal)
    ref = (ref_out, *torch.autograd.grad(ref_out, ref_inputs, dout.double()))
    for name, ours, base, r in zip(("out", "dq", "dk", "dv"), grads["triton"], grads["naive"], ref):
        assert_matches_oracle(name, ours, base, r, q.dtype)
    monkeypatch.setitem(triton_backend.GLUON_FORWARD_MIN_LEN, d, 334)
    exattn.attention(q, k, v, causal=causal, backend="triton")
    assert len(calls) == 1  # shorter than where Gluon wins: the Triton forward kernel
    monkeypatch.setitem(triton_backend.GLUON_FORWARD_MIN_LEN, d, 333)
    monkeypatch.setattr(settings, "use_gluon", False)
    exattn.attention(q, k, v, causal=causal, backend="triton")
    assert len(calls) == 1  # switched off: the Triton forward kernel


def forced_heads_per_group(size):
    """A stand-in for `schedule.heads_per_group`: `size` heads per group where it divides the heads."""
    return lambda rank_costs, batch_heads, programs, head_bytes, strided=False: size if batch_heads % size == 0 else 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("size", [2, 3, 6])
@pytest.mark.parametrize("shape", [(2, 6, 3, 700, 700), (2, 3, 3, 300, 900), (1, 6, 2, 900, 257)],
                         ids=lambda s: "x".join(map(str, s)))
def test_causal_head_groups_match_oracle(d, size, shape, monkeypatch):
    monkeypatch.setattr(gf.schedule, "heads_per_group", forced_heads_per_group(size))
    torch.manual_seed(hash((d, size) + shape) % 2**31)
    check(*gpu_inputs(*shape, d, torch.bfloat16), causal=True)


def test_rule_bits_and_arguments_name_each_rule():
    from exattn.backends.triton.passes import Packing
    from exattn.problem import ScoreRules

    plain = AttentionParams(scale=0.5, window=(-1, 0))
    assert gf.rule_bits(plain, None, None) == 0
    ids = torch.zeros(2, 300, dtype=torch.int32)
    rules = ScoreRules(ids, ids, torch.zeros(2, dtype=torch.int32), torch.ones(2, 4), torch.zeros(4))
    windowed = AttentionParams(scale=0.5, window=(7, 3), softcap=25.0)
    cu = torch.zeros(3, dtype=torch.int32)
    bits = gf.rule_bits(windowed, rules, Packing(cu, cu, 300, 300))
    assert bits == sum(b.value for b in (gf.LEFT, gf.RIGHT, gf.SOFTCAP, gf.ALIBI, gf.SINKS, gf.PREFIX, gf.SEGMENTS,
                                         gf.VARLEN))
    assert gf.rule_bits(AttentionParams(scale=0.5, window=(-1, 5)), None, None) == gf.RIGHT.value  # not causal's 0
    q = torch.empty(2, 4, 300, 64, dtype=torch.bfloat16)
    args = gf.rule_arguments(q, q, windowed, None, None)
    assert args[:3] == (7, 3, 50.0)  # the window in rows, the softcap in raw units (softcap / scale)
    assert all(x is q for x in args if isinstance(x, torch.Tensor))  # placeholders where a rule is off


def test_supports_packed_batches_and_refuses_sinks_without_keys(monkeypatch):
    from exattn.backends.triton.passes import Packing
    from exattn.problem import ScoreRules

    monkeypatch.setattr(gf, "gluon_device_reasons", lambda device: [])
    params = AttentionParams(scale=0.125, window=(-1, 0))
    q, k = torch.empty(500, 8, 64, dtype=torch.bfloat16), torch.empty(700, 2, 64, dtype=torch.bfloat16)
    cu = torch.zeros(3, dtype=torch.int32)
    assert gf.gluon_supports(q, k, k, None, params, None, Packing(cu, cu, 300, 400)) == []
    assert gf.packed_view(q).shape == (1, 8, 500, 64)
    qkv = torch.empty(500, 3, 8, 64, dtype=torch.bfloat16)  # a slice of a packed qkv buffer
    assert gf.gluon_supports(qkv[:, 0], qkv[:, 1], qkv[:, 2], None, params, None, Packing(cu, cu, 300, 300)) == []
    dense = torch.empty(1, 2, 16, 64, dtype=torch.bfloat16)
    no_keys = torch.empty(1, 2, 0, 64, dtype=torch.bfloat16)
    reasons = gf.gluon_supports(dense, no_keys, no_keys, None, params, ScoreRules(sinks=torch.zeros(2)))
    assert any("sinks" in r for r in reasons), reasons


@pytest.mark.parametrize("dim", [64, 128])
def test_alibi_positions_beyond_float32_go_elsewhere(dim, monkeypatch):
    """ALiBi's distances reach float32 in the Gluon kernels by `int_as_float`, exact below 2^22: past
    FLOAT_POSITIONS rows or keys (2^22 less two tiles of padding) they refuse, by name, at both head dims; at
    the limit they serve."""
    from exattn.problem import ScoreRules

    monkeypatch.setattr(gf, "gluon_device_reasons", lambda device: [])
    params = AttentionParams(scale=0.125, window=(-1, 0))
    alibi = ScoreRules(alibi_slopes=torch.ones(1, 2))
    q = torch.empty(1, 2, 16, dim, dtype=torch.bfloat16)
    at_limit, beyond = (torch.empty(1, 2, 1, dim, dtype=torch.bfloat16).expand(1, 2, n, dim)  # shapes only
                        for n in (gf.FLOAT_POSITIONS, gf.FLOAT_POSITIONS + 1))
    reasons = [r for r in gf.gluon_supports(q, beyond, beyond, None, params, alibi) if "ALiBi" in r]
    assert len(reasons) == 1 and f"got {gf.FLOAT_POSITIONS + 1}" in reasons[0]
    assert not [r for r in gf.gluon_supports(q, at_limit, at_limit, None, params, alibi) if "ALiBi" in r]
    assert not [r for r in gf.gluon_supports(q, beyond, beyond, None, params) if "ALiBi" in r]
