"""Host side of the Triton kernels: the raw forward and backward passes (no autograd).

    triton_forward(q, k, v, mask, params) -> (out, lse)
    triton_backward(dout, q, k, v, mask, out, lse, params, accumulate_into=None) -> (dq, dk, dv)

Inputs may have any strides (they are passed to the kernels, never copied);
`mask` is None or a view broadcast to (B, Hq, Nq, Nk), zero strides allowed.
lse is natural log, float32, (B, Hq, Nq). Grids are one-dimensional
(tiles x batch x heads), far inside CUDA's 2**31 - 1 limit on that axis.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton

from ...masks import lse_without_keys
from ...problem import UNBOUNDED, AttentionParams, check_accumulators
from . import replay_key, replays
from .backward_kernel import attention_delta_kernel, attention_dkdv_kernel, attention_dq_kernel
from .configs import TileConfig, capability_of, ceil_div, choose_config, interpreting, padded_dim, tma_compatible
from .forward_kernel import attention_forward_kernel
from .replay import replayable, run_kernel
from .segment_tables import segment_tile_ranges

LOG2E = 1.4426950408889634
MAX_GRID = 2**31 - 1


def env_flag(name: str, default: bool | None = None) -> bool | None:
    """The environment variable `name` as a flag: "1" True, "0" False, unset `default`."""
    value = os.environ.get(name)
    if value is None:
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name}: got {value!r}, expected '0' or '1' (or unset)")
    return value == "1"


@dataclass
class TritonSettings:
    """Non-default knobs of the Triton backend (module-level, see `settings`).

    atomic_dq: the dK/dV kernel also accumulates dQ in float32 by atomics and
        the dQ kernel is skipped: 5 matmuls per tile instead of 7, but gradients
        are no longer bitwise reproducible. Where the Gluon backward serves (head
        dims 64 and 128 from Nq = 512) it adds dQ tiles by TMA reductions
        (0.93-1.12x cuDNN at 1k-2k and 1.02-1.09x from 4k on the H200); elsewhere
        the Triton kernels use element atomics, slower than their deterministic
        default (docs/triton.md, docs/performance.md).
        Env: EXATTN_TRITON_ATOMIC_DQ=1.
    ordered_dq: in the deterministic Gluon backward (d = 64 and 128 from Nq = 512), the
        dK/dV kernel adds dQ itself by TMA reductions (a writer warp), each dQ
        tile's contributions in a fixed order (a semaphore per tile), where one
        head's key blocks fit on the GPU at once and the lengths allow
        (`gluon_backward.ordered_dq_fits`; not with `accumulate_into`):
        1.02-1.09x the dK/dV + dQ kernel pair it replaces, which serves
        everywhere else (and everywhere with it off). Bitwise reproducible
        either way. Env: EXATTN_TRITON_ORDERED_DQ=0 turns it off.
    rotated_dq_order: ordered dQ under full attention: True, each key block starts its sweep
        at its own query tile (spread over the tiles) and the blocks add into a tile in the
        order their sweeps reach it; False, every block sweeps from the first tile and the
        blocks add in key-block order; None (the default), False where it measured faster
        (`gluon_backward.UNROTATED_MIN_LEN`: d = 128 from Nq = 8192, 1.01-1.04x), else True.
        Bitwise reproducible either way. Env: EXATTN_TRITON_ROTATED_DQ_ORDER=1 or 0 (unset: None).
    use_tma: load tiles through TMA tensor descriptors where the strides allow
        (Hopper and newer, and the interpreter). Env: EXATTN_TRITON_TMA=0 turns it off.
    replay: replay each pass's kernel launches for a signature (shapes, strides, dtypes, alignment,
        parameters) seen before, skipping the host-side planning and Triton's JIT front end
        (`replay.py`). Env: EXATTN_TRITON_REPLAY=0 turns it off.
    use_gluon: on sm_90 run the forward and backward through the Gluon kernels
        (warp-specialized) at the head dims and lengths of GLUON_FORWARD_MIN_LEN and
        GLUON_BACKWARD_MIN_LEN, and the decode launches `plan_launch` marks `gluon`,
        where they serve the inputs. Env: EXATTN_TRITON_GLUON=0 turns it off.
    """

    atomic_dq: bool = env_flag("EXATTN_TRITON_ATOMIC_DQ", False)
    ordered_dq: bool = env_flag("EXATTN_TRITON_ORDERED_DQ", True)
    rotated_dq_order: bool | None = env_flag("EXATTN_TRITON_ROTATED_DQ_ORDER")
    use_tma: bool = env_flag("EXATTN_TRITON_TMA", True)
    use_gluon: bool = env_flag("EXATTN_TRITON_GLUON", True)
    replay: bool = env_flag("EXATTN_TRITON_REPLAY", True)


settings = TritonSettings()


def ensure_allocator() -> None:
    """Device-side TMA descriptors need scratch memory; triton's allocator is per thread."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(
            lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda")
        )


