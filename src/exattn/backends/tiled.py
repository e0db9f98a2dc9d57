"""The tiled backend: pure PyTorch, any device, O(N) memory.

Forward: for each query tile, carry a running `BlockSummary` over the key
tiles the band allows, folding each tile into it (algebra.absorb_, the
merge of the tile's summary in one pass), then finalize. Backward: recompute each score tile from the saved lse,
`P = exp(S - lse)`, with `delta = rowsum(dO * O)`:

    dV += P_drop^T dO,   dS = P * (dO V^T * keep/(1-p) - delta),
    dQ += scale dS K,    dK += scale dS^T Q

Tiles are (B, Hk, G, rows, cols): the G query heads that share a K/V head are
stacked, so K/V tiles are read once per group (GQA/MQA).

Score rules (`ScoreRules`, `params.softcap`): each score tile goes through
`masks.apply_score_rules` from O(N) inputs (the tile's slice of the segment ids,
positions for ALiBi, the prefix). Tiles are skipped when the band and the prefix
leave them empty (`masks.key_intervals`, `masks.query_range`) and when segment ids
do: per block of `block_m` queries / `block_n` keys and per batch entry, the least
and greatest id (computed once per call, O(B·N/block)); a tile is computed only if
some batch entry's query and key id ranges overlap. Softcap's chain factor
1 - tanh^2 multiplies dS. The sink is folded in at finalize as the summary
(m = sinks[h], l = 1, u = 0), merged with `algebra.merge_`; its gradient comes from
the lse alone (`masks.sinks_grad`), outside the tiles.
"""

from __future__ import annotations

import math

import torch

from ..algebra import NEG_INF, BlockSummary, absorb_, exp_, finalize_, merge_, summarize_into_
from ..dropout import keep_tile
from ..masks import apply_score_rules, key_intervals, query_range, softcap_
from ..problem import AttentionParams, ScoreRules, check_accumulators, compute_dtype

# Elements of one score tile, summed over batch and heads, that the default
# tile sizes aim for: large enough for efficient matmuls, small enough for cache.
TILE_ELEMENTS = 1 << 21
MAX_BLOCK_M = 256
MAX_BLOCK_N = 512
# Up to FEW_ROWS query rows (decoding, short chunks) the forward's key tiles grow past MAX_BLOCK_N to
# FEW_ROWS_ELEMENTS scores (1 MiB of float32): fewer, larger steps that stay in cache. The backward keeps
# MAX_BLOCK_N (docs/performance.md, "CPU: the tiled backend").
FEW_ROWS = 16
FEW_ROWS_ELEMENTS = 1 << 18


