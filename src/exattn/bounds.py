"""A-priori bounds on the rounding error of the tiled backend (derivation: docs/error-bound.md).

The error is that of `backend="tiled"` against the exact attention of the SAME
inputs in their stored dtype (float64 oracle); rounding the user's data to
fp16/bf16 is not included. Computation is in float32 (float64 for float64
inputs). With u the compute unit roundoff, u_o that of the output dtype (0 when
it is the compute dtype), T = ceil(Nk / block_n) key tiles, and the user's bounds

    S >= scale * sum_d |q_id| |k_jd|    (every allowed pair; S <= scale max|q_i|_2 max|k_j|_2)
    R >= max_j s_ij - min_j s_ij        (allowed keys of a row; R <= 2 S, the default)

every key's weight reaches l and u perturbed by a factor within exp(+-tau_j):

    tau_j = E_s + gamma_3 g_j + T lg(kappa u) + (block_n + 2 T) lg(u),
    E_s = gamma_{D+2} S,  g_j = max_k s_k - s_j,  lg(x) = -log(1 - x),

and, with w the exact softmax weights and the convex chord over g in [0, R + 2 E_s],
E = sum_j w_j (exp(tau_j) - 1) <= (e^a - 1) + G (e^{a + b Gmax} - e^a) / Gmax,
G = min(R, ln Nk) + 2 E_s (the mean gap is at most the entropy, ln Nk). Then

    |out_ic - o_ic| <= [(2E / (1 - E)) (1 + u) + u] (1 + u_o) + u_o  times  max_j |v_jc|
    |lse_i - lse*_i| <= -log(1 - E) + kappa u (ln Nk + E_s - log(1 - E)) + u (S + ln Nk + ...)
    |dV_jc - dV*_jc| <= [expm1(tau_P + (G_h block_m + T_m) lg(u)) (1 + u_o) + u_o] sum_i P_ij |dO_ic|

where tau_P = E_s + E_lse + gamma_3 (R + ln Nk + E_s + E_lse) + lg(kappa u) bounds the
recomputed P's relative error; dQ and dK are bounded relative to
scale * W_i * max_j |k_jc| and scale * max_i |q_ic| * sum_i P_ij W_i, W_i = sum_c |dO_ic| max_j |v_jc|.

Assumptions (tested in tests/test_bounds.py): exp2 and log have relative error
<= kappa u (KAPPA = 4: two ulps, the larger of what CUDA documents for exp2f/logf and
PyTorch's CPU SLEEF routines for exp/log (one ulp), so one bound holds on either device) and exp2(0) = 1; the GEMMs accumulate their
products in any order and add the accumulator C once (C <- C + A B); float32
matmuls are IEEE float32 (no TF32); no overflow; underflow adds the absolute
terms `floor_*`. Dropout is not covered.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

KAPPA = 4.0
UNIT_ROUNDOFF = {"fp64": 2.0**-53, "fp32": 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8}
SMALLEST_NORMAL = {"fp64": 2.0**-1022, "fp32": 2.0**-126}
DTYPE_NAMES = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
DEFAULT_VALUE_FLOOR = 2.0**-64


def dtype_name(dtype) -> str:
    """'fp32', 'fp16', 'bf16' or 'fp64' for a torch dtype or one of those names."""
    name = DTYPE_NAMES.get(dtype, dtype)
    if name not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype: expected fp64, fp32, fp16 or bf16, got {dtype!r}")
    return name


def gamma(n: float, u: float) -> float:
    """gamma_n = n u / (1 - n u): the classical bound on n roundings; inf when n u >= 1."""
    return n * u / (1.0 - n * u) if n * u < 1.0 else math.inf


def log_rounding(n: float, u: float) -> float:
    """-n log(1 - u): |log prod_{k<=n} (1 + delta_k)| for |delta_k| <= u."""
    return -n * math.log1p(-u)


@dataclass(frozen=True)
class Precision:
    """Unit roundoffs of the computation (u), of the output dtype (u_out) and the underflow level."""

    u: float
    u_out: float
    tiny: float

    @classmethod
    def of(cls, dtype) -> Precision:
        name = dtype_name(dtype)
        compute = "fp64" if name == "fp64" else "fp32"
        u_out = 0.0 if name == compute else UNIT_ROUNDOFF[name]
        return cls(UNIT_ROUNDOFF[compute], u_out, SMALLEST_NORMAL[compute])


@dataclass(frozen=True)
class ForwardBound:
    """out: |out - o| <= out * max_j|v_jc| per column c; lse: absolute; weight_error: E above;
    terms: first-order contributions to `out`, by source (for reports)."""

    out: float
    lse: float
    weight_error: float
    score_error: float
    terms: dict


@dataclass(frozen=True)
class BackwardBound:
    """Each gradient's error relative to its normalizer (module doc); floors are absolute."""

    dv: float
    dq: float
    dk: float
    recomputed_p: float
    floor_dv: float
    floor_dq: float
    floor_dk: float


def score_error(head_dim: int, score_bound: float, p: Precision) -> float:
    """|fl(scale q.k) - scale q.k| <= gamma_{D+2} S: D products and sums, the scale's rounding and product."""
    return gamma(head_dim + 2, p.u) * score_bound


def mean_weight_error(a: float, b: float, mean_gap: float, max_gap: float) -> float:
    """sum_j w_j (exp(a + b g_j) - 1) for mean gap <= mean_gap, gaps in [0, max_gap] (convex chord)."""
    if max_gap <= 0:
        return math.expm1(a)
    return math.expm1(a) + mean_gap * (math.exp(a + b * max_gap) - math.exp(a)) / max_gap