def hopper(x: torch.Tensor) -> bool:
    """A CUDA tensor on sm_90 or newer (TMA, warp specialization); False in the interpreter."""
    if interpreting() or x.device.type != "cuda":
        return False
    return capability_of(x.device)[0] >= 9


def can_use_tma(*tensors: torch.Tensor) -> bool:
    """TMA descriptors on Hopper (and in the interpreter, to test that path) where strides allow."""
    if not settings.use_tma or not tma_compatible(*tensors):
        return False
    if interpreting():
        return True
    if not hopper(tensors[0]):
        return False
    ensure_allocator()
    return True


def host_descriptor_fits(x: torch.Tensor, strides: tuple[int, ...], heads: int, dim: int, block_cols: int) -> bool:
    """Whether one host descriptor over `x` as a 2-D (rows, row stride) matrix serves every (b, h) slice of
    its kernel view (`strides`: (batch, head, row, col)): unit columns, no padded head dim (a box wider
    than the head would read its neighbour's columns), rows at least a head wide, batch strides whole
    rows, and each head either whole rows or columns inside one row (token-major and packed-qkv
    layouts); coordinates in int32."""
    row = strides[2]
    if dim != block_cols or strides[3] != 1 or row < dim or strides[0] % row or last_element(x) >= row * 2**31:
        return False
    return heads == 1 or strides[1] % row == 0 or 0 < strides[1] and (heads - 1) * strides[1] + dim <= row


def host_descriptor(x: torch.Tensor, row_stride: int, block_rows: int, block_cols: int):
    """A host TMA descriptor over `x` as a 2-D matrix of `row_stride` columns, as many rows as reach its
    last element (later rows read zero), [block_rows, block_cols] boxes (`tile_io`, USE_TMA = 2)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = last_element(x) // row_stride + 1
    return TensorDescriptor(x, [rows, row_stride], [row_stride, 1], [block_rows, block_cols])


def last_element(x: torch.Tensor) -> int:
    """Offset of x's last element from its first (x not empty)."""
    return sum((n - 1) * stride for n, stride in zip(x.shape, x.stride()))


# Host descriptors against descriptors built in the kernel (H200, bf16, 16k tokens, one A/B run of 3
# interleaved rounds): the Triton backward 0.99-1.10x at d = 64 packed, 1.11-1.18x dense at 512 tokens;
# at d = 128 0.97x packed full attention (0.88x causal, which the Gluon backward serves there) and
# 0.91-1.03x dense. Packed problems take them at every head dim all the same: their in-kernel
# descriptors need scratch for every program of a grid the longest sequence sizes (docs/triton.md).
HOST_DESCRIPTOR_MAX_DENSE_DIM = 64


def tma_mode(packed: bool, *views: tuple[torch.Tensor, tuple[int, ...], int, int, int]) -> int:
    """The kernels' USE_TMA for the `views` they read by tiles, each (tensor, kernel strides, heads, dim,
    padded dim): 2, host descriptors, for packed problems and dense ones up to
    HOST_DESCRIPTOR_MAX_DENSE_DIM, where `host_descriptor_fits` each; 1, descriptors built in the
    kernel; 0, pointers (`can_use_tma`)."""
    if not can_use_tma(*(view[0] for view in views)):
        return 0
    preferred = packed or max(view[3] for view in views) <= HOST_DESCRIPTOR_MAX_DENSE_DIM
    return 2 if preferred and all(host_descriptor_fits(*view) for view in views) else 1


def tile_descriptors(use_tma: int, *loads: tuple[torch.Tensor, tuple[int, ...], int, int]) -> list:
    """The host descriptors of `loads`, each (tensor, kernel strides, block rows, block cols), with
    USE_TMA = 2; else Nones (the kernels' placeholders)."""
    if use_tma != 2:
        return [None] * len(loads)
    return [host_descriptor(x, strides[2], rows, cols) for x, strides, rows, cols in loads]


