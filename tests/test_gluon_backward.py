"""The Gluon (sm_90) backward: compiled for Hopper on the CPU, run against the oracle on the GPU.

CPU (CI): every shipped configuration of both kernels (dK/dV and dQ), and the
d = 64 candidates the benchmark compares, compiles for sm_90a with the wheel's
ptxas from the arguments `launch` builds (host TMA descriptors included),
without spills, inside Hopper's shared memory, and keeps its design (warp
specialization, 4-D TMA boxes, no per-program descriptors, the dP wgmma in
flight under the exponentials, no atomics); `gluon_backward_supports` names
every reason it refuses. GPU (`-m gpu`): dq, dk, dv on awkward shapes against
the float64 oracle with the shared error rule (the candidates too), bitwise
reruns, accumulate_into, and the dispatch of backend "triton".
"""

from __future__ import annotations

import itertools
import re
import subprocess

import pytest
import torch
import triton
from error_rule import assert_matches_oracle
from test_gluon_forward import (
    DTYPES,
    HOPPER_SHARED_BYTES,
    SHAPES,
    assert_warp_specialized_tma_kernel,
    compile_gluon_for_sm90,
    cpu_inputs,
    forced_heads_per_group,
    gpu_inputs,
    needs_cuda,
    resource_usage,
    rule_placeholders,
)

import exattn
from exattn.backends.triton import gluon_backward as gb
from exattn.backends.triton import gluon_forward as gf
from exattn.backends.triton.passes import Packing
from exattn.problem import AttentionParams
from exattn.reference import attention_ref

KERNELS = {"dkdv": gb.gluon_dkdv_kernel, "dq": gb.gluon_dq_kernel}
# d = 64 tile variants measured against the shipped ones:
# compiled here, run against the oracle on the GPU.
CANDIDATES = {
    "64:64x4/64x4r": gb.GluonBackwardConfig(64, 4, 64, 4, True),
    "64:64x4/64x4": gb.GluonBackwardConfig(64, 4, 64, 4),
    "64:64x4/128x2": gb.GluonBackwardConfig(64, 4, 128, 2),
}
CONFIG_IDS = ["shipped", *CANDIDATES]


# How the dK/dV kernel forms dQ under each config id (else a dQ kernel); "ordered-unrotated":
# ordered dQ with `settings.rotated_dq_order` off.
DQ_MODES = {"atomic": "atomic", "ordered": "ordered", "ordered-unrotated": "ordered"}


def config_for(dim: int, config_id: str) -> gb.GluonBackwardConfig:
    if config_id in DQ_MODES:
        return gb.ATOMIC_CONFIGS[dim]
    return gb.CONFIGS[dim] if config_id == "shipped" else CANDIDATES[config_id]


