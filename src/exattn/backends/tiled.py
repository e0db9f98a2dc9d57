"""The tiled backend: pure PyTorch, any device, O(N) memory.

Forward: for each query tile, carry a running `BlockSummary` over the key
tiles the band allows, merging each tile's summary (algebra.merge), then
finalize. Backward: recompute each score tile from the saved lse,
`P = exp(S - lse)`, with `delta = rowsum(dO * O)`:

    dV += P_drop^T dO,   dS = P * (dO V^T * keep/(1-p) - delta),
    dQ += scale dS K,    dK += scale dS^T Q

Tiles are (B, Hk, G, rows, cols): the G query heads that share a K/V head are
stacked, so K/V tiles are read once per group (GQA/MQA).
"""

from __future__ import annotations

import torch

from ..algebra import BlockSummary, empty_summary, finalize, merge, summarize
from ..dropout import keep_tile
from ..masks import apply_masks, band_bounds, band_rows
from ..problem import AttentionParams, AttentionProblem, compute_dtype

# Elements of one score tile, summed over batch and heads, that the default
# tile sizes aim for: large enough for efficient matmuls, small enough for cache.
TILE_ELEMENTS = 1 << 21
MAX_BLOCK_M = 256
MAX_BLOCK_N = 512


def default_blocks(batch_heads: int, len_q: int, len_k: int) -> tuple[int, int]:
    block_n = max(16, min(MAX_BLOCK_N, len_k))
    block_m = TILE_ELEMENTS // max(1, batch_heads * block_n)
    return max(16, min(MAX_BLOCK_M, len_q, block_m)), block_n


def tile_sizes(q: torch.Tensor, k: torch.Tensor, params: AttentionParams) -> tuple[int, int]:
    default_m, default_n = default_blocks(q.shape[0] * q.shape[1], q.shape[2], k.shape[2])
    return params.block_m or default_m, params.block_n or default_n