def on_device(x: torch.Tensor):
    """Launch on x's GPU (Triton launches on the current device)."""
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


def mask_arguments(mask: torch.Tensor | None, fallback: torch.Tensor):
    """(kind, tensor, strides): kind 0 = none, 1 = bool (True = attend), 2 = additive."""
    if mask is None:
        return 0, fallback, (0, 0, 0, 0)
    return (1 if mask.dtype == torch.bool else 2), mask, mask.stride()


def kernel_flags(q: torch.Tensor, params: AttentionParams) -> dict:
    """Constexpr switches shared by every kernel of one problem."""
    left, right = params.window
    return dict(
        HAS_LEFT=left != UNBOUNDED,
        HAS_RIGHT=right != UNBOUNDED,
        DROPOUT=params.dropout_p > 0.0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )


def scalar_args(params: AttentionParams) -> dict:
    left, right = params.window
    return dict(
        scale_log2=params.scale * LOG2E, left=max(left, 0), right=max(right, 0),
        dropout_p=params.dropout_p, keep_scale=1.0 / (1.0 - params.dropout_p), seed=params.seed,
    )


def config_for(kind: str, q, v, mask, params: AttentionParams) -> TileConfig:
    causal = params.window[1] == 0 and params.window[0] == UNBOUNDED
    general = mask is not None or params.dropout_p > 0
    cfg = choose_config(
        kind, (q.shape[-1], v.shape[-1]), q.dtype, causal, general, interpreting(),
        params.block_m, params.block_n,
    )
    if cfg is None:
        raise ValueError(f"tiles too large for shared memory: block_m={params.block_m}, block_n={params.block_n}")
    return cfg


def heavy_first(params: AttentionParams) -> bool:
    """Causal rows further down see more keys: start them first."""
    left, right = params.window
    return left == UNBOUNDED and right != UNBOUNDED


def grid_of(tiles: int, heads: int) -> tuple[int]:
    size = tiles * heads
    if size > MAX_GRID:
        raise ValueError(f"too many tiles for one launch: {size} > {MAX_GRID}")
    return (size,)


class Packing(NamedTuple):
    """Packed variable-length sequences: sequence b owns rows cu_q[b]:cu_q[b+1] of the token-major
    (total, H, d) tensors (cu_k for K/V), at most max_q / max_k of them; the kernels read the offsets."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int

    @property
    def batch(self) -> int:
        return self.cu_q.shape[0] - 1

    def equal_lengths(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether every sequence has the longest lengths, which the totals of q and k show without
        reading the offsets (offsets from 0 that do not decrease, end at the totals and keep each length
        within max_q / max_k, as `attention_varlen` validates)."""
        return (q.shape[0], k.shape[0]) == (self.batch * self.max_q, self.batch * self.max_k)


def kernel_view(x: torch.Tensor, packing: Packing | None) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(tensor, (batch, head, row, col) strides) as the kernels index it: a packed (total, H, d)
    tensor is one (1, H, total, d) view whose batch stride is 0 (the offsets place each sequence)."""
    if packing is None:
        return x, x.stride()
    return x, (0, x.stride(1), x.stride(0), x.stride(2))


def problem_sizes(q, k, v, packing: Packing | None) -> tuple[int, int, int, int, int, int, int]:
    """(batch, heads_q, heads_k, len_q, len_k, dim, dim_v); packed: the longest lengths."""
    if packing is None:
        return q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3]
    return packing.batch, q.shape[1], k.shape[1], packing.max_q, packing.max_k, q.shape[2], v.shape[2]


def packing_args(q: torch.Tensor, packing: Packing | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(CU_Q, CU_K, stats head stride) kernel arguments: unused placeholders for dense problems."""
    if packing is None:
        return q, q, 0
    return packing.cu_q, packing.cu_k, q.shape[0]