def launch_arguments(kind: str, dim: int, dtype: torch.dtype, accumulate: bool, cfg, dq_mode: str = "kernel",
                     rule_tables: tuple | None = None) -> tuple:
    """(positional arguments, constexprs) as `gluon_backward.launch` passes them, built from CPU
    tensors (contiguous, (B, N, H, D) memory for the float32 accumulators); dq_mode "atomic": the
    dK/dV kernel with a float32 dQ to add into, "ordered": also with its semaphores; rule_tables: the
    (dK/dV, dQ) rule arguments (default: placeholders, `backward_rule_arguments` without rules)."""
    q, k, v = (torch.empty(2, heads, 300, dim, dtype=dtype) for heads in (4, 2, 2))
    if accumulate:
        dq, dk, dv = (torch.empty(2, 300, x.shape[1], dim).transpose(1, 2) for x in (q, k, v))
    else:
        dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    pad = gb.stats_rows(300)
    lse2 = delta = torch.empty(8, pad)
    dkdv_rules, dq_rules = rule_tables or gb.backward_rule_arguments(q, k, AttentionParams(scale=1.0), None, cfg)
    if kind == "dkdv":
        dq_sum = torch.empty(q.shape) if dq_mode != "kernel" else None
        semaphores = torch.empty(8, pad // cfg.dkdv_block_m, dtype=torch.int32) if dq_mode == "ordered" else None
        args, _ = gb.dkdv_arguments(q, q, k, v, lse2, delta, dk, dv, pad, cfg, False, dq_sum, semaphores, accumulate)
        args = (*args, 0.5, 0.1, *dkdv_rules)
        stages = dict(STAGES=cfg.dkdv_stages, DQ_SLOTS=cfg.dq_slots, ALTERNATE_DQ=cfg.alternate_dq)
    else:
        args, _ = gb.dq_arguments(q, q, k, v, q, torch.empty(2, 4, 300), dq, cfg, False)
        args = (*args, 0.5, 0.1, *dq_rules)
        stages = dict(STAGES=cfg.dq_stages)
    return args, dict(**stages, **gb.kernel_options(cfg, False, accumulate))


def compile_for_sm90(kind: str, dim: int, causal: bool, dtype: torch.dtype, accumulate: bool = False,
                     config_id: str = "shipped"):
    """One kernel as `gluon_backward` launches it, compiled for sm_90a."""
    kernel = KERNELS[kind]
    dq_mode = DQ_MODES.get(config_id, "kernel")
    args, consts = launch_arguments(kind, dim, dtype, accumulate, config_for(dim, config_id), dq_mode)
    if kind == "dkdv":
        consts["ROTATE"] = config_id == "ordered" and not causal
    return compile_gluon_for_sm90(kernel, args, {**consts, "CAUSAL": causal})


@pytest.mark.parametrize("kind,dim,causal,dtype,accumulate,config_id", [
    ("dkdv", 128, False, torch.bfloat16, False, "shipped"), ("dkdv", 128, True, torch.bfloat16, False, "shipped"),
    ("dkdv", 64, False, torch.bfloat16, False, "shipped"), ("dkdv", 64, True, torch.bfloat16, False, "shipped"),
    ("dkdv", 128, True, torch.float16, True, "shipped"), ("dkdv", 64, True, torch.float16, True, "shipped"),
    ("dq", 128, False, torch.bfloat16, False, "shipped"), ("dq", 128, True, torch.bfloat16, False, "shipped"),
    ("dq", 64, False, torch.bfloat16, False, "shipped"), ("dq", 64, True, torch.bfloat16, False, "shipped"),
    ("dq", 128, True, torch.float16, True, "shipped"), ("dq", 64, True, torch.float16, True, "shipped"),
    *[(kind, 64, True, torch.bfloat16, accumulate, config_id) for config_id in CANDIDATES
      for kind in KERNELS for accumulate in (False, True)],
    *[("dkdv", dim, causal, torch.bfloat16, False, mode) for dim in gb.ATOMIC_CONFIGS for causal in (False, True)
      for mode in ("atomic", "ordered")],
    *[("dkdv", dim, False, torch.bfloat16, False, "ordered-unrotated") for dim in gb.ATOMIC_CONFIGS],
    ("dkdv", 128, True, torch.float16, True, "atomic"),
])
def test_compiles_for_sm90_without_spills(kind, dim, causal, dtype, accumulate, config_id, tmp_path):
    kernel = compile_for_sm90(kind, dim, causal, dtype, accumulate, config_id)
    dq_mode = DQ_MODES.get(config_id, "kernel")
    tma_grads = kind == "dkdv" and not accumulate  # 600-row sweeps: `grad_outputs` stores by TMA
    check_compiled(kernel, kind, dim, causal, dq_mode, tma_grads, tmp_path)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config_id", ["shipped", "ordered"])
def test_register_stored_grads_compile_without_spills(causal, config_id, tmp_path, monkeypatch):
    """d = 128 from TMA_GRADS_MAX_ROWS query rows a sweep: dK and dV stored from registers."""
    monkeypatch.setitem(gb.TMA_GRADS_MAX_ROWS, 128, 0)
    kernel = compile_for_sm90("dkdv", 128, causal, torch.bfloat16, False, config_id)
    check_compiled(kernel, "dkdv", 128, causal, DQ_MODES.get(config_id, "kernel"), False, tmp_path)


def allowed_stack(kind: str, dim: int, causal: bool, dq_mode: str, tma_grads: bool) -> int:
    """Bytes of stack ptxas may park scalars in. dK/dV, d = 128, causal: those of the diagonal mask,
    reloaded on diagonal tiles only (8 bytes; 32 with the dQ staging of atomic and ordered dQ); with
    their 3 Q/dO ring slots also one loop scalar (8 bytes non-causal). The TMA stores of dK and dV
    park more, some of it in the d = 128 sweep (TMA_GRADS_MAX_ROWS: measured slower from 8k rows)."""
    if kind != "dkdv":
        return 0
    if dim != 128:
        return 8 if tma_grads and causal else 0
    if tma_grads and dq_mode != "kernel":
        return 56 if causal else 16
    return 32 if dq_mode != "kernel" and causal else 8 if causal or dq_mode != "kernel" else 0


def check_compiled(kernel, kind: str, dim: int, causal: bool, dq_mode: str, tma_grads: bool, tmp_path):
    stack = allowed_stack(kind, dim, causal, dq_mode, tma_grads)
    ptx = assert_warp_specialized_tma_kernel(kernel, tmp_path, stack, "dP with the exponentials")
    atomics = [a.split()[-1] for a in
               re.findall(r"^\s*(?:@!?%p\d+\s+)?(?:atom|red|cp\.reduce)\.\S*", ptx, re.MULTILINE)]
    reduction = "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.bulk_group"
    if dq_mode != "kernel":  # the writer warp's TMA reductions (two halves, 128-byte boxes)
        reductions = [a for a in atomics if a == reduction]
        assert len(reductions) == max(2, dim // 32), atomics
        turns = ["atom.global.gpu.relaxed.add.u32"] if dq_mode == "ordered" else []
        assert [a for a in atomics if a != reduction] == turns, atomics
        expected = 1 if dq_mode == "ordered" else 0
        assert ptx.count("ld.relaxed.gpu.global.b32") == expected, "the writer reads its turn early"
        assert ptx.count("ld.global.acquire.gpu.b32") == expected, "and waits for it if it has not come"
        assert ptx.count("cp.async.bulk.wait_group 0;") == expected, "a turn passes once the reduction is written"
    else:
        assert not atomics, f"atomics {atomics[:3]}: the backward must stay deterministic"
        reductions, expected = [], 0
    stores = re.findall(r"cp\.async\.bulk\.tensor\.4d\.global\.shared::cta\.bulk_group", ptx)
    grad_stores = 4 if tma_grads else 0  # dK and dV of each consumer warpgroup
    assert len(stores) == expected * len(reductions) + grad_stores, "ordered: a tile's first contribution is stored"


# RULES bits (`gluon_backward.backward_rule_bits`) compiled for each kernel and head dim.
BACKWARD_RULE_SETS = {"window softcap alibi": gf.LEFT.value | gf.SOFTCAP.value | gf.ALIBI.value,
                      "window softcap": gf.LEFT.value | gf.SOFTCAP.value,
                      "prefix segments": gf.PREFIX.value | gf.SEGMENTS.value,
                      "every rule": gf.LEFT.value | gf.RIGHT.value | gf.SOFTCAP.value | gf.ALIBI.value
                      | gf.PREFIX.value | gf.SEGMENTS.value,
                      "packed": gf.VARLEN.value,
                      "packed with rules": gf.VARLEN.value | gf.LEFT.value | gf.SOFTCAP.value | gf.ALIBI.value
                      | gf.PREFIX.value}


def rule_tables() -> tuple:
    """(dK/dV, dQ) rule arguments of every rule over CPU tensors, shaped as `backward_rule_arguments` makes
    them for `launch_arguments`'s problem (B = 2, Hq = 4, N = 300)."""
    forward = rule_placeholders()
    dq_rules = forward[:6] + forward[7:]
    query_tiles = torch.zeros(2, gf.ceil_div(300, 128), 4, dtype=torch.int32)
    return dq_rules[:13] + (query_tiles,) + dq_rules[14:], dq_rules


@pytest.mark.parametrize("rules", BACKWARD_RULE_SETS)
@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("dim,causal", [(64, True), (128, True), (128, False)])
def test_rule_variants_compile_for_sm90(kind, dim, causal, rules, tmp_path):
    """The score rules keep each kernel's design in their tiles (`tile_config`): the 32-row tiles of
    `RULE_CONFIGS` without spills (the dK/dV kernel may park a few scalars on the stack, as the causal
    diagonal does); the 64-row tiles park at most what was measured faster than those (216 bytes: the
    d = 64 dQ kernel's 128-key register tiles with prefix and segment ids)."""
    cfg = gb.tile_config(BACKWARD_RULE_SETS[rules], False, dim)
    allowed = 24 if cfg in gb.RULE_CONFIGS.values() else 216
    args, consts = launch_arguments(kind, dim, torch.bfloat16, False, cfg, rule_tables=rule_tables())
    consts["RULES"] = BACKWARD_RULE_SETS[rules]
    if kind == "dkdv":
        consts["ROTATE"] = False
    kernel = compile_gluon_for_sm90(KERNELS[kind], args, {**consts, "CAUSAL": causal})
    usage = resource_usage(kernel, tmp_path)
    assert usage["LOCAL"] == 0 and usage["STACK"] <= allowed, f"register spills: {usage}"
    assert kernel.metadata.shared <= HOPPER_SHARED_BYTES, kernel.metadata.shared
    ptx = kernel.asm["ptx"]
    assert "setmaxnreg.inc" in ptx and "wgmma.wait_group.sync.aligned 1;" in ptx
    assert ("tanh.approx.f32" in ptx) == bool(BACKWARD_RULE_SETS[rules] & gf.SOFTCAP.value)
    if BACKWARD_RULE_SETS[rules] & gf.ALIBI.value:  # `backward_splits_alibi`: no |distance| per score
        split = dim == 64 and causal and not BACKWARD_RULE_SETS[rules] & (gf.PREFIX.value | gf.RIGHT.value)
        assert ("abs.f32" in ptx) != split


@pytest.mark.parametrize("dim", [128, 64])
@pytest.mark.parametrize("rule,causal,parked", [("ALIBI", False, 216), ("LEFT", True, 72), ("PREFIX", True, 72),
                                                 ("SEGMENTS", True, 216), ("NARROWING", True, 216)])
def test_dkdv_kernel_adds_dq_under_the_rules_that_keep_its_order(dim, rule, causal, parked, tmp_path):
    """ALiBi alone under full attention keeps the plain sweeps and tiles, and a causal window's left bound,
    a prefix or segment ids shape each key block's sweep for the consumers and the dQ writer alike
    (`key_block_sweep` under the rules): the dK/dV kernel forms dQ in order as without rules
    (`dq_in_dkdv_serves`), parking at most the 216 bytes of `test_rule_variants_compile_for_sm90` with ALiBi
    or segment ids and 72 with a window or a prefix (d = 128; 56 without a rule)."""
    bits = getattr(gb, rule, None) or getattr(gf, rule)
    bits = bits.value
    cfg = gb.tile_config(bits, True, dim)
    assert cfg is gb.ATOMIC_CONFIGS[dim]
    args, consts = launch_arguments("dkdv", dim, torch.bfloat16, False, cfg, "ordered", rule_tables=rule_tables())
    kernel = compile_gluon_for_sm90(KERNELS["dkdv"], args,
                                    {**consts, "RULES": bits, "ROTATE": not causal, "CAUSAL": causal})
    usage = resource_usage(kernel, tmp_path)
    assert usage["LOCAL"] == 0 and usage["STACK"] <= parked, f"register spills: {usage}"
    ptx = kernel.asm["ptx"]
    assert "cp.reduce.async.bulk" in ptx and "atom.global.gpu.relaxed.add.u32" in ptx


def test_dkdv_kernel_adds_dq_where_measured_faster():
    """Without rules, with ALiBi alone under full attention, and causal under any mix of the rules that
    only narrow a key block's sweep (`NARROWING`: a window's left bound, a prefix, segment ids); causal
    ALiBi, softcap, a right bound and packing keep the dQ kernel."""
    cap, alibi, left, prefix, segments = (gf.SOFTCAP.value, gf.ALIBI.value, gf.LEFT.value, gf.PREFIX.value,
                                          gf.SEGMENTS.value)
    assert gb.dq_in_dkdv_serves(0, True) and gb.dq_in_dkdv_serves(alibi, False)
    for bits in (left, prefix, segments, left | prefix, left | prefix | segments):
        assert gb.dq_in_dkdv_serves(bits, True) and not gb.dq_in_dkdv_serves(bits, False)
    assert not gb.dq_in_dkdv_serves(alibi, True) and not gb.dq_in_dkdv_serves(cap, True)
    for bits in (left | alibi, gf.RIGHT.value | alibi, left | gf.RIGHT.value, segments | alibi,
                 gf.VARLEN.value, left | gf.VARLEN.value, cap | alibi, cap, left | gf.SINKS.value | cap):
        assert not gb.dq_in_dkdv_serves(bits, False) and not gb.dq_in_dkdv_serves(bits, True)


def sass_lines(kernel, tmp_path) -> list[str]:
    """The kernel's SASS (the wheel's nvdisasm), one instruction or label per line, comments dropped."""
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    listing = subprocess.run([triton.knobs.nvidia.nvdisasm.path, "-c", str(cubin)],
                             capture_output=True, text=True, check=True).stdout
    return [line for line in (re.sub(r"/\*.*?\*/", "", raw).strip() for raw in listing.splitlines()) if line]


NOT_WRITES = ("HGMMA", "ST", "RED", "ATOM", "BRA", "SYNCS", "BAR", "WARPGROUP")


def written_registers(line: str) -> set[int]:
    """The R registers an instruction writes: its first operand, 2 or 4 wide for 64/128-bit results."""
    match = re.match(r"(?:@!?U?P\w+\s+)?([A-Z][\w.]*)\s+R(\d+)\b", line)
    if match is None or match.group(1).startswith(NOT_WRITES):
        return set()
    op, first = match.group(1), int(match.group(2))
    width = 4 if re.search(r"\.128|^LDSM.*\.4$", op) else 2 if re.search(r"\.64|\.WIDE|^CS2R|^LDSM.*\.2$", op) else 1
    return set(range(first, first + width))


def wgmma_loops(lines: list[str]) -> list[tuple[int, int]]:
    """(first, last) line of each consumer sweep: a backward branch over wgmmas, within one partition's code."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"(\.L_x_\d+):$", line))}
    loops = []
    for end, line in enumerate(lines):
        target = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if target and labels.get(target.group(1), end) < end:
            body = lines[labels[target.group(1)]:end + 1]
            if any("HGMMA" in b for b in body) and not any(re.match(r"LDSM|EXIT|BRX|USETMAXREG", b) for b in body):
                loops.append((labels[target.group(1)], end))
    return loops


@pytest.mark.parametrize("dim", sorted(gb.ATOMIC_CONFIGS))
def test_dq_tiles_come_whole_or_in_column_halves_as_configured(dim, tmp_path):
    """alternate_dq: a step's dS K is one [64, D] wgmma chain of one warpgroup (dS^T read from shared
    memory once), else each warpgroup's [64, D/2] half (the only wgmmas with a transposed A)."""
    kernel = compile_for_sm90("dkdv", dim, False, torch.bfloat16, False, "ordered")
    dq_wgmmas = [line for line in sass_lines(kernel, tmp_path) if line.startswith("HGMMA") and "tnspA" in line]
    cols = dim if gb.ATOMIC_CONFIGS[dim].alternate_dq else dim // 2
    per_warpgroup = 8  # K = 128 keys in k16 steps, in each consumer partition's code
    assert len(dq_wgmmas) == 2 * per_warpgroup, dq_wgmmas
    assert all(line.startswith(f"HGMMA.64x{cols}x16.") for line in dq_wgmmas), dq_wgmmas


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind,config_id", [(kind, c) for c in CONFIG_IDS if config_for(64, c).in_registers
                                            for kind in KERNELS] + [("dkdv", "atomic"), ("dkdv", "ordered")])