def grouped(x: torch.Tensor, heads_k: int) -> torch.Tensor:
    """(B, Hq, ...) -> (B, Hk, G, ...), a view."""
    return x.unflatten(1, (heads_k, x.shape[1] // heads_k))


class TileContext:
    """What every tile of one problem needs: shapes, params, masks and dropout."""

    def __init__(self, q, k, mask, params: AttentionParams):
        self.params = params
        self.batch, self.heads_q, self.len_q, _ = q.shape
        self.heads_k, self.len_k = k.shape[1], k.shape[2]
        self.mask = None if mask is None else grouped(mask, self.heads_k)
        self.dtype = compute_dtype(q.dtype)
        self.device = q.device
        self.keep_scale = 1.0 / (1.0 - params.dropout_p)

    def scores(self, q_tile: torch.Tensor, k_tile: torch.Tensor, rows: range, cols: range):
        """Masked scaled scores (B, Hk, G, rows, cols); q_tile is already scaled."""
        scores = torch.matmul(q_tile, k_tile.transpose(-1, -2))
        mask_tile = None
        if self.mask is not None:
            mask_tile = self.mask[..., rows.start:rows.stop, cols.start:cols.stop]
        return apply_masks(
            scores, rows, cols, self.len_q, self.len_k, self.params.window, mask_tile
        )

    def dropout_weights(self, rows: range, cols: range) -> torch.Tensor | None:
        """keep / (1 - p) for the tile, (B, Hk, G, rows, cols), or None without dropout."""
        if self.params.dropout_p == 0.0:
            return None
        shape = (self.batch, self.heads_q, self.len_q, self.len_k)
        keep = keep_tile(
            self.params.seed, self.params.dropout_p, shape,
            range(self.batch), range(self.heads_q), rows, cols, self.device,
        )
        return grouped(keep, self.heads_k).to(self.dtype) * self.keep_scale


def spans(start: int, stop: int, step: int):
    for lo in range(start, stop, step):
        yield range(lo, min(lo + step, stop))


def tiled_forward(q, k, v, mask, params: AttentionParams):
    """out (B, Hq, Nq, Dv) in q's dtype and lse (B, Hq, Nq) in the compute dtype."""
    ctx = TileContext(q, k, mask, params)
    block_m, block_n = tile_sizes(q, k, params)
    q5, k5, v5 = grouped(q, ctx.heads_k), k.unsqueeze(2), v.unsqueeze(2)
    out = torch.empty(*q.shape[:3], v.shape[3], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=ctx.dtype, device=q.device)
    out5, lse5 = grouped(out, ctx.heads_k), grouped(lse, ctx.heads_k)
    for rows in spans(0, ctx.len_q, block_m):
        q_tile = q5[..., rows.start:rows.stop, :].to(ctx.dtype) * params.scale
        state = empty_summary(q_tile.shape[:-1], v.shape[3], ctx.dtype, q.device)
        for cols in spans(*band_bounds(rows, ctx.len_q, ctx.len_k, params.window), block_n):
            k_tile = k5[..., cols.start:cols.stop, :].to(ctx.dtype)
            v_tile = v5[..., cols.start:cols.stop, :].to(ctx.dtype)
            scores = ctx.scores(q_tile, k_tile, rows, cols)
            tile = summarize(scores, v_tile, ctx.dropout_weights(rows, cols))
            state = merge(state, tile)
        out_tile, lse_tile = finalize(state)
        out5[..., rows.start:rows.stop, :] = out_tile.to(q.dtype)
        lse5[..., rows.start:rows.stop] = lse_tile
    return out, lse


def tiled_backward(dout, q, k, v, mask, out, lse, params: AttentionParams):
    """dq, dk, dv for `tiled_forward`, recomputing score tiles from the saved lse."""
    ctx = TileContext(q, k, mask, params)
    block_m, block_n = tile_sizes(q, k, params)
    heads_k = ctx.heads_k
    q5, do5 = grouped(q, heads_k), grouped(dout, heads_k)
    delta5 = grouped((dout.to(ctx.dtype) * out.to(ctx.dtype)).sum(-1), heads_k)
    # A row with no allowed key has lse = -inf; +inf makes its P = exp(s - inf) = 0.
    lse5 = grouped(torch.where(lse == float("-inf"), float("inf"), lse.to(ctx.dtype)), heads_k)
    dq5 = torch.zeros(q5.shape, dtype=ctx.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=ctx.dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=ctx.dtype, device=q.device)
    for cols in spans(0, ctx.len_k, block_n):
        k_tile = k[:, :, cols.start:cols.stop].unsqueeze(2).to(ctx.dtype)
        v_tile = v[:, :, cols.start:cols.stop].unsqueeze(2).to(ctx.dtype)
        for rows in spans(*band_rows(cols, ctx.len_q, ctx.len_k, params.window), block_m):
            r = slice(rows.start, rows.stop)
            q_tile = q5[..., r, :].to(ctx.dtype)
            do_tile = do5[..., r, :].to(ctx.dtype)
            scores = ctx.scores(q_tile * params.scale, k_tile, rows, cols)
            probs = torch.exp(scores - lse5[..., r].unsqueeze(-1))
            weights = ctx.dropout_weights(rows, cols)
            dropped = probs if weights is None else probs * weights
            dv[:, :, cols.start:cols.stop] += torch.matmul(dropped.transpose(-1, -2), do_tile).sum(2)
            dprobs = torch.matmul(do_tile, v_tile.transpose(-1, -2))
            if weights is not None:
                dprobs = dprobs * weights
            dscores = probs * (dprobs - delta5[..., r].unsqueeze(-1)) * params.scale
            dq5[..., r, :] += torch.matmul(dscores, k_tile)
            dk[:, :, cols.start:cols.stop] += torch.matmul(dscores.transpose(-1, -2), q_tile).sum(2)
    return dq5.flatten(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class TiledAttention(torch.autograd.Function):
    """Autograd wrapper: saves q, k, v, out, lse (and the seed, in params); no N x N tensor."""

    @staticmethod
    def forward(ctx, q, k, v, mask, params: AttentionParams):
        out, lse = tiled_forward(q, k, v, mask, params)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.params = mask, params
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = tiled_backward(dout, q, k, v, ctx.mask, out, lse, ctx.params)
        return dq, dk, dv, None, None


class TiledBackend:
    """Pure PyTorch tiles; serves every input the contract allows, on any device."""

    name = "tiled"
    forward = staticmethod(tiled_forward)
    backward = staticmethod(tiled_backward)

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        return []

    def run(self, problem: AttentionProblem) -> tuple[torch.Tensor, torch.Tensor]:
        return TiledAttention.apply(problem.q, problem.k, problem.v, problem.mask, problem.params)