def forward_bound(block_n: int, len_k: int, head_dim: int, dtype, score_bound: float,
                  score_range: float | None = None, value_floor: float = DEFAULT_VALUE_FLOOR) -> ForwardBound:
    """Bound on the tiled forward's output (relative to max|v| per column) and lse (absolute).

    block_n: key tile; len_k: keys per row (Nk); head_dim: D of q and k; dtype: the inputs';
    score_bound: S; score_range: R (default 2 S); value_floor: a lower bound on max|v| (underflow term).
    """
    p = Precision.of(dtype)
    tiles = math.ceil(len_k / block_n)
    e_s = score_error(head_dim, score_bound, p)
    spread = 2.0 * score_bound if score_range is None else min(score_range, 2.0 * score_bound)
    a_exp = tiles * log_rounding(1, KAPPA * p.u)
    a_sum = log_rounding(block_n + 2 * tiles, p.u)
    a = e_s + a_exp + a_sum
    b = gamma(3, p.u)
    mean_gap = min(spread, math.log(len_k)) + 2 * e_s
    growth = math.exp(e_s)
    underflow = 2 * len_k * (3 * tiles + 2) * p.tiny * growth
    e = mean_weight_error(a, b, mean_gap, spread + 2 * e_s) + underflow
    if e >= 1:
        return ForwardBound(math.inf, math.inf, e, e_s, {})
    before_cast = (2 * e / (1 - e)) * (1 + p.u) + p.u + 2 * len_k * p.tiny * growth / (1 - e) / value_floor
    out = before_cast * (1 + p.u_out) + p.u_out
    log_l = math.log(len_k) + e_s - math.log1p(-e)
    lse_pre = -math.log1p(-e) + KAPPA * p.u * log_l
    lse = lse_pre + p.u * (score_bound + math.log(len_k) + lse_pre)
    terms = {"scores": 2 * e_s, "exp of the gaps": 2 * b * mean_gap, "exp roundings (incl. rescales)": 2 * a_exp,
             "sums of l and u": 2 * a_sum, "division": p.u, "output rounding": p.u_out}
    return ForwardBound(out, lse, e, e_s, terms)


def backward_bound(block_m: int, block_n: int, len_q: int, len_k: int, head_dim: int, dtype,
                   score_bound: float, score_range: float | None = None, group: int = 1,
                   value_dim: int | None = None) -> BackwardBound:
    """Bounds on the tiled backward's dV, dQ, dK (module doc), with the forward's lse and out bounds.

    group: query heads per K/V head (G_h); value_dim: Dv (default head_dim).
    """
    p = Precision.of(dtype)
    dv_dim = value_dim or head_dim
    fwd = forward_bound(block_n, len_k, head_dim, dtype, score_bound, score_range)
    spread = 2.0 * score_bound if score_range is None else min(score_range, 2.0 * score_bound)
    e_s, e_lse = fwd.score_error, fwd.lse
    max_gap = spread + math.log(len_k) + e_s + e_lse
    tau_p = e_s + e_lse + gamma(3, p.u) * max_gap + log_rounding(1, KAPPA * p.u)
    q_tiles, k_tiles = math.ceil(len_q / block_m), math.ceil(len_k / block_n)
    dv = math.expm1(tau_p + log_rounding(group * block_m + q_tiles, p.u)) * (1 + p.u_out) + p.u_out
    e_dp = gamma(dv_dim, p.u)
    e_delta = fwd.out + e_dp * (1 + fwd.out)
    e_diff = (e_dp + e_delta) * (1 + p.u) + 2 * p.u
    tau_ds = tau_p + log_rounding(3, p.u)
    e_ds = e_diff * math.exp(tau_ds) + 2 * math.expm1(tau_ds)

    def through_gemm(length: int) -> float:
        return (e_ds + math.expm1(log_rounding(length, p.u)) * (2 + e_ds)) * (1 + p.u_out) + 2 * p.u_out

    floor = 4 * p.tiny * (1 + p.u_out)
    return BackwardBound(dv=dv, dq=through_gemm(block_n + k_tiles), dk=through_gemm(group * block_m + q_tiles),
                         recomputed_p=math.expm1(tau_p), floor_dv=floor * len_q, floor_dq=floor * len_k,
                         floor_dk=floor * len_q)


def tile_bounds(block_m: int, block_n: int, len_q: int, len_k: int, head_dim: int, dtype,
                score_bound: float, score_range: float | None = None, group: int = 1) -> dict:
    """Every bound for one tile: out, lse, dv, dq, dk (as defined above) and the forward's terms."""
    fwd = forward_bound(block_n, len_k, head_dim, dtype, score_bound, score_range)
    bwd = backward_bound(block_m, block_n, len_q, len_k, head_dim, dtype, score_bound, score_range, group)
    return {"out": fwd.out, "lse": fwd.lse, "dv": bwd.dv, "dq": bwd.dq, "dk": bwd.dk, "terms": fwd.terms}


def score_statistics(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> dict:
    """S and R of module doc, measured on full (unmasked) inputs q (B, Hq, Nq, D), k (B, Hk, Nk, D).

    A helper for tests and small analyses (it forms the Nq x Nk matrices); a user with
    norms at hand can take S = scale * max|q_i|_2 * max|k_j|_2 instead.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    q64, k64 = q.detach().double(), k.detach().double().repeat_interleave(group, dim=1)
    abs_scores = scale * q64.abs() @ k64.abs().transpose(-1, -2)
    scores = scale * q64 @ k64.transpose(-1, -2)
    spread = (scores.amax(-1) - scores.amin(-1)).max()
    return {"score_bound": float(abs_scores.max()), "score_range": float(spread)}


def as_dict(bound) -> dict:
    return asdict(bound)