def test_resident_register_operands_survive_the_sweep(kind, config_id, causal, tmp_path):
    """With in_registers, the K, V (dK/dV) or Q, dO (dQ) tiles a consumer loads once into registers (LDSM,
    after the previous partition's sweeps) must keep those registers through every step of its sweeps:
    ptxas once gave K's to dS^T, so the second S^T read dS^T."""
    lines = sass_lines(compile_for_sm90(kind, 64, causal, torch.bfloat16, False, config_id), tmp_path)
    loops = wgmma_loops(lines)
    assert len(loops) >= 2, len(loops)  # 2 warpgroups
    previous_end, resident = 0, set()
    for first, last in loops:
        loads = [line for line in lines[previous_end:first] if line.startswith("LDSM")]
        if loads:  # a partition's loads, else a further sweep of the same partition
            resident = set().union(*(written_registers(line) for line in loads))
        assert len(resident) >= 2 * 16, sorted(resident)  # 2 tiles of 16 registers a thread
        clobbers = [line for line in lines[first:last + 1] if written_registers(line) & resident]
        assert not clobbers, f"resident operand registers overwritten inside the sweep: {clobbers[:4]}"
        previous_end = last + 1


def test_supports_names_every_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = cpu_inputs(torch.float32, dim=81, heads=(3, 2))
    q, k = q[..., :80], k[..., :80]
    params = AttentionParams(scale=-1.0, window=(4, 0), dropout_p=0.1, block_m=64)
    dout = torch.randn(1, 3, 8, 81)[..., :48]
    reasons = " | ".join(gb.gluon_backward_supports(q, k, v[..., :48], torch.ones(8, 8, dtype=torch.bool),
                                                    params, dout, atomic_dq=True))
    for words in ("CUDA", "float32", "D=80, Dv=48", "mask", "dropout_p=0.1",
                  "atomic_dq: not with score rules, packing or window=(4, 0)", "scale=-1.0", "block_m=64",
                  "multiple of key/value heads", "TMA", "dout (shape (1, 3, 8, 48)"):
        assert words in reasons, (words, reasons)
    assert "window" not in " | ".join(gb.gluon_backward_supports(q, k, v[..., :48], None, params, dout))


def test_packed_backward_refuses_accumulate_into(monkeypatch):
    """Packing writes fresh packed gradients; accumulating into the caller's tensors is refused by name."""
    from exattn.backends.triton.passes import Packing

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(12, 2, 64).half()
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    grads = tuple(torch.zeros(12, 2, 64) for _ in range(3))
    with pytest.raises(ValueError, match="accumulate_into with packing is not supported"):
        gb.gluon_backward(q, q, q, q, q, torch.zeros(2, 12), AttentionParams(scale=0.1), grads,
                          packing=Packing(cu, cu, 7, 7))


def test_gluon_backward_serves_rules_and_packing_where_measured_faster():
    """`gluon_backward_faster` (`faster_than_triton`): plain problems, packing and every rule at d = 128; at
    d = 64 all but segment ids without softcap. (Packed batches also need a longest sequence of
    GLUON_PACKED_BACKWARD_MIN_LEN, which the varlen dispatch checks.)"""
    from exattn.backends.triton import gluon_backward_faster
    from exattn.backends.triton.passes import Packing
    from exattn.problem import ScoreRules

    causal, full = AttentionParams(scale=0.1, window=(-1, 0)), AttentionParams(scale=0.1)
    capped = AttentionParams(scale=0.1, window=(-1, 0), softcap=5.0)
    packing = Packing(torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), 8, 8)
    sinks_only, alibi = ScoreRules(sinks=torch.zeros(4)), ScoreRules(alibi_slopes=torch.ones(4))
    segments = ScoreRules(q_segment_ids=torch.zeros(1, 8, dtype=torch.int32),
                          k_segment_ids=torch.zeros(1, 8, dtype=torch.int32))
    assert gluon_backward_faster(64, causal, None) and gluon_backward_faster(64, full, sinks_only)
    assert gluon_backward_faster(128, capped, None) and gluon_backward_faster(64, capped, None)
    assert gluon_backward_faster(128, full, None, packing) and gluon_backward_faster(64, causal, None, packing)
    assert gluon_backward_faster(128, causal, alibi) and gluon_backward_faster(128, causal, segments)
    assert gluon_backward_faster(64, causal, alibi) and not gluon_backward_faster(64, full, segments, packing)
    assert not gluon_backward_faster(64, causal, segments) and gluon_backward_faster(64, capped, segments)