def default_blocks(batch_heads: int, len_q: int, len_k: int, backward: bool = False) -> tuple[int, int]:
    widest = MAX_BLOCK_N
    if len_q <= FEW_ROWS and not backward:
        widest = max(MAX_BLOCK_N, FEW_ROWS_ELEMENTS // max(1, batch_heads * len_q))
    block_n = max(16, min(widest, len_k))
    block_m = TILE_ELEMENTS // max(1, batch_heads * block_n)
    return max(16, min(MAX_BLOCK_M, len_q, block_m)), block_n


def tile_sizes(q: torch.Tensor, k: torch.Tensor, params: AttentionParams, backward: bool = False) -> tuple[int, int]:
    default_m, default_n = default_blocks(q.shape[0] * q.shape[1], q.shape[2], k.shape[2], backward)
    return params.block_m or default_m, params.block_n or default_n


def grouped(x: torch.Tensor, heads_k: int) -> torch.Tensor:
    """(B, Hq, ...) -> (B, Hk, G, ...), a view."""
    return x.unflatten(1, (heads_k, x.shape[1] // heads_k))


def spans(start: int, stop: int, step: int):
    for lo in range(start, stop, step):
        yield range(lo, min(lo + step, stop))


def product_into(buffer: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """alpha * (a @ b) for batched (..., m, k) @ (..., k, n), written into the front of a flat buffer."""
    shape = (*a.shape[:-1], b.shape[-1])
    out = buffer[: math.prod(shape)].view(shape)
    out.view(-1, *shape[-2:]).baddbmm_(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]),
                                       beta=0.0, alpha=alpha)
    return out


def blocks_of(span: range, block: int) -> slice:
    """The blocks of `block` positions that `span` touches."""
    return slice(span.start // block, (span.stop - 1) // block + 1)


def block_extrema(ids: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each batch entry's least and greatest id per block of `block` positions: two CPU
    tensors (B, ceil(N / block)). The last block is padded with the last id."""
    batch, length = ids.shape
    count = -(-length // block)
    padded = ids.new_empty(batch, count * block)
    padded[:, :length] = ids
    padded[:, length:] = ids[:, -1:]
    blocks = padded.view(batch, count, block)
    return blocks.amin(2).cpu(), blocks.amax(2).cpu()


class SegmentSkip:
    """Which tiles segment ids leave empty, from per-block id ranges (O(B·N/block) memory).

    A (query block, key block) pair may hold an allowed pair only if, for some batch entry,
    the blocks' id ranges [min, max] overlap. With ids sorted along the sequence (packed
    documents) this is exact: the computed tiles are the tiles that hold an allowed pair.
    """

    def __init__(self, rules: ScoreRules, block_m: int, block_n: int):
        self.block_m, self.block_n = block_m, block_n
        self.q_min, self.q_max = block_extrema(rules.q_segment_ids, block_m)
        self.k_min, self.k_max = block_extrema(rules.k_segment_ids, block_n)

    @staticmethod
    def live(lo_min, lo_max, span: range, block: int, other_min, other_max) -> list[bool]:
        """For every block of the other side: may it meet the blocks that `span` touches?"""
        blocks = blocks_of(span, block)
        least = lo_min[:, blocks].amin(1, keepdim=True)
        greatest = lo_max[:, blocks].amax(1, keepdim=True)
        return ((least <= other_max) & (other_min <= greatest)).any(0).tolist()

    def live_key_blocks(self, rows: range) -> list[bool]:
        return self.live(self.q_min, self.q_max, rows, self.block_m, self.k_min, self.k_max)

    def live_query_blocks(self, cols: range) -> list[bool]:
        return self.live(self.k_min, self.k_max, cols, self.block_n, self.q_min, self.q_max)

    def one_id(self, rows: range, cols: range) -> bool:
        """Whether, in every batch entry, the rows and the keys of the tile hold one id, the same: the
        segment ids then allow every pair of the tile and need no mask."""
        q_blocks, k_blocks = blocks_of(rows, self.block_m), blocks_of(cols, self.block_n)
        least = self.q_min[:, q_blocks].amin(1)
        return bool(((self.q_max[:, q_blocks].amax(1) == least) & (self.k_min[:, k_blocks].amin(1) == least)
                     & (self.k_max[:, k_blocks].amax(1) == least)).all())


def touches_live(live: list[bool] | None, span: range, block: int) -> bool:
    return live is None or any(live[blocks_of(span, block)])


class TileContext:
    """What every tile of one problem needs: shapes, params, masks, score rules, dropout, buffers.

    A query tile is "stacked": the G query heads that share a K/V head are laid
    end to end, (B, Hk, G * rows, D), so each score tile is one batched matmul
    against an unexpanded K/V tile, and the reductions over G come for free.
    """

    def __init__(self, q, k, mask, params: AttentionParams, rules: ScoreRules | None = None,
                 backward: bool = False):
        self.params = params
        self.rules = rules
        self.batch, self.heads_q, self.len_q, _ = q.shape
        self.heads_k, self.len_k = k.shape[1], k.shape[2]
        self.group = self.heads_q // self.heads_k
        self.block_m, self.block_n = tile_sizes(q, k, params, backward)
        self.mask = None if mask is None else grouped(mask, self.heads_k)
        self.dtype = compute_dtype(q.dtype)
        self.device = q.device
        self.keep_scale = 1.0 / (1.0 - params.dropout_p)
        # One score buffer reused by every tile: fresh large allocations are slow on the CPU.
        tile_elements = self.batch * self.heads_q * self.block_m * self.block_n
        self.buffer = torch.empty(tile_elements, dtype=self.dtype, device=self.device)
        self.summary: BlockSummary | None = None
        self.spare: torch.Tensor | None = None
        self.softcap_buffer: torch.Tensor | None = None
        # Tile skipping by the prefix (its largest entry, read once) and by segment ids.
        self.prefix = 0
        self.segments: SegmentSkip | None = None
        if rules is not None and self.batch > 0:
            if rules.prefix is not None:
                self.prefix = min(int(rules.prefix.max()), self.len_k)
            if rules.q_segment_ids is not None and self.len_q > 0 and self.len_k > 0:
                self.segments = SegmentSkip(rules, self.block_m, self.block_n)

    def key_spans(self, rows: range):
        """The key tiles of query tile `rows` that may hold an allowed pair."""
        live = None if self.segments is None else self.segments.live_key_blocks(rows)
        for lo, hi in key_intervals(rows, self.len_q, self.len_k, self.params.window, self.prefix):
            for cols in spans(lo, hi, self.block_n):
                if touches_live(live, cols, self.block_n):
                    yield cols

    def query_spans(self, cols: range):
        """The query tiles that may hold an allowed pair with key tile `cols`."""
        live = None if self.segments is None else self.segments.live_query_blocks(cols)
        for rows in spans(*query_range(cols, self.len_q, self.len_k, self.params.window, self.prefix),
                          self.block_m):
            if touches_live(live, rows, self.block_m):
                yield rows

    def sink_summary(self, rows: range) -> BlockSummary:
        """The sink as a block of one key: m = sinks[h], l = 1, u = 0, for stacked rows."""
        sinks = self.rules.sinks.to(self.dtype).view(1, self.heads_k, self.group, 1)
        m = sinks.expand(self.batch, -1, -1, len(rows)).reshape(self.batch, self.heads_k, -1)
        one = torch.ones((), dtype=self.dtype, device=self.device)
        return BlockSummary(m, one, torch.zeros_like(one))

    def softcap_grad_tile(self, shape: tuple[int, ...]) -> torch.Tensor | None:
        """A tile of `shape` for softcap's 1 - tanh^2 (a third reused buffer); None without softcap."""
        if self.params.softcap == 0:
            return None
        if self.softcap_buffer is None:
            self.softcap_buffer = torch.empty_like(self.buffer)
        return self.softcap_buffer[: math.prod(shape)].view(shape)

    def summary_buffers(self, shape: tuple[int, ...], value_dim: int) -> BlockSummary:
        """A summary's tensors for stacked rows of `shape`, reused by every query tile; unset."""
        if self.summary is None:
            most = self.batch * self.heads_q * self.block_m
            self.summary = BlockSummary(*(torch.empty(size, dtype=self.dtype, device=self.device)
                                          for size in (most, most, most * value_dim)))
        rows = math.prod(shape)
        m, l, u = self.summary  # noqa: E741
        return BlockSummary(m[:rows].view(shape), l[:rows].view(shape), u[: rows * value_dim].view(*shape, value_dim))

    def identity_summary(self, shape: tuple[int, ...], value_dim: int) -> BlockSummary:
        """The empty summary for stacked rows of `shape`, in the reused buffers."""
        m, l, u = self.summary_buffers(shape, value_dim)  # noqa: E741
        return BlockSummary(m.fill_(NEG_INF), l.zero_(), u.zero_())

    def stack(self, x5: torch.Tensor, rows: range) -> torch.Tensor:
        """Rows of a (B, Hk, G, N, d) tensor as a stacked (B, Hk, G * rows, d) compute tile."""
        tile = x5[..., rows.start:rows.stop, :].to(self.dtype)
        return tile.reshape(self.batch, self.heads_k, self.group * len(rows), x5.shape[-1])

    def unstack(self, x: torch.Tensor, rows: range) -> torch.Tensor:
        """(B, Hk, G * rows, ...) -> (B, Hk, G, rows, ...), a view."""
        return x.unflatten(2, (self.group, len(rows)))

    def scores(self, q_tile: torch.Tensor, k_tile: torch.Tensor, rows: range, cols: range,
               softcap_grad: torch.Tensor | None = None):
        """Scores scale * q k^T after every rule, (B, Hk, G * rows, cols), in the shared buffer.

        The scale is the GEMM's alpha, so forward and backward round scores alike.
        softcap_grad: an optional tile of the same shape that receives 1 - tanh^2.
        """
        scores = product_into(self.buffer, q_tile, k_tile.transpose(-1, -2), self.params.scale)
        if self.params.softcap > 0:  # first, in the contract's order of the rules
            scratch = self.spare_tile(scores.numel()).view(scores.shape) if softcap_grad is None else softcap_grad
            softcap_(scores, self.params.softcap, scratch, softcap_grad)
        mask_tile = None
        if self.mask is not None:
            mask_tile = self.mask[..., rows.start:rows.stop, cols.start:cols.stop]
        rules = self.rules
        if self.segments is not None and self.segments.one_id(rows, cols):
            rules = rules._replace(q_segment_ids=None, k_segment_ids=None)
        ruled = apply_score_rules(self.unstack(scores, rows), rows, cols, self.len_q, self.len_k,
                                  self.params.window, mask_tile, rules)
        return ruled.reshape(scores.shape)

    def spare_tile(self, size: int) -> torch.Tensor:
        """A second buffer, at least a score tile's size, reused by every tile (the softcap's scratch,
        the backward's dP, then its dQ tile)."""
        if self.spare is None or self.spare.numel() < size:
            self.spare = torch.empty(max(size, self.buffer.numel()), dtype=self.dtype, device=self.device)
        return self.spare[:size]

    def product(self, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        """alpha * (a @ b) in the spare buffer."""
        return product_into(self.spare_tile(math.prod(a.shape[:-1]) * b.shape[-1]), a, b, alpha)

    def dropout_weights(self, rows: range, cols: range) -> torch.Tensor | None:
        """keep / (1 - p) for the tile, stacked (B, Hk, G * rows, cols); None without dropout."""
        if self.params.dropout_p == 0.0:
            return None
        # The mask's grid: this problem's own shape, or a padded one (params.dropout_grid).
        batch, grid_rows, grid_cols = self.params.dropout_layout(self.batch, self.len_q, self.len_k)
        shape = (batch.stop, self.heads_q, grid_rows, grid_cols)
        keep = keep_tile(
            self.params.seed, self.params.dropout_p, shape,
            batch, range(self.heads_q), rows, cols, self.device,
        )
        weights = keep.to(self.dtype) * self.keep_scale
        return weights.view(self.batch, self.heads_k, self.group * len(rows), len(cols))


def tiled_forward(q, k, v, mask, params: AttentionParams, rules: ScoreRules | None = None):
    """out (B, Hq, Nq, Dv) in q's dtype and lse (B, Hq, Nq) in the compute dtype (the sink
    included)."""
    out = torch.empty(*q.shape[:3], v.shape[3], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=compute_dtype(q.dtype), device=q.device)
    if q.numel() == 0:  # no query row (B, Hq or Nq is 0): nothing to tile
        return out, lse
    ctx = TileContext(q, k, mask, params, rules)
    sinks = None if rules is None else rules.sinks
    q5 = grouped(q, ctx.heads_k)
    out5, lse5 = grouped(out, ctx.heads_k), grouped(lse, ctx.heads_k)
    for rows in spans(0, ctx.len_q, ctx.block_m):
        q_tile = ctx.stack(q5, rows)
        state = None  # the first key tile's summary starts it: the empty summary and its rescaling are skipped
        for cols in ctx.key_spans(rows):
            k_tile = k[:, :, cols.start:cols.stop].to(ctx.dtype)
            v_tile = v[:, :, cols.start:cols.stop].to(ctx.dtype)
            scores = ctx.scores(q_tile, k_tile, rows, cols)
            if state is None:
                state = summarize_into_(ctx.summary_buffers(q_tile.shape[:-1], v.shape[3]), scores, v_tile,
                                        ctx.dropout_weights(rows, cols))
            else:
                absorb_(state, scores, v_tile, ctx.dropout_weights(rows, cols))
        if state is None:  # no key tile holds an allowed pair for these rows
            state = ctx.identity_summary(q_tile.shape[:-1], v.shape[3])
        if sinks is not None:
            merge_(state, ctx.sink_summary(rows))
        out_tile, lse_tile = finalize_(state)
        out5[..., rows.start:rows.stop, :] = ctx.unstack(out_tile, rows)
        lse5[..., rows.start:rows.stop] = ctx.unstack(lse_tile, rows)
    return out, lse


def add_matmul_(target: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> None:
    """target += alpha * (a @ b) for batched (..., m, k) @ (..., k, n): in place through one batched
    GEMM when `target` can be viewed as (batch, m, n), through a temporary otherwise."""
    try:
        flat = target.view(-1, a.shape[-2], b.shape[-1])
    except RuntimeError:  # strides that do not flatten (a GQA group's rows, strided accumulators)
        target.add_(torch.matmul(a, b).view(target.shape), alpha=alpha)
        return
    flat.baddbmm_(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), alpha=alpha)


def tiled_backward(dout, q, k, v, mask, out, lse, params: AttentionParams, accumulate_into=None,
                   rules: ScoreRules | None = None):
    """dq, dk, dv for `tiled_forward`, recomputing score tiles from the saved lse.

    accumulate_into: optional (dq, dk, dv) in the compute dtype, of q, k, v's shapes,
    any strides: the gradients are added into them, and they are returned.
    The sinks' gradient is not here: it needs only lse, dout and out (`masks.sinks_grad`).
    """
    accumulate_into = check_accumulators(accumulate_into, q, k, v)
    if q.numel() == 0:  # no query row: no gradient reaches k or v
        if accumulate_into is not None:
            return accumulate_into
        return torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    ctx = TileContext(q, k, mask, params, rules, backward=True)
    q5, do5 = grouped(q, ctx.heads_k), grouped(dout, ctx.heads_k)
    delta5 = grouped((dout.to(ctx.dtype) * out.to(ctx.dtype)).sum(-1, keepdim=True), ctx.heads_k)
    # A row with no allowed key has lse = -inf; +inf makes its P = exp(s - inf) = 0.
    lse = torch.where(lse == float("-inf"), float("inf"), lse.to(ctx.dtype))
    lse5 = grouped(lse.unsqueeze(-1), ctx.heads_k)
    if accumulate_into is None:
        dq, dk, dv = (torch.zeros(x.shape, dtype=ctx.dtype, device=q.device) for x in (q, k, v))
    else:
        dq, dk, dv = accumulate_into
    dq5 = grouped(dq, ctx.heads_k)
    for cols in spans(0, ctx.len_k, ctx.block_n):
        c = slice(cols.start, cols.stop)
        k_tile, v_tile = k[:, :, c].to(ctx.dtype), v[:, :, c].to(ctx.dtype)
        # dK and dV of this key tile gather in contiguous tiles (one batched GEMM a product: into a
        # strided slice of dk the CPU's baddbmm runs a GEMM per head)
        dk_tile, dv_tile = torch.zeros_like(k_tile), torch.zeros_like(v_tile)
        for rows in ctx.query_spans(cols):
            q_tile, do_tile = ctx.stack(q5, rows), ctx.stack(do5, rows)
            softcap_grad = ctx.softcap_grad_tile((*q_tile.shape[:-1], len(cols)))
            probs = ctx.scores(q_tile, k_tile, rows, cols, softcap_grad)
            exp_(probs.sub_(ctx.stack(lse5, rows)))
            weights = ctx.dropout_weights(rows, cols)
            dropped = probs if weights is None else probs * weights
            add_matmul_(dv_tile, dropped.transpose(-1, -2), do_tile)
            dprobs = ctx.product(do_tile, v_tile.transpose(-1, -2))
            if weights is not None:
                dprobs.mul_(weights)
            dscores = probs.mul_(dprobs.sub_(ctx.stack(delta5, rows)))  # unscaled: the GEMMs below scale
            if softcap_grad is not None:
                dscores.mul_(softcap_grad)
            dq5[..., rows.start:rows.stop, :] += ctx.unstack(ctx.product(dscores, k_tile, params.scale), rows)
            add_matmul_(dk_tile, dscores.transpose(-1, -2), q_tile, params.scale)
        dk[:, :, c] += dk_tile
        dv[:, :, c] += dv_tile
    if accumulate_into is not None:
        return accumulate_into
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
