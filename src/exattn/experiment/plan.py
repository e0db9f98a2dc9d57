"""`exattn plan`: the tiles that minimize modeled traffic under a measured error bound.

The founding document's open question: can tile selection minimize memory
traffic while enforcing a useful worst-case bound on output and gradient
error? The method, on the user's shapes, dtype and device:

1. Candidates: every block_m x block_n given (default: powers of two 16..256),
   clamped to the sequence lengths and deduplicated. A candidate whose
   modeled on-chip footprint exceeds the fast memory is rejected.
2. Rank the rest by modeled traffic, forward + backward (`traffic`).
3. In that order, run each candidate forward and backward on `trials` random
   inputs, and measure the worst relative error (max-abs / max|oracle|)
   of the output and of each of dq, dk, dv against the float64 oracle.
4. The choice is the first candidate whose worst output AND gradient errors
   are within `max_error` (and, if given, within `max_naive_ratio` times the
   naive same-dtype error); the next passing ones are the runners-up.

With `bound="proven"` step 3 runs nothing: each candidate's a-priori bound
(`exattn.bounds.tile_bounds`, docs/error-bound.md) on the output (relative to
max|v|), the lse (absolute) and dv, dq, dk (relative to their normalizers) must be
within `max_error`, for inputs whose scores satisfy `score_bound` (S) and
`score_range` (R). It covers the tiled backend only (float32 compute).

Limits: the traffic is a model; the empirical bound is the worst over the
trials drawn, not a proof for every input; the proven bound is a worst case, so
typically 10-300x above the errors measured on random inputs.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field

from ..bounds import tile_bounds
from .measure import error_stats, ratio
from .oracle import oracle
from .traffic import Shape, default_on_chip_bytes, modeled_traffic, on_chip_footprint
from .workload import DTYPE_BYTES, RunSpec, make_inputs, run_once

DEFAULT_BLOCKS = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class PlanRequest:
    """The user's problem and bound. Prefill: q (B, Hq, Nq, D), k/v (B, Hk, Nk, D)."""

    seq_len: int
    head_dim: int
    dtype: str
    max_error: float
    batch: int = 1
    heads: int = 1
    kv_heads: int | None = None
    causal: bool = False
    max_naive_ratio: float | None = None
    tiles: tuple[tuple[int, int], ...] = tuple(itertools.product(DEFAULT_BLOCKS, DEFAULT_BLOCKS))
    trials: int = 2
    runners_up: int = 3
    device: str = "cpu"
    backend: str = "tiled"
    on_chip_bytes: int | None = None
    seed: int = 0
    naive_max_len: int = 8192
    bound: str = "empirical"
    score_bound: float | None = None
    score_range: float | None = None


@dataclass
class Candidate:
    tile: str
    block_m: int
    block_n: int
    traffic_model_bytes: int
    on_chip_bytes: int
    out_err_rel: float | None = None
    grad_err_rel: float | None = None
    out_err_ratio_naive: float | None = None
    grad_err_ratio_naive: float | None = None
    out_bound: float | None = None
    lse_bound: float | None = None
    grad_bound: float | None = None
    verdict: str = "not measured (a lower-traffic candidate already qualified)"


@dataclass
class PlanResult:
    request: dict
    on_chip_bytes: int
    on_chip_source: str
    naive: dict
    choice: Candidate | None
    runners_up: list[Candidate] = field(default_factory=list)
    candidates: list[Candidate] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def run_spec(req: PlanRequest, impl: str, block_m: int | None, block_n: int | None, trial: int) -> RunSpec:
    return RunSpec(
        phase="prefill", impl=impl, dtype=req.dtype, seq_len=req.seq_len, causal=req.causal,
        dropout_p=0.0, block_m=block_m, block_n=block_n, batch=req.batch, heads=req.heads,
        heads_k=req.kv_heads or req.heads, head_dim=req.head_dim, seed=req.seed + trial, device=req.device,
    )