def rule_args(q: torch.Tensor, params: AttentionParams, rules) -> tuple[dict, dict]:
    """(ALIBI / SINKS / PREFIX / SEG_Q / SEG_K / softcap2 kernel arguments, their constexpr switches) for the
    score rules: softcap, ALiBi slopes (B, Hq), sinks (Hq,), prefix (B,), segment ids (B, Nq) and (B, Nk);
    placeholders where off."""
    alibi = None if rules is None else rules.alibi_slopes
    sinks = None if rules is None else rules.sinks
    prefix = None if rules is None else rules.prefix
    seg_q = None if rules is None else rules.q_segment_ids
    seg_k = None if rules is None else rules.k_segment_ids
    softcap = params.softcap
    args = dict(ALIBI=q if alibi is None else alibi, alibi_strides=(0, 0) if alibi is None else alibi.stride(),
                softcap2=softcap * LOG2E, PREFIX=q if prefix is None else prefix,
                SEG_Q=q if seg_q is None else seg_q, SEG_K=q if seg_k is None else seg_k,
                seg_q_strides=(0, 0) if seg_q is None else seg_q.stride(),
                seg_k_strides=(0, 0) if seg_k is None else seg_k.stride())
    flags = dict(HAS_SOFTCAP=softcap > 0, HAS_ALIBI=alibi is not None, HAS_PREFIX=prefix is not None,
                 HAS_SEGMENTS=seg_q is not None)
    return dict(args, SINKS=q if sinks is None else sinks), dict(flags, HAS_SINKS=sinks is not None)


def segment_ranges(rules, q: torch.Tensor, block_rows: int, block_cols: int, keys_first: bool = False):
    """The SEG_RANGES kernel argument: query tiles' key-tile ranges (keys_first: key tiles' query-tile
    ranges, for the dK/dV kernel); a placeholder without segment ids."""
    if rules is None or rules.q_segment_ids is None:
        return q
    rows, cols = rules.q_segment_ids, rules.k_segment_ids
    return segment_tile_ranges(cols, rows, block_rows, block_cols) if keys_first else segment_tile_ranges(
        rows, cols, block_rows, block_cols)


def row_stats(q: torch.Tensor, packing: Packing | None, within: torch.Tensor | None = None) -> torch.Tensor:
    """An empty float32 per-row buffer: (B, Hq, Nq), or (Hq, total_q) packed; in `within`'s bytes where
    they hold it (`float32_within`)."""
    shape = tuple(q.shape[:3]) if packing is None else (q.shape[1], q.shape[0])
    return float32_within(within, shape, q.device)