def test_supports_names_head_dims_without_atomic_dq(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delitem(gb.ATOMIC_CONFIGS, 64)
    q, k, v = cpu_inputs(torch.bfloat16, dim=64, heads=(4, 2))
    reasons = " | ".join(gb.gluon_backward_supports(q, k, v, None, AttentionParams(scale=0.1), atomic_dq=True))
    assert "atomic_dq: D=64" in reasons and "(128,)" in reasons, reasons
    with pytest.raises(ValueError, match="atomic_dq: D=64"):
        gb.gluon_backward(q, q, k, v, q, torch.zeros(q.shape[:3]), AttentionParams(scale=0.1), atomic_dq=True)


def test_supports_refuses_broadcast_batch_or_heads(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = cpu_inputs(torch.bfloat16, dim=64, heads=(4, 1))
    k = k.expand(1, 2, 8, 64)
    reasons = " | ".join(gb.gluon_backward_supports(q, k, v.expand(1, 2, 8, 64), None, AttentionParams(scale=0.1)))
    assert "k, v broadcast (stride 0)" in reasons, reasons


def test_tma_strides_fix_only_dims_of_size_one():
    x = torch.empty(3, 5, 7, 64, dtype=torch.bfloat16)
    assert gf.tma_strides(x) == list(x.stride())
    odd = torch.empty(1, 7, 1, 64).as_strided((1, 1, 7, 64), (3, 5, 64, 1))  # any stride on size-1 dims
    assert gf.tma_strides(odd) == [448, 448, 64, 1]


def test_grads_stored_by_tma_only_into_our_own_tensors_for_short_sweeps():
    dk, dv = (torch.empty(2, 2, 300, 128, dtype=torch.bfloat16) for _ in range(2))
    by_tma = gb.grad_outputs(dk, dv, False, gb.TMA_GRADS_MAX_ROWS[128] - 1)
    assert by_tma[:4] == (None,) * 4
    assert [d.block_shape for d in by_tma[4:]] == [[1, 1, 64, 128]] * 2
    padded = torch.empty(2, 300, 2, 136, dtype=torch.bfloat16)[..., :128].transpose(1, 2)  # 272-byte rows
    unaligned = torch.empty(2, 2, 300, 129, dtype=torch.bfloat16)[..., 1:]
    accumulators = [torch.zeros(2, 2, 300, 128) for _ in range(2)]
    for grads, accumulate, rows in [((dk, dv), False, gb.TMA_GRADS_MAX_ROWS[128]), (accumulators, True, 64),
                                    ((dk, unaligned), False, 64)]:
        dk_out, dv_out, dk_strides, dv_strides, *descriptors = gb.grad_outputs(*grads, accumulate, rows)
        assert (dk_out, dv_out) == tuple(grads) and descriptors == [None, None]
        assert (dk_strides, dv_strides) == (grads[0].stride(), grads[1].stride())
    assert gb.grad_outputs(padded, padded, False, 64)[4] is not None  # 16-byte aligned rows
    d64 = [torch.empty(1, 1, 8, 64, dtype=torch.float16) for _ in range(2)]
    assert gb.grad_outputs(*d64, False, 10**9)[4] is not None  # no limit at d = 64


def ordered_everywhere(monkeypatch):
    """The ordered dQ for every length it fits (by default from Nq = 4096)."""
    monkeypatch.setattr(gb, "ORDERED_DQ_MIN_LEN", 1)


@pytest.mark.parametrize("causal,len_q,len_k,resident,fits", [
    (True, 4096, 4096, 132, True), (True, 16384, 16384, 132, True), (False, 16384, 16384, 132, True),
    (True, 4096, 4097, 132, False),  # causal Nk > Nq: the first key blocks would reach tile 0 together
    (True, 4000, 3000, 132, True),   # causal Nq > Nk
    (True, 32768, 32768, 132, False), (False, 16384, 16384, 127, False),  # a head's key blocks exceed the GPU
    (False, 300, 515, 132, True), (False, 100, 515, 132, False),  # 2 query tiles for 5 key blocks
    (False, 64, 64, 0, False),       # no CUDA device
])
def test_ordered_dq_serves_only_where_it_cannot_deadlock_or_serialize(causal, len_q, len_k, resident, fits,
                                                                      monkeypatch):
    monkeypatch.setattr(gb, "resident_programs", lambda device: resident)
    q, k = torch.empty(1, 4, len_q, 128), torch.empty(1, 2, len_k, 128)
    assert gb.ordered_dq_fits(q, k, causal) == fits
    measured = len_q >= 2048  # the lengths where it was measured against the dQ kernel
    assert gb.dq_path(q, k, causal, atomic_dq=False, accumulating=False) == (
        "ordered" if fits and measured else "kernel")
    q64, k64 = q[..., :64], k[..., :64]
    assert gb.dq_path(q64, k64, causal, atomic_dq=False, accumulating=False) == (
        "ordered" if fits and measured else "kernel")
    ordered_everywhere(monkeypatch)
    assert gb.dq_path(q, k, causal, atomic_dq=False, accumulating=False) == ("ordered" if fits else "kernel")
    assert gb.dq_path(q64, k64, causal, atomic_dq=False, accumulating=False) == ("ordered" if fits else "kernel")
    assert gb.dq_path(q, k, causal, atomic_dq=True, accumulating=False) == "atomic"
    assert gb.dq_path(q, k, causal, atomic_dq=False, accumulating=True) == "kernel"  # ring attention
    monkeypatch.setattr(gb.settings, "ordered_dq", False)
    assert gb.dq_path(q, k, causal, atomic_dq=False, accumulating=False) == "kernel"


def test_row_stats_pad_and_map_rows_with_no_key():
    """lse2 = lse * log2(e) (+inf for lse = -inf and in the padding), delta = rowsum(out * dout) (0 there);
    the ordered-dQ semaphores it is given are zeroed.
    Runs wherever Triton does: the interpreter on the CPU, the GPU otherwise."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(9)
    out = torch.randn(2, 77, 3, 64, device=device).transpose(1, 2).half()  # strided (B, N, H, D) memory
    dout = torch.randn(2, 3, 77, 64, device=device).half()
    lse = torch.randn(2, 3, 77, device=device)
    lse[0, 1, 5] = float("-inf")
    semaphores = torch.randint(1, 100, (6, 2), dtype=torch.int32, device=device)
    lse2, delta = gb.row_stats(lse, out, dout, 128, semaphores)
    assert lse2.shape == delta.shape == (6, 128)
    assert (semaphores == 0).all()
    expected = (lse * 1.4426950408889634).reshape(6, 77)
    expected[1, 5] = float("inf")
    torch.testing.assert_close(lse2[:, :77], expected)
    torch.testing.assert_close(delta[:, :77], (out.float() * dout.float()).sum(-1).reshape(6, 77), atol=1e-3, rtol=1e-4)
    assert (lse2[:, 77:] == float("inf")).all() and (delta[:, 77:] == 0).all()


def test_tiles_follow_the_measured_choices():
    """`tile_config` as the A/B on the H200 chose it (its comment)."""
    packed, cap, alibi, seg, prefix = (x.value for x in (gf.VARLEN, gf.SOFTCAP, gf.ALIBI, gf.SEGMENTS, gf.PREFIX))
    for bits in (packed, cap, alibi, seg | prefix, packed | cap, alibi | seg):
        assert gb.tile_config(bits, False, 128) is gb.CONFIGS[128]
    for bits in (cap | alibi, cap | seg, packed | cap | alibi):
        assert gb.tile_config(bits, False, 128) is gb.RULE_CONFIGS[128]
    assert gb.tile_config(cap, False, 64) is gb.RULE_CONFIGS[64] and gb.tile_config(prefix, False, 64) is gb.CONFIGS[64]
    assert gb.tile_config(0, True, 128) is gb.ATOMIC_CONFIGS[128]


def test_row_stats_place_packed_sequences_at_aligned_rows():
    """Packed: sequence b's rows from `stats_start` (a multiple of STATS_ALIGN past every earlier
    sequence), then +inf and 0 through the last 64-row tile a 1-D box of it can read (or the next
    sequence's first row). Runs wherever Triton does."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(10)
    lengths = [5, 0, 70, 1, 3]
    cu_q = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    total, heads = int(cu_q[-1]), 3
    out = torch.randn(total, heads, 64, device=device).half().transpose(0, 1)[None]  # (1, H, total, D) views
    dout = torch.randn(total, heads, 64, device=device).half().transpose(0, 1)[None]
    lse = torch.randn(heads, total, device=device)[None]
    lse[0, 2, 7] = float("-inf")
    packing = Packing(cu_q, cu_q, max(lengths), max(lengths))
    pad = gb.stats_rows(total, packing)
    lse2, delta = gb.row_stats(lse, out, dout, pad, None, packing)
    assert lse2.shape == delta.shape == (heads, pad)
    starts = [(int(cu_q[b]) // 4 + b) * 4 for b in range(len(lengths))]
    expected_delta = (out.float() * dout.float()).sum(-1)[0]
    for b, (start, length) in enumerate(zip(starts, lengths)):
        first = int(cu_q[b])
        expected = lse[0, :, first:first + length] * 1.4426950408889634
        expected[expected == float("-inf")] = float("inf")
        torch.testing.assert_close(lse2[:, start:start + length], expected)
        torch.testing.assert_close(delta[:, start:start + length], expected_delta[:, first:first + length],
                                   atol=1e-3, rtol=1e-4)
        if length:
            end = pad if b == len(lengths) - 1 else starts[b + 1]
            tail = slice(start + length, min(start + -(-length // 64) * 64, end))
            assert (lse2[:, tail] == float("inf")).all() and (delta[:, tail] == 0).all()
    assert starts == sorted(starts) and all(s % 4 == 0 for s in starts)
    assert all(starts[b] + lengths[b] <= starts[b + 1] for b in range(len(lengths) - 1))
    assert starts[-1] + 64 <= pad


def test_supports_refuses_lse_rows_beyond_32_bit_coordinates(monkeypatch):
    q = torch.empty(2**16, 2**8, 2**7, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2**16, 2**8, 2**7, 128, dtype=torch.bfloat16, device="meta")
    reasons = " | ".join(gb.gluon_backward_supports(q, k, k, None, AttentionParams(scale=0.1)))
    assert "exceeds 2147483647" in reasons, reasons


@pytest.mark.parametrize("interpret,words", [("0", "CUDA"), ("1", "TRITON_INTERPRET")])
def test_backward_refuses_cpu_inputs_naming_the_device(interpret, words, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    q, k, v = cpu_inputs()
    params = AttentionParams(scale=0.125, window=(-1, 0))
    reasons = gb.gluon_backward_supports(q, k, v, None, params, q)
    assert len(reasons) == 1 and words in reasons[0], reasons
    lse = torch.zeros(q.shape[:3])
    with pytest.raises(ValueError, match=words):
        gb.gluon_backward(q, q, k, v, q, lse, params)


def test_checked_entry_points_pass_everything_to_the_launch(monkeypatch):
    """run_gluon_forward / run_gluon_backward (the dispatch's entry, after its own support check)."""
    q, k, v = cpu_inputs()
    params = AttentionParams(scale=0.125, window=(-1, 0))
    seen = {}
    monkeypatch.setattr(gf, "launch", lambda *args: seen.setdefault("forward", args))
    monkeypatch.setattr(gb, "launch", lambda *args: seen.setdefault("backward", args))
    lse = torch.zeros(q.shape[:3])
    sums = tuple(torch.zeros(x.shape) for x in (q, k, v))
    rules, packing = object(), object()
    gf.run_gluon_forward(q, k, v, params, rules, packing)
    gb.run_gluon_backward(q, q, k, v, q, lse, params, sums, True)
    assert seen["forward"] == (q, k, v, params, rules, packing)
    assert seen["backward"][:7] == (q, q, k, v, q, lse, params) and seen["backward"][8] is True
    assert all(a is b for a, b in zip(seen["backward"][7], sums))
    with pytest.raises(ValueError, match="float32"):
        gb.run_gluon_backward(q, q, k, v, q, lse, params, tuple(x.clone() for x in (q, k, v)))


class PoisonedTorch:
    """torch for `gluon_backward`'s module, except that torch.empty returns NaN (floating) or -7
    (integer) filled tensors: whatever a kernel is meant to write but does not shows up."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        t = torch.empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -7)

    @classmethod
    def empty_like(cls, x, **kwargs):
        return cls.empty(x.shape, dtype=kwargs.get("dtype", x.dtype), device=kwargs.get("device", x.device))


class FakeKernel:
    """Stands in for a Gluon kernel on the CPU: records each launch's arguments and lets `effect`
    write what the kernel would."""

    def __init__(self, effect=lambda args: None):
        self.launches = []
        self.grids = []
        self.effect = effect

    def __getitem__(self, grid):
        def run(*args, **options):
            self.launches.append(args)
            self.grids.append(tuple(grid))
            self.options = options
            self.effect(args)
        return run


# argument positions (`dkdv_arguments`, `dq_arguments`)
DKDV_DQ_DESC, DKDV_SEM = (gb.gluon_dkdv_kernel.arg_names.index(name) for name in ("dq_desc", "SEM"))
DQ_OUT = gb.gluon_dq_kernel.arg_names.index("DQ")


@pytest.mark.parametrize("rotated", [True, False])
def test_rotated_sweeps_only_for_ordered_full_attention(rotated, monkeypatch):
    monkeypatch.setattr(gb.settings, "rotated_dq_order", rotated)
    assert gb.rotated_sweeps("ordered", False, 16384, 128) == rotated
    assert gb.rotated_sweeps("ordered", False, 4096, 64) == rotated
    assert not gb.rotated_sweeps("ordered", True, 4096, 128)
    assert not gb.rotated_sweeps("atomic", False, 4096, 128) and not gb.rotated_sweeps("kernel", False, 4096, 128)


def test_rotated_sweeps_by_default_below_the_measured_lengths(monkeypatch):
    monkeypatch.setattr(gb, "UNROTATED_MIN_LEN", {128: 8192})
    assert gb.settings.rotated_dq_order is None
    assert gb.rotated_sweeps("ordered", False, 8191, 128) and not gb.rotated_sweeps("ordered", False, 8192, 128)
    assert gb.rotated_sweeps("ordered", False, 65536, 64)
    assert not gb.rotated_sweeps("ordered", True, 2048, 128)


@pytest.mark.parametrize("path,causal,zero_rows", [("ordered", True, 70), ("ordered", False, 0), ("atomic", True, 300)])
def test_dq_accumulators_zero_only_what_no_key_block_writes(path, causal, zero_rows, monkeypatch):
    """Ordered dQ stores each tile's first contribution: of its float32 dQ only the rows that see
    no key (causal, Nq > Nk) are zeroed, and its semaphores are left for `row_stats` to zero;
    atomic dQ adds every contribution into zeros."""
    monkeypatch.setattr(gb, "torch", PoisonedTorch())
    q, k = torch.randn(2, 4, 300, 64), torch.randn(2, 2, 230, 64)
    dq_sum, semaphores = gb.dq_accumulators(path, q, k, torch.empty_like(q), causal, False, 5)
    assert dq_sum.shape == q.shape and dq_sum.dtype == torch.float32
    assert (dq_sum[:, :, :zero_rows] == 0).all() and dq_sum[:, :, zero_rows:].isnan().all()
    if path == "ordered":
        assert semaphores.shape == (8, 5) and semaphores.dtype == torch.int32 and (semaphores == -7).all()
    else:
        assert semaphores is None


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("atomic_dq,ordered_dq,accumulate,path", [
    (False, False, False, "kernel"), (False, True, False, "ordered"), (True, False, False, "atomic"),
    (True, False, True, "atomic"), (False, True, True, "kernel"),
])
def test_launch_forms_dq_the_way_dq_path_says(causal, atomic_dq, ordered_dq, accumulate, path, monkeypatch):
    """The host side of `launch` (Triton's interpreter runs `row_stats`): which kernels run, what
    the dK/dV kernel adds dQ into, its semaphores, and how dQ reaches the caller."""
    ordered_everywhere(monkeypatch)
    monkeypatch.setattr(gb, "resident_programs", lambda device: 132)
    monkeypatch.setattr(gb.settings, "ordered_dq", ordered_dq)
    added = 1.5  # what the fake dK/dV kernel adds to dQ (ordered: stores, as each tile's first contribution)

    def add_dq(args):
        if args[DKDV_DQ_DESC] is not None:
            dq_sum = args[DKDV_DQ_DESC].base
            dq_sum.fill_(added) if args[DKDV_SEM] is not None else dq_sum.add_(added)

    dkdv = FakeKernel(add_dq)
    dq_kernel = FakeKernel(lambda args: args[DQ_OUT].fill_(3.0))
    monkeypatch.setattr(gb, "gluon_dkdv_kernel", dkdv)
    monkeypatch.setattr(gb, "gluon_dq_kernel", dq_kernel)
    q, k, v = cpu_inputs(torch.float16, dim=128, heads=(4, 2))
    params = params_for(128, causal)
    lse = torch.zeros(q.shape[:3])
    start = tuple(torch.full(x.shape, 0.25) for x in (q, k, v)) if accumulate else None
    assert gb.dq_path(q, k, causal, atomic_dq, accumulate) == path
    dq, _, _ = gb.launch(q, q, k, v, q, lse, params, tuple(x.clone() for x in start) if accumulate else None,
                         atomic_dq)
    (args,) = dkdv.launches
    semaphores = args[DKDV_SEM]
    if path == "ordered":
        assert semaphores.dtype == torch.int32 and semaphores.shape == (4, 1) and not semaphores.any()
    else:
        assert semaphores is None
    assert dkdv.options["ROTATE"] == (path == "ordered" and not causal)
    assert len(dq_kernel.launches) == (path == "kernel")
    assert (args[DKDV_DQ_DESC] is None) == (path == "kernel")
    expected = 3.0 if path == "kernel" else added + (0.25 if accumulate else 0.0)
    assert dq.dtype == (torch.float32 if accumulate else q.dtype)
    assert torch.equal(dq, torch.full(q.shape, expected, dtype=dq.dtype))


def fake_kernels(monkeypatch) -> tuple[FakeKernel, FakeKernel]:
    dkdv, dq_kernel = FakeKernel(), FakeKernel()
    monkeypatch.setattr(gb, "gluon_dkdv_kernel", dkdv)
    monkeypatch.setattr(gb, "gluon_dq_kernel", dq_kernel)
    return dkdv, dq_kernel


def argument(kernel: FakeKernel, real, name: str):
    """The argument `name` of the kernel's one launch (`real`: the Gluon kernel, for its argument names)."""
    (args,) = kernel.launches
    return args[real.arg_names.index(name)]


def test_launch_hands_rules_to_both_kernels_with_the_key_blocks_segment_tables(monkeypatch):
    """Rules take the dQ kernel (also where ordered dQ would serve), both kernels get RULES, and the dK/dV
    kernel gets each 128-key block's query tiles, and those holding its one id alone (the ids never
    decrease: exact against a direct count)."""
    from exattn.problem import ScoreRules

    ordered_everywhere(monkeypatch)
    monkeypatch.setattr(gb, "resident_programs", lambda device: 132)
    real_dkdv = gb.gluon_dkdv_kernel
    dkdv, dq_kernel = fake_kernels(monkeypatch)
    n, block_m = 300, gb.RULE_CONFIGS[128].dkdv_block_m
    q, k, v = (torch.randn(1, heads, n, 128).half() for heads in (4, 2, 2))
    ids = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), torch.tensor([100, 150, 50]))[None]
    params = AttentionParams(scale=0.1, window=(-1, 0), softcap=5.0)
    gb.launch(q, q, k, v, q, torch.zeros(1, 4, n), params, None, False, ScoreRules(ids, ids))
    bits = gf.SOFTCAP.value | gf.SEGMENTS.value
    assert dkdv.options["RULES"] == dq_kernel.options["RULES"] == bits and not dkdv.options["ROTATE"]
    assert argument(dkdv, real_dkdv, "dq_desc") is None and len(dq_kernel.launches) == 1
    tiles = argument(dkdv, real_dkdv, "QUERY_TILES")[0]

    def id_set(first, count):
        return set(ids[0, first:first + count].tolist())

    for block in range(gf.ceil_div(n, 128)):
        query_tiles = range(gf.ceil_div(n, block_m))
        meets = [t for t in query_tiles if id_set(t * block_m, block_m) & id_set(block * 128, 128)]
        keys = id_set(block * 128, 128)
        alone = [t for t in query_tiles if len(keys) == 1 and id_set(t * block_m, block_m) == keys]
        full = [alone[0], alone[-1] + 1] if alone else [min(meets)] * 2
        assert tiles[block].tolist() == [min(meets), max(meets) + 1, *full]


def test_packed_backward_stores_dk_dv_from_registers_into_packed_gradients(monkeypatch):
    """Packing: the kernels see (1, H, total, d) views of the packed gradients they return, dK and dV by
    pointer (a TMA box would reach the next sequence), grids sized by the batch and the longest sequences."""
    from exattn.backends.triton.passes import Packing

    real_dkdv, real_dq = gb.gluon_dkdv_kernel, gb.gluon_dq_kernel
    dkdv, dq_kernel = fake_kernels(monkeypatch)
    lengths = [300, 0, 17, 200]
    cu = torch.tensor([0, 300, 300, 317, 517], dtype=torch.int32)
    q, k, v = (torch.randn(517, heads, 64).half() for heads in (4, 2, 2))
    params = AttentionParams(scale=0.1, window=(-1, 0))
    dq, dk, dv = gb.run_gluon_backward(q, q, k, v, q, torch.zeros(4, 517), params, None, False, None,
                                       Packing(cu, cu, max(lengths), max(lengths)))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dkdv.options["RULES"] == dq_kernel.options["RULES"] == gf.VARLEN.value
    assert argument(dkdv, real_dkdv, "dk_desc") is None
    for grad, kernel, real, name in ((dk, dkdv, real_dkdv, "DK"), (dv, dkdv, real_dkdv, "DV"),
                                     (dq, dq_kernel, real_dq, "DQ")):
        view = argument(kernel, real, name)
        assert view.shape == (1, grad.shape[1], grad.shape[0], 64) and view.data_ptr() == grad.data_ptr()
    assert dkdv.grids == [(gf.ceil_div(300, 128) * 4 * 2,)] and dq_kernel.grids == [(gf.ceil_div(300, 128) * 4 * 4,)]


@pytest.mark.parametrize("packed,accumulate", [(False, False), (True, False), (False, True)])
def test_row_statistics_live_in_the_bytes_of_dq(packed, accumulate, monkeypatch):
    """`row_stats` (Triton's interpreter runs it) writes lse * log2 e and delta into dq's first bytes when the
    backward makes dq (else into a buffer of their own): the dK/dV kernel, their only reader, sees them
    whole, and the dQ kernel, which writes dq after it, gets the forward's lse and out instead."""
    from exattn.backends.triton.passes import Packing

    monkeypatch.setattr(gb.settings, "ordered_dq", False)
    real_dkdv, real_dq = gb.gluon_dkdv_kernel, gb.gluon_dq_kernel
    seen = {}

    def read_stats(args):
        for name in ("lse_desc", "delta_desc"):
            stats = args[real_dkdv.arg_names.index(name)].base
            seen[name] = (stats.clone(), stats.untyped_storage().data_ptr())

    dkdv, dq_kernel = FakeKernel(read_stats), FakeKernel(lambda args: args[DQ_OUT].fill_(3.0))
    monkeypatch.setattr(gb, "gluon_dkdv_kernel", dkdv)
    monkeypatch.setattr(gb, "gluon_dq_kernel", dq_kernel)
    torch.manual_seed(3)
    params = AttentionParams(scale=0.1, window=(-1, 0))
    if packed:
        cu = torch.tensor([0, 70, 70, 131], dtype=torch.int32)
        q, k, v, out, dout = (torch.randn(131, heads, 64).half() for heads in (4, 2, 2, 4, 4))
        lse = torch.randn(4, 131)
        dq, _, _ = gb.run_gluon_backward(dout, q, k, v, out, lse, params, None, False, None, Packing(cu, cu, 70, 70))
    else:
        q, k, v, out, dout = (torch.randn(2, heads, 70, 64).half() for heads in (4, 2, 2, 4, 4))
        lse = torch.randn(2, 4, 70)
        start = tuple(torch.zeros(x.shape) for x in (q, k, v)) if accumulate else None
        dq, _, _ = gb.launch(dout, q, k, v, out, lse, params, start, False)
    lse2, lse2_storage = seen["lse_desc"]
    delta, delta_storage = seen["delta_desc"]
    assert (lse2_storage == dq.data_ptr()) == (delta_storage == dq.data_ptr()) == (not accumulate)
    lse_arg, out_arg = (argument(dq_kernel, real_dq, name) for name in ("LSE", "O"))
    assert lse_arg.data_ptr() == lse.data_ptr() and out_arg.data_ptr() == out.data_ptr()
    assert torch.equal(dq, torch.full_like(dq, 3.0))
    expected = (out.float() * dout.float()).sum(-1)
    if packed:
        for b, (first, last) in ((0, (0, 70)), (2, (70, 131))):
            at = (first // gb.STATS_ALIGN.value + b) * gb.STATS_ALIGN.value  # `stats_start`
            for h in range(4):
                torch.testing.assert_close(delta[h, at:at + last - first], expected[first:last, h])
                torch.testing.assert_close(lse2[h, at:at + last - first], lse[h, first:last] * gb.LOG2E)
    else:
        torch.testing.assert_close(delta.view(2, 4, -1)[..., :70], expected)
        torch.testing.assert_close(lse2.view(2, 4, -1)[..., :70], lse * gb.LOG2E)


# ---------------------------------------------------------------- GPU

def params_for(d, causal):
    return AttentionParams(scale=d ** -0.5, window=(-1, 0) if causal else (-1, -1))


def saved_forward(q, k, v, params):
    from exattn.backends.triton import triton_forward

    return triton_forward(q, k, v, None, params)


def oracle_grads(q, k, v, dout, causal, backend=None):
    """(dq, dk, dv): float64 oracle, or `backend` in the inputs' dtype."""
    if backend is None:
        inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
        out = attention_ref(*inputs, causal=causal)
        return torch.autograd.grad(out, inputs, dout.double())
    inputs = [x.detach().requires_grad_() for x in (q, k, v)]
    out = exattn.attention(*inputs, causal=causal, backend=backend)
    return torch.autograd.grad(out, inputs, dout)


def check(q, k, v, dout, causal, atomic_dq=False, path=None):
    """The Gluon backward against the oracle; path: how dQ must be formed (`gluon_backward.dq_path`)."""
    params = params_for(q.shape[-1], causal)
    assert gb.gluon_backward_supports(q, k, v, None, params, dout, atomic_dq) == []
    if path is not None:
        assert gb.dq_path(q, k, causal, atomic_dq, accumulating=False) == path
    out, lse = saved_forward(q, k, v, params)
    grads = gb.gluon_backward(dout, q, k, v, out, lse, params, atomic_dq=atomic_dq)
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
    naive = oracle_grads(q, k, v, dout, causal, "naive")
    ref = oracle_grads(q, k, v, dout, causal)
    for name, ours, base, r in zip(("dq", "dk", "dv"), grads, naive, ref):
        assert_matches_oracle(name, ours, base, r, q.dtype)
    return grads, (out, lse, params)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_oracle(dtype, d, causal, shape, monkeypatch):
    monkeypatch.setattr(gb.settings, "ordered_dq", False)  # the dQ kernel (ring attention, unfit shapes)
    torch.manual_seed(hash((d, causal) + shape) % 2**31)
    check(*gpu_inputs(*shape, d, dtype, with_dout=True), causal, path="kernel")


# Shapes the ordered dQ serves (`ordered_dq_fits`): causal with Nk <= Nq, full attention with a
# 64-row query tile per 128-key block; the last one (Nk > Nq) only for full attention: causal it
# takes the dQ kernel (test_matches_oracle).
ORDERED_SHAPES = [(2, 3, 3, 1, 1), (1, 2, 2, 64, 64), (2, 4, 2, 333, 270), (1, 6, 2, 700, 700),
                  (2, 2, 1, 1100, 999), (1, 2, 1, 2048, 2048), (2, 4, 2, 333, 515)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,shape", [(causal, shape) for causal in (False, True) for shape in ORDERED_SHAPES
                                           if not (causal and shape[4] > shape[3])],
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_ordered_dq_matches_oracle(dtype, d, causal, shape, monkeypatch):
    ordered_everywhere(monkeypatch)
    torch.manual_seed(hash((d, causal, 9) + shape) % 2**31)
    check(*gpu_inputs(*shape, d, dtype, layout="bnhd", with_dout=True), causal, path="ordered")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tma_grads", [False, True])
@pytest.mark.parametrize("path", ["kernel", "ordered"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_both_grad_stores_match_oracle(d, causal, path, tma_grads, monkeypatch):
    """dK and dV stored by TMA through the K and V tiles (rows past Nk clipped) or from registers."""
    monkeypatch.setitem(gb.TMA_GRADS_MAX_ROWS, d, 10**9 if tma_grads else 0)
    monkeypatch.setattr(gb, "ORDERED_DQ_MIN_LEN", 1 if path == "ordered" else 10**9)
    stored = []
    real = gb.grad_outputs
    monkeypatch.setattr(gb, "grad_outputs", lambda *args: stored.append(real(*args)) or stored[-1])
    torch.manual_seed(hash((d, causal, path, tma_grads)) % 2**31)
    check(*gpu_inputs(2, 4, 2, 333, 270, d, torch.bfloat16, with_dout=True), causal, path=path)
    assert [descriptors[4] is not None for descriptors in stored] == [tma_grads]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("shape", [*ORDERED_SHAPES, (2, 8, 2, 4096, 4096), (4, 8, 8, 600, 600)],
                         ids=lambda s: "x".join(map(str, s)))
def test_unrotated_ordered_dq_matches_oracle_and_reruns_bitwise(d, shape, monkeypatch):
    """`settings.rotated_dq_order` off (full attention): every key block sweeps from tile 0 and
    the blocks add in key-block order, heads spanning two waves of programs included."""
    ordered_everywhere(monkeypatch)
    monkeypatch.setattr(gb.settings, "rotated_dq_order", False)
    torch.manual_seed(hash((d, 13) + shape) % 2**31)
    assert_reruns_bitwise_equal(*gpu_inputs(*shape, d, torch.bfloat16, with_dout=True), False, reruns=2,
                                path="ordered")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_ordered_dq_reruns_are_bitwise_equal_with_many_contributors(d, causal, monkeypatch):
    ordered_everywhere(monkeypatch)
    torch.manual_seed(10)
    assert_reruns_bitwise_equal(*gpu_inputs(2, 8, 2, 4096, 4096, d, torch.bfloat16, with_dout=True), causal,
                                reruns=4, path="ordered")


# Causal rules under which the key blocks that reach a query tile stay one run (`dq_in_dkdv_serves`):
# keywords of exattn.attention (a prefix per batch entry, none in one, longer than Nk in another).
ORDERED_RULES = {"window 1000": dict(window=(1000, 0)), "window 130": dict(window=(130, 0)),
                 "window 0": dict(window=(0, 0)), "prefix": dict(causal=True, prefix=(700, 0)),
                 "long prefix": dict(causal=True, prefix=(3000, 130)),
                 "window prefix": dict(window=(300, 0), prefix=(700, 0)),
                 "documents": dict(causal=True, documents=7), "unsorted documents": dict(causal=True, documents=5,
                                                                                        shuffled=True),
                 "documents window prefix": dict(window=(500, 0), prefix=(200, 0), documents=4)}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("rule", ORDERED_RULES)
def test_ordered_dq_under_causal_rules_matches_oracle_and_reruns_bitwise(d, rule, monkeypatch):
    """Each query tile hears from the key blocks that reach it, from the last down (`later_sweeps`): no dQ
    kernel, gradients within the oracle rule, reruns bitwise equal; Nq > Nk leaves rows that see only
    the prefix."""
    from test_triton_score_rules import document_ids

    from exattn.backends.triton import triton_forward
    from exattn.problem import ScoreRules

    ordered_everywhere(monkeypatch)
    kernels = []
    real = gb.run_kernel
    monkeypatch.setattr(gb, "run_kernel", lambda kernel, *args, **kw: kernels.append(kernel) or real(kernel, *args, **kw))
    torch.manual_seed(14 + len(rule))
    q, k, v, dout = gpu_inputs(2, 8, 2, 2100, 2000, d, torch.bfloat16, with_dout=True)
    kwargs = dict(ORDERED_RULES[rule])
    if "prefix" in kwargs:
        kwargs["prefix"] = torch.tensor(kwargs["prefix"], dtype=torch.int32, device=q.device)
    documents, shuffled = kwargs.pop("documents", None), kwargs.pop("shuffled", False)
    if documents is not None:
        kwargs["segment_ids"] = tuple(x.cuda() for x in document_ids(q, k, documents, shuffled))
    params = AttentionParams(scale=d ** -0.5, window=kwargs.get("window", (-1, 0)))
    q_ids, k_ids = kwargs.get("segment_ids", (None, None))
    rules = ScoreRules(q_ids, k_ids, kwargs.get("prefix"))
    out, lse = triton_forward(q, k, v, None, params, rules)
    grads = gb.gluon_backward(dout, q, k, v, out, lse, params, rules=rules)
    assert gb.gluon_dq_kernel not in kernels and gb.gluon_dkdv_kernel in kernels
    inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = torch.autograd.grad(attention_ref(*inputs, **kwargs), inputs, dout.double())
    inputs = [x.detach().requires_grad_() for x in (q, k, v)]
    naive = torch.autograd.grad(exattn.attention(*inputs, **kwargs, backend="naive"), inputs, dout)
    for name, ours, base, r in zip(("dq", "dk", "dv"), grads, naive, ref):
        assert_matches_oracle(name, ours, base, r, q.dtype)
    for _ in range(3):
        for a, b in zip(grads, gb.gluon_backward(dout, q, k, v, out, lse, params, rules=rules)):
            assert torch.equal(a, b)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("d", [64, 128])
def test_ordered_dq_caps_causal_head_groups_to_resident_programs(d, monkeypatch):
    ordered_everywhere(monkeypatch)
    monkeypatch.setattr(gb.schedule, "heads_per_group", forced_heads_per_group(6))
    monkeypatch.setattr(gb, "resident_programs", lambda device: 13)  # 6 key blocks per head: groups of 2
    sizes = []
    real = gb.schedule.resident_heads_per_group
    monkeypatch.setattr(gb.schedule, "resident_heads_per_group", lambda *args: sizes.append(real(*args)) or sizes[-1])
    torch.manual_seed(11)
    check(*gpu_inputs(2, 6, 3, 700, 700, d, torch.float16, with_dout=True), True, path="ordered")
    assert sizes == [2]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("resident,shape",
                         [(7, (2, 4, 2, 333, 515)), (7, (3, 2, 2, 640, 600)), (None, (4, 8, 8, 600, 600))],
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_ordered_dq_where_heads_span_two_waves(d, resident, shape, monkeypatch):
    """Full attention, a head's key blocks launched in different waves of resident programs (5 per
    head; 7 resident as far as `gluon_backward` knows, or the GPU's SMs): the early blocks wait for
    the late ones and nothing deadlocks; reruns stay bitwise equal."""
    ordered_everywhere(monkeypatch)
    if resident is not None:
        monkeypatch.setattr(gb, "resident_programs", lambda device: resident)
    torch.manual_seed(12)
    assert_reruns_bitwise_equal(*gpu_inputs(*shape, d, torch.bfloat16, with_dout=True), False, reruns=3,
                                path="ordered")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config_id", list(CANDIDATES))
@pytest.mark.parametrize("shape", [(2, 4, 1, 1, 300), (1, 6, 2, 77, 211), (2, 2, 1, 257, 129), (1, 2, 2, 1100, 999)],
                         ids=lambda s: "x".join(map(str, s)))
def test_candidate_configs_match_oracle(dtype, causal, config_id, shape, monkeypatch):
    monkeypatch.setitem(gb.CONFIGS, 64, CANDIDATES[config_id])
    monkeypatch.setattr(gb.settings, "ordered_dq", False)  # the dQ kernel, whose tiles these are
    torch.manual_seed(hash((causal,) + shape) % 2**31)
    check(*gpu_inputs(*shape, 64, dtype, layout="bnhd", with_dout=True), causal)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("path", ["kernel", "ordered"])
def test_rows_with_no_key_get_zero_gradients(d, path, monkeypatch):
    """Also with every buffer from torch.empty poisoned: ordered dQ stores each tile's first
    contribution instead of adding to zeros, and zeroes only the rows no key block reaches."""
    monkeypatch.setattr(gb.settings, "ordered_dq", path == "ordered")
    ordered_everywhere(monkeypatch)
    monkeypatch.setattr(gb, "torch", PoisonedTorch())
    torch.manual_seed(3)
    (dq, dk, dv), _ = check(*gpu_inputs(1, 2, 2, 300, 70, d, torch.bfloat16, with_dout=True), causal=True,
                            path=path)
    empty = 300 - 70  # rows i with i + Nk - Nq < 0
    assert (dq[:, :, :empty] == 0).all()
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_huge_logits_and_strided_inputs(dtype, causal, d):
    torch.manual_seed(4)
    check(*gpu_inputs(2, 4, 2, 333, 515, d, dtype, layout="bnhd", logit_scale=60.0, with_dout=True), causal)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence_many_ring_rounds(causal):
    torch.manual_seed(5)
    check(*gpu_inputs(1, 4, 1, 2048, 4100, 128, torch.bfloat16, with_dout=True), causal)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_reruns_are_bitwise_equal(d, causal):
    torch.manual_seed(6)
    assert_reruns_bitwise_equal(*gpu_inputs(2, 8, 2, 1111, 999, d, torch.bfloat16, with_dout=True), causal, reruns=3)


def assert_reruns_bitwise_equal(q, k, v, dout, causal, reruns, path=None):
    """`check` against the oracle, then `reruns` more backward passes with bitwise-equal gradients."""
    (first, (out, lse, params)) = check(q, k, v, dout, causal, path=path)
    for _ in range(reruns):
        again = gb.gluon_backward(dout, q, k, v, out, lse, params)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("shape", [*SHAPES, (2, 4, 2, 333, 515), (1, 4, 1, 2048, 4100)],
                         ids=lambda s: "x".join(map(str, s)))
def test_atomic_dq_matches_oracle(dtype, causal, d, shape):
    torch.manual_seed(hash((causal, d) + shape) % 2**31)
    check(*gpu_inputs(*shape, d, dtype, layout="bnhd", with_dout=True), causal, atomic_dq=True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,atomic_dq", [(64, False), (128, False), (64, True), (128, True)])
@pytest.mark.parametrize("dq_layout", ["bnhd", "bhnd"])
def test_accumulate_into_adds_to_strided_float32(causal, d, atomic_dq, dq_layout):
    torch.manual_seed(7)
    q, k, v, dout = gpu_inputs(2, 4, 2, 333, 270, d, torch.bfloat16, with_dout=True)
    params = params_for(d, causal)
    out, lse = saved_forward(q, k, v, params)
    start = [torch.randn(x.shape[0], x.shape[2], x.shape[1], d, device="cuda").transpose(1, 2)
             for x in (q, k, v)]  # float32 views with (B, N, H, D) memory order
    if dq_layout == "bhnd":  # atomic_dq: reduced into in place (TMA-compatible) rather than added after
        start[0] = torch.randn(q.shape, device="cuda")
    acc = [x.clone() for x in start]
    returned = gb.gluon_backward(dout, q, k, v, out, lse, params, accumulate_into=tuple(acc), atomic_dq=atomic_dq)
    assert all(r is a for r, a in zip(returned, acc))
    naive = oracle_grads(q, k, v, dout, causal, "naive")
    ref = oracle_grads(q, k, v, dout, causal)
    for name, a, s, base, r in zip(("dq", "dk", "dv"), acc, start, naive, ref):
        assert_matches_oracle(name, a - s, base, r, q.dtype)
    plain = gb.gluon_backward(dout, q, k, v, out, lse, params)
    for a, s, p in zip(acc, start, plain):  # the same tiles, added: equal up to the final rounding
        torch.testing.assert_close(a - s, p.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@needs_cuda
def test_backward_refuses_bad_dout_strides():
    q, k, v, dout = gpu_inputs(1, 2, 2, 64, 64, 128, torch.bfloat16, with_dout=True)
    params = params_for(128, False)
    odd = torch.randn(1, 2, 64, 129, device="cuda").to(torch.bfloat16)[..., 1:]  # misaligned base
    with pytest.raises(ValueError, match="dout"):
        gb.gluon_backward(odd, q, k, v, dout, torch.zeros(1, 2, 64, device="cuda"), params)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("atomic_dq", [False, True])
def test_triton_backend_dispatches_backward_to_gluon(causal, d, atomic_dq, monkeypatch):
    from exattn.backends import triton as backend
    from exattn.backends.triton import settings

    if d in backend.GLUON_BACKWARD_MIN_LEN:
        monkeypatch.setitem(backend.GLUON_BACKWARD_MIN_LEN, d, 333)  # this test's query length
    monkeypatch.setattr(settings, "atomic_dq", atomic_dq)
    calls = []
    real = gb.run_gluon_backward

    def spy(*args):
        calls.append(args[8])  # atomic_dq as the dispatch passed it
        return real(*args)
    monkeypatch.setattr(gb, "run_gluon_backward", spy)
    torch.manual_seed(8)
    q, k, v, dout = (x.requires_grad_() for x in gpu_inputs(2, 4, 2, 333, 515, d, torch.bfloat16, with_dout=True))
    dout = dout.detach()
    out = exattn.attention(q, k, v, causal=causal, backend="triton")
    grads = torch.autograd.grad(out, (q, k, v), dout)
    expected = int(d in backend.GLUON_BACKWARD_HEAD_DIMS)
    assert len(calls) == expected
    assert calls == [atomic_dq and d in gb.ATOMIC_CONFIGS] * expected
    naive = oracle_grads(q, k, v, dout, causal, "naive")
    ref = oracle_grads(q, k, v, dout, causal)
    for name, ours, base, r in zip(("dq", "dk", "dv"), grads, naive, ref):
        assert_matches_oracle(name, ours, base, r, q.dtype)
    monkeypatch.setattr(settings, "use_gluon", False)
    out = exattn.attention(q, k, v, causal=causal, backend="triton")
    torch.autograd.grad(out, (q, k, v), dout)
    assert len(calls) == expected  # switched off: the Triton backward kernels


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("size", [2, 3, 6])
@pytest.mark.parametrize("atomic_dq", [False, True])
@pytest.mark.parametrize("shape", [(2, 6, 3, 700, 700), (1, 6, 2, 900, 257)], ids=lambda s: "x".join(map(str, s)))
def test_causal_head_groups_match_oracle(d, size, atomic_dq, shape, monkeypatch):
    monkeypatch.setattr(gb.schedule, "heads_per_group", forced_heads_per_group(size))
    torch.manual_seed(hash((d, size) + shape) % 2**31)
    check(*gpu_inputs(*shape, d, torch.float16, with_dout=True), True, atomic_dq)
