"""The naive backend: the textbook formula in the input dtype, materializing (B, Hq, Nq, Nk).

It is the baseline the error rule compares against: what a user gets by
writing `softmax(q k^T * scale) v` in their own dtype.
"""

from __future__ import annotations

import torch

from ..dropout import keep_tile
from ..problem import AttentionProblem
from ..reference import apply_dropout, dense_scores, row_lse, softmax_rows


class NaiveBackend:
    name = "naive"

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        return []

    def run(self, problem: AttentionProblem) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, params = problem.q, problem.k, problem.v, problem.params
        mask = problem.mask
        if mask is not None and mask.is_floating_point():
            mask = mask.to(q.dtype)
        rules = problem.rules
        scores = dense_scores(q, k, params.scale, params.window, mask, rules, params.softcap)
        sinks = None if rules is None or rules.sinks is None else rules.sinks.to(scores.dtype)
        keep = None
        if params.dropout_p > 0:  # on the problem's own grid, or a padded one (params.dropout_grid)
            batch, rows, cols = params.dropout_layout(problem.batch, problem.len_q, problem.len_k)
            shape = (batch.stop, problem.heads_q, rows, cols)
            keep = keep_tile(params.seed, params.dropout_p, shape, batch, range(problem.heads_q),
                             range(problem.len_q), range(problem.len_k), q.device)
        weights = apply_dropout(softmax_rows(scores, sinks), keep, params.dropout_p)
        group = problem.group
        out = torch.matmul(weights, v.repeat_interleave(group, dim=1))
        lse = row_lse(scores.detach().to(torch.float32), None if sinks is None else rules.sinks.detach())
        return out, lse
