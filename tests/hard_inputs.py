"""Inputs built to reach a kernel's rarely taken paths."""

from __future__ import annotations

import torch


def own_key_scores_far_below_the_rest(n_q: int, n_k: int, d: int, dtype: torch.dtype, device="cpu",
                                      own_score=-200.0):
    """q (1, 1, n_q, d), k, v (1, 1, n_k, d) where query i's own key j = i + n_k - n_q scores
    `own_score` times |k_j| (natural units, scale d^-0.5) and the other keys score far higher in
    magnitude. Under window=(0, 0) a row sees only its own key; with n_k - n_q not a multiple of
    the key tile, the tiles a row block loads before a row's own key are fully masked for that row.
    The exact out is v[j], and lse the own scores."""
    k = torch.randn(1, 1, n_k, d, device=device)
    own = k[:, :, n_k - n_q:]
    q = own_score * d ** 0.5 * own / own.norm(dim=-1, keepdim=True)
    v = torch.randn(1, 1, n_k, d, device=device)
    return q.to(dtype), k.to(dtype), v.to(dtype)