def candidates(req: PlanRequest, fast_bytes: int) -> list[Candidate]:
    """Clamped, deduplicated tiles with modeled traffic and footprint, lowest traffic first."""
    shape = Shape(req.batch, req.heads, req.seq_len, req.seq_len, req.head_dim, req.head_dim,
                  DTYPE_BYTES[req.dtype], req.causal)
    tiles = dict.fromkeys((min(m, req.seq_len), min(n, req.seq_len)) for m, n in req.tiles)
    out = []
    for m, n in tiles:
        footprint = on_chip_footprint(m, n, req.head_dim, req.head_dim, DTYPE_BYTES[req.dtype])
        traffic = modeled_traffic(shape, m, n, "prefill")["traffic_model_bytes"]
        cand = Candidate(f"{m}x{n}", m, n, traffic, footprint)
        if footprint > fast_bytes:
            cand.verdict = f"rejected: needs {footprint:,} B on chip > {fast_bytes:,} B"
        out.append(cand)
    return sorted(out, key=lambda c: (c.traffic_model_bytes, -c.block_m * c.block_n))


def worst_errors(req: PlanRequest, impl: str, block_m, block_n, trials: list) -> dict:
    """Worst relative and max-abs errors over the trials (each trial: inputs and oracle)."""
    worst: dict = {}
    for trial, (inputs, ref) in enumerate(trials):
        out, grads = run_once(run_spec(req, impl, block_m, block_n, trial), inputs)
        for key, value in error_stats(out, grads, ref).items():
            worst[key] = worse(worst.get(key, 0.0), value)
    return worst