def float32_within(grad: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """An empty float32 tensor of `shape` over the first bytes of `grad`, or a new one on `device` where
    `grad` is None, not contiguous or too small. `grad` is a gradient buffer the backward made and writes
    whole in its last kernel, after every read of this tensor: the backward's per-row statistics then take
    no memory of their own."""
    nbytes = 4 * math.prod(shape)
    if grad is None or not grad.is_contiguous() or grad.numel() * grad.element_size() < nbytes:
        return torch.empty(shape, dtype=torch.float32, device=device)
    return grad.view(-1).view(torch.uint8)[:nbytes].view(torch.float32).view(shape)


@replayable(replay_key, lambda q, k, v, mask, params, *rest, **named: replays(q, params.dropout_p))
def triton_forward(q, k, v, mask, params: AttentionParams, packing: Packing | None = None, rules=None):
    """out (B, Hq, Nq, Dv) in q's dtype and lse (B, Hq, Nq) float32, natural log.

    packing: q, k, v are token-major (total, H, d); out is (total_q, Hq, Dv), lse (Hq, total_q).
    rules: a `ScoreRules` whose softcap / ALiBi / sinks the kernels apply (None: none)."""
    with on_device(q):
        return launch_forward(q, k, v, mask, params, packing, rules)


def with_positive_scale(q: torch.Tensor, params: AttentionParams) -> tuple[torch.Tensor, AttentionParams]:
    """(q, params) for a forward kernel that takes a tile's row maximum of the raw scores and scales it after,
    which holds for a scale >= 0 only: a negative scale becomes -q with |scale|, the same scores (its q is a
    copy, and the pass is not replayed)."""
    if params.scale >= 0:
        return q, params
    return q.neg(), replace(params, scale=-params.scale)


def launch_forward(q, k, v, mask, params: AttentionParams, packing: Packing | None = None, rules=None):
    q, params = with_positive_scale(q, params)
    batch, heads_q, heads_k, len_q, len_k, dim, dim_v = problem_sizes(q, k, v, packing)
    out = torch.empty((*q.shape[:-1], dim_v), dtype=q.dtype, device=q.device)
    lse = row_stats(q, packing)
    if out.numel() == 0 or len_k == 0 or k.numel() == 0:
        return out.zero_(), lse_without_keys(lse, None if rules is None else rules.sinks, 1 if packing is None else 0)
    rule_kernel_args, rule_flags = rule_args(q, params, rules)
    cfg = config_for("forward", q, v, mask, params)
    mask_kind, mask_arg, mask_strides = mask_arguments(mask, q)
    flags = kernel_flags(q, params)
    use_ws = cfg.warp_specialize and cfg.num_warps == 4 and hopper(q)
    num_tiles = ceil_div(len_q, cfg.block_m)
    (q, q_strides), (k, k_strides), (v, v_strides), (out, o_strides) = (
        kernel_view(x, packing) for x in (q, k, v, out))
    block_d, block_dv = padded_dim(dim), padded_dim(dim_v)
    use_tma = tma_mode(packing is not None, (q, q_strides, heads_q, dim, block_d), (k, k_strides, heads_k, dim, block_d),
                       (v, v_strides, heads_k, dim_v, block_dv))
    descriptors = tile_descriptors(use_tma, (q, q_strides, cfg.block_m, block_d), (k, k_strides, cfg.block_n, block_d),
                                   (v, v_strides, cfg.block_n, block_dv))
    run_kernel(attention_forward_kernel, grid_of(num_tiles, batch * heads_q),
        q, k, v, out, lse, mask_arg, *packing_args(q, packing)[:2], q_strides=q_strides, k_strides=k_strides,
        v_strides=v_strides, o_strides=o_strides, mask_strides=mask_strides, heads_q=heads_q,
        group=heads_q // heads_k, len_q=len_q, len_k=len_k, num_row_tiles=num_tiles,
        lse_head_stride=packing_args(q, packing)[2], SEG_RANGES=segment_ranges(rules, q, cfg.block_m, cfg.block_n),
        Q_DESC=descriptors[0], K_DESC=descriptors[1], V_DESC=descriptors[2],
        **rule_kernel_args, **rule_flags, **scalar_args(params),
        D=dim, DV=dim_v, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_D=block_d, BLOCK_DV=block_dv, MASK_KIND=mask_kind,
        USE_TMA=use_tma, HEAVY_FIRST=heavy_first(params),
        WARP_SPECIALIZE=use_ws, VARLEN=packing is not None, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **flags,
    )
    return out, lse


@replayable(replay_key, lambda dout, q, k, v, mask, out, lse, params, *rest, **named: replays(q, params.dropout_p))
def triton_backward(dout, q, k, v, mask, out, lse, params: AttentionParams, accumulate_into=None,
                    packing: Packing | None = None, rules=None):
    """dq, dk, dv (in q, k, v's dtypes) for `triton_forward`, recomputing tiles from lse.

    accumulate_into: optional float32 (dq, dk, dv) of q, k, v's shapes, any strides:
    the gradients are added into them, tile by tile inside the kernels, and they are returned.
    packing, rules: as `triton_forward` (then lse is (Hq, total_q)); the sinks' gradient is the caller's
    (`exattn.masks.sinks_grad`).
    """
    accumulate_into = check_accumulators(accumulate_into, q, k, v)
    with on_device(q):
        return launch_backward(dout, q, k, v, mask, out, lse, params, accumulate_into, packing, rules)


def row_deltas(out: torch.Tensor, dout: torch.Tensor, packing: Packing | None = None,
               within: torch.Tensor | None = None) -> torch.Tensor:
    """delta = rowsum(out * dout) in float32, contiguous (B, Hq, Nq) (packed: (Hq, total_q)), in
    `within`'s bytes where they hold it: the preprocess of the dK/dV kernel (the dQ kernel forms its own)."""
    delta = row_stats(out, packing, within)
    batch, heads_q, _, len_q, _, _, dim_v = problem_sizes(out, out, out, packing)
    row_tiles = ceil_div(len_q, 64)
    (out, o_strides), (dout, do_strides) = (kernel_view(x, packing) for x in (out, dout))
    cu_q, _, stats_stride = packing_args(out, packing)
    run_kernel(attention_delta_kernel, grid_of(row_tiles, batch * heads_q),
        out, dout, delta, cu_q, o_strides, do_strides, heads_q, len_q, row_tiles, stats_stride,
        DV=dim_v, BLOCK_M=64, BLOCK_DV=padded_dim(dim_v), VARLEN=packing is not None, num_warps=4,
    )
    return delta


def launch_backward(dout, q, k, v, mask, out, lse, params: AttentionParams, accumulate_into=None,
                    packing: Packing | None = None, rules=None):
    batch, heads_q, heads_k, len_q, len_k, dim, dim_v = problem_sizes(q, k, v, packing)
    accumulate = accumulate_into is not None
    if 0 in (batch, heads_q, len_q, len_k) or q.numel() == 0 or k.numel() == 0:
        return accumulate_into if accumulate else (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    lse = lse.to(torch.float32).contiguous()
    cu_q, cu_k, stats_stride = packing_args(q, packing)
    rule_kernel_args, rule_flags = rule_args(q, params, rules)
    rule_kernel_args.pop("SINKS")
    rule_flags.pop("HAS_SINKS")  # the sink reaches the backward through lse
    mask_kind, mask_arg, mask_strides = mask_arguments(mask, q)
    flags = kernel_flags(q, params)
    scalars = dict(scalar_args(params), scale=params.scale)
    block_d, block_dv = padded_dim(dim), padded_dim(dim_v)
    (q_view, q_strides), (do_view, do_strides), (k_view, k_strides), (v_view, v_strides) = (
        kernel_view(x, packing) for x in (q, dout, k, v))
    use_tma = tma_mode(packing is not None, (q_view, q_strides, heads_q, dim, block_d), (do_view, do_strides, heads_q, dim_v, block_dv),
                       (k_view, k_strides, heads_k, dim, block_d), (v_view, v_strides, heads_k, dim_v, block_dv))
    dims = dict(D=dim, DV=dim_v, BLOCK_D=block_d, BLOCK_DV=block_dv)
    group = heads_q // heads_k
    if accumulate:
        dq, dk, dv = accumulate_into
    else:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    delta = row_deltas(out, dout, packing, None if accumulate else dq)
    atomic = settings.atomic_dq
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if atomic else dq

    cfg = config_for("dkdv", q, v, mask, params)
    col_tiles = ceil_div(len_k, cfg.block_n)
    strides = [q_strides, k_strides, v_strides, do_strides, *(kernel_view(x, packing)[1] for x in (dk, dv, dq_acc))]
    run_kernel(attention_dkdv_kernel, grid_of(col_tiles, batch * heads_k),
        q, k, v, dout, lse, delta, dk, dv, dq_acc, mask_arg, cu_q, cu_k, rule_kernel_args["ALIBI"],
        rule_kernel_args["PREFIX"], rule_kernel_args["SEG_Q"], rule_kernel_args["SEG_K"],
        segment_ranges(rules, q, cfg.block_n, cfg.block_m, keys_first=True),
        *tile_descriptors(use_tma, (q, q_strides, cfg.block_m, block_d), (dout, do_strides, cfg.block_m, block_dv)),
        *strides,
        mask_strides, rule_kernel_args["alibi_strides"], rule_kernel_args["seg_q_strides"],
        rule_kernel_args["seg_k_strides"], heads_q, group, len_q, len_k, col_tiles, stats_stride,
        rule_kernel_args["softcap2"], **scalars, **rule_flags,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, MASK_KIND=mask_kind, USE_TMA=use_tma,
        ATOMIC_DQ=atomic, ACCUMULATE=accumulate, VARLEN=packing is not None, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **dims, **flags,
    )
    if atomic:
        if accumulate:
            return dq.add_(dq_acc.mul_(params.scale)), dk, dv
        return (dq_acc * params.scale).to(q.dtype), dk, dv

    cfg = config_for("dq", q, v, mask, params)
    row_tiles = ceil_div(len_q, cfg.block_m)
    strides = [q_strides, k_strides, v_strides, do_strides, kernel_view(out, packing)[1], kernel_view(dq, packing)[1]]
    run_kernel(attention_dq_kernel, grid_of(row_tiles, batch * heads_q),
        q, k, v, dout, out, lse, dq, mask_arg, cu_q, cu_k, rule_kernel_args["ALIBI"], rule_kernel_args["PREFIX"],
        rule_kernel_args["SEG_Q"], rule_kernel_args["SEG_K"], segment_ranges(rules, q, cfg.block_m, cfg.block_n),
        *tile_descriptors(use_tma, (k, k_strides, cfg.block_n, block_d), (v, v_strides, cfg.block_n, block_dv)),
        *strides, mask_strides, rule_kernel_args["alibi_strides"], rule_kernel_args["seg_q_strides"],
        rule_kernel_args["seg_k_strides"], heads_q, group, len_q, len_k, row_tiles, stats_stride,
        rule_kernel_args["softcap2"], **scalars, **rule_flags,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, MASK_KIND=mask_kind, USE_TMA=use_tma,
        HEAVY_FIRST=heavy_first(params), ACCUMULATE=accumulate, VARLEN=packing is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **dims, **flags,
    )
    return dq, dk, dv