def worse(a: float, b: float) -> float:
    """max that keeps NaN: a NaN error must fail the bound, not vanish."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def judge(cand: Candidate, errors: dict, naive: dict, req: PlanRequest) -> bool:
    cand.out_err_rel, cand.grad_err_rel = errors["out_err_rel"], errors["grad_err_rel"]
    cand.out_err_ratio_naive = ratio(errors["out_err_max_abs"], naive.get("out_err_max_abs"))
    cand.grad_err_ratio_naive = ratio(errors["grad_err_max_abs"], naive.get("grad_err_max_abs"))
    reasons = []
    if not cand.out_err_rel <= req.max_error:
        reasons.append(f"output error {cand.out_err_rel:.2e} > {req.max_error:g}")
    if not cand.grad_err_rel <= req.max_error:
        reasons.append(f"gradient error {cand.grad_err_rel:.2e} > {req.max_error:g}")
    if req.max_naive_ratio is not None:
        for name, value in (("output", cand.out_err_ratio_naive), ("gradient", cand.grad_err_ratio_naive)):
            if value is None or not value <= req.max_naive_ratio:
                reasons.append(f"{name} error {value if value is None else f'{value:.2f}'}x naive "
                               f"> {req.max_naive_ratio:g}x")
    cand.verdict = "meets the bound" if not reasons else "rejected: " + "; ".join(reasons)
    return not reasons


def check_proven(req: PlanRequest) -> None:
    if req.bound not in ("empirical", "proven"):
        raise ValueError(f"bound: expected 'empirical' or 'proven', got {req.bound!r}")
    if req.bound == "proven":
        if req.backend != "tiled":
            raise ValueError(f"bound='proven' covers the tiled backend only, got backend {req.backend!r}: the "
                             "Triton kernels round P to the input dtype and accumulate on tensor cores "
                             "(docs/error-bound.md); use bound='empirical'")
        if req.score_bound is None or not req.score_bound > 0:
            raise ValueError("bound='proven' needs score_bound S > 0 with S >= scale * sum_d |q_id| |k_jd| "
                             "for every pair (S = scale * max|q_i|_2 * max|k_j|_2 will do)")


def judge_proven(cand: Candidate, req: PlanRequest) -> bool:
    """Accept the candidate iff its a-priori bounds on out, lse and dv/dq/dk are within max_error."""
    group = req.heads // (req.kv_heads or req.heads)
    b = tile_bounds(cand.block_m, cand.block_n, req.seq_len, req.seq_len, req.head_dim, req.dtype,
                    req.score_bound, req.score_range, group)
    cand.out_bound, cand.lse_bound, cand.grad_bound = b["out"], b["lse"], max(b["dv"], b["dq"], b["dk"])
    reasons = [f"proven {name} bound {value:.2e} > {req.max_error:g}"
               for name, value in (("output", cand.out_bound), ("lse", cand.lse_bound),
                                   ("gradient", cand.grad_bound)) if not value <= req.max_error]
    cand.verdict = "proven within the bound" if not reasons else "rejected: " + "; ".join(reasons)
    return not reasons


def plan_proven(req: PlanRequest, ranked: list[Candidate], result: PlanResult) -> PlanResult:
    """Every fitting candidate gets its bound (a formula: cheap); the lowest-traffic passing ones win."""
    for cand in ranked:
        if cand.verdict.startswith("rejected"):
            continue
        if judge_proven(cand, req):
            if result.choice is None:
                result.choice = cand
            elif len(result.runners_up) < req.runners_up:
                result.runners_up.append(cand)
    return result


def plan_tiles(req: PlanRequest, progress=None) -> PlanResult:
    """Choose the lowest-traffic tile whose measured (or proven) errors meet the bound (module doc)."""
    check_proven(req)
    fast_bytes, source = (req.on_chip_bytes, "--on-chip-bytes") if req.on_chip_bytes \
        else default_on_chip_bytes(req.device)
    ranked = candidates(req, fast_bytes)
    if req.bound == "proven":
        return plan_proven(req, ranked, PlanResult(asdict(req), fast_bytes, source, {}, None, candidates=ranked))
    trials = []
    for trial in range(req.trials):
        inputs = make_inputs(run_spec(req, "naive", None, None, trial))
        trials.append((inputs, oracle(run_spec(req, "naive", None, None, trial), inputs)))
    naive = {}
    if req.seq_len <= req.naive_max_len:
        naive = worst_errors(req, "naive", None, None, trials)
    result = PlanResult(asdict(req), fast_bytes, source, naive, None, candidates=ranked)
    for cand in ranked:
        if cand.verdict.startswith("rejected"):
            continue
        if result.choice is not None and len(result.runners_up) >= req.runners_up:
            break
        if progress:
            progress(cand.tile)
        if judge(cand, worst_errors(req, req.backend, cand.block_m, cand.block_n, trials), naive, req):
            if result.choice is None:
                result.choice = cand
            else:
                result.runners_up.append(cand)
    return result


def describe(result: PlanResult) -> str:
    """The plan as text: choice, runners-up, and the evidence table."""
    req = result.request
    if req.get("bound") == "proven":
        return describe_proven(result)
    lines = [
        f"exattn plan: B={req['batch']} Hq={req['heads']} Hk={req['kv_heads'] or req['heads']} "
        f"N={req['seq_len']} D={req['head_dim']} {req['dtype']} {'causal' if req['causal'] else 'not causal'}, "
        f"backend {req['backend']} on {req['device']}",
        f"Bound: relative error (max-abs / max|oracle|) <= {req['max_error']:g} for the output and each of "
        f"dq, dk, dv" + (f", and <= {req['max_naive_ratio']:g}x the naive error" if req['max_naive_ratio'] else "")
        + f"; worst over {req['trials']} random trial(s).",
        f"On-chip memory for the traffic model: {result.on_chip_bytes:,} B ({result.on_chip_source}).",
    ]
    if result.naive:
        lines.append(f"Naive {req['dtype']} baseline: output error {result.naive['out_err_rel']:.2e}, "
                     f"gradient error {result.naive['grad_err_rel']:.2e} (relative).")
    if result.choice is None:
        lines.append("NO candidate met the bound (see the evidence below).")
    else:
        c = result.choice
        lines.append(f"Choice: block_m={c.block_m} block_n={c.block_n}: modeled traffic "
                     f"{c.traffic_model_bytes / 2**20:.2f} MiB, output error {c.out_err_rel:.2e}, "
                     f"gradient error {c.grad_err_rel:.2e}.")
        for r in result.runners_up:
            lines.append(f"Runner-up: {r.tile}: {r.traffic_model_bytes / 2**20:.2f} MiB, "
                         f"output {r.out_err_rel:.2e}, gradient {r.grad_err_rel:.2e}.")
    lines += ["", "Evidence (lowest modeled traffic first; traffic is a MODEL, errors are measured):",
              f"{'tile':>9} {'traffic MiB':>12} {'on-chip B':>10} {'out rel':>9} {'grad rel':>9} "
              f"{'out xnaive':>10} {'grad xnaive':>11}  verdict"]
    for c in result.candidates:
        lines.append(f"{c.tile:>9} {c.traffic_model_bytes / 2**20:>12.2f} {c.on_chip_bytes:>10,} "
                     f"{fmt(c.out_err_rel):>9} {fmt(c.grad_err_rel):>9} {fmt(c.out_err_ratio_naive, 2):>10} "
                     f"{fmt(c.grad_err_ratio_naive, 2):>11}  {c.verdict}")
    lines.append("Limits: the bound is empirical (worst over the trials, random normal inputs), "
                 "not a guarantee for every input; traffic is modeled, not measured.")
    return "\n".join(lines)


def describe_proven(result: PlanResult) -> str:
    """The proven-mode plan: the bounds are formulas (docs/error-bound.md); nothing was run."""
    req = result.request
    spread = req["score_range"] if req["score_range"] is not None else 2 * req["score_bound"]
    lines = [
        f"exattn plan --bound proven: B={req['batch']} Hq={req['heads']} Hk={req['kv_heads'] or req['heads']} "
        f"N={req['seq_len']} D={req['head_dim']} {req['dtype']}, tiled backend (float32 compute)",
        f"Bound (proven a priori, for every input with scale*sum|q||k| <= S = {req['score_bound']:g} and row score "
        f"range <= R = {spread:g}): |out - o| / max|v| <= {req['max_error']:g}, |lse error| <= "
        f"{req['max_error']:g}, and dv, dq, dk within {req['max_error']:g} of their normalizers "
        "(docs/error-bound.md). Rounding of the inputs to the dtype is not included.",
        f"On-chip memory for the traffic model: {result.on_chip_bytes:,} B ({result.on_chip_source}).",
    ]
    if result.choice is None:
        lines.append("NO candidate has a proven bound within --max-error (see the table below).")
    else:
        c = result.choice
        lines.append(f"Choice: block_m={c.block_m} block_n={c.block_n}: modeled traffic "
                     f"{c.traffic_model_bytes / 2**20:.2f} MiB, proven output bound {c.out_bound:.2e}, "
                     f"lse {c.lse_bound:.2e}, gradient {c.grad_bound:.2e}.")
        lines += [f"Runner-up: {r.tile}: {r.traffic_model_bytes / 2**20:.2f} MiB, output bound {r.out_bound:.2e}."
                  for r in result.runners_up]
    lines += ["", "Bounds (lowest modeled traffic first; traffic is a MODEL, bounds are proven, nothing was run):",
              f"{'tile':>9} {'traffic MiB':>12} {'on-chip B':>10} {'out bound':>10} {'lse bound':>10} "
              f"{'grad bound':>10}  verdict"]
    for c in result.candidates:
        lines.append(f"{c.tile:>9} {c.traffic_model_bytes / 2**20:>12.2f} {c.on_chip_bytes:>10,} "
                     f"{fmt(c.out_bound):>10} {fmt(c.lse_bound):>10} {fmt(c.grad_bound):>10}  {c.verdict}")
    lines.append("Limits: a worst-case bound, typically 10-300x above errors measured on random inputs; the "
                 "scores (S) and the output and fp16/bf16 rounding usually dominate it, not the tiles.")
    return "\n".join(lines)


def fmt(value, digits: int | None = None) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if digits else f"{value:.2e}"
