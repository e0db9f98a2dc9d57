"""The Triton backend: fused forward and backward kernels (CUDA, or Triton's CPU interpreter).

`backend="triton"` serves CUDA tensors on sm_80+ GPUs; with TRITON_INTERPRET=1
set before triton is imported it also serves CPU tensors, through the
interpreter (slow: for tests). `"auto"` picks it only on a CUDA device.

Raw passes for ring attention and other callers (no autograd):
`TritonBackend.forward(q, k, v, mask, params) -> (out, lse)` and
`TritonBackend.backward(dout, q, k, v, mask, out, lse, params, accumulate_into=None) -> (dq, dk, dv)`,
which with `accumulate_into=(dq, dk, dv)` (float32) adds into those tensors instead.
Non-default knobs (atomic dQ, TMA, the Gluon forward) live in
`exattn.backends.triton.settings`; see docs/triton.md.
"""

from __future__ import annotations

import functools

import torch

from ...problem import AttentionParams, AttentionProblem
from ..autograd import recomputing_attention
from .configs import MAX_HEAD_DIM, capability_of, interpreting, tile_problems
from .replay import replayable

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Where the Gluon kernels beat the Triton ones on the H200: head dim -> shortest query
# length (bf16/fp16, measured against the Triton kernels in one process, and the prefill
# table in docs/performance.md). Forward: 1.29-1.37x at d = 128 from 1k; at
# d = 64 1.01-1.23x from 4k and, since causal tiles end at row Nq and run in head groups,
# 1.03-1.15x at 1k-2k. Backward: 1.06-1.10x at d = 128
# from 2k, at d = 64 1.06-1.17x from 4k; at 1k
# 1.07-1.25x and 2k 1.25-1.42x, both head dims, bf16 and fp16; bf16 at 512 (two rounds): d = 64
# 1.06-1.17x with the kernel pair and ordered dQ 1.16-1.21x the pair; d = 128 at 512, kernel time (three
# rounds, batch * N = 16k): 1.45x full, 1.41x causal. Shorter lengths: not measured.
GLUON_FORWARD_MIN_LEN = {64: 1, 128: 1}
GLUON_BACKWARD_MIN_LEN = {64: 512, 128: 512}
# Packed batches, by their longest query sequence: at d = 64 the Triton kernels read 1.22-1.52x the Gluon
# backward on documents of 64-1024 tokens (longest 976), the Gluon one 1.11-1.18x theirs at 2048 and
# 0.96-1.11x at 4289 (H200, bf16, 16k tokens, the varlen table's packings). At d = 128 the Gluon backward
# reads 1.12x (full) and 1.32x (causal) the Triton kernels on those documents of 64-1024 tokens (H100).
GLUON_PACKED_BACKWARD_MIN_LEN = {64: 2048, 128: 1}
GLUON_HEAD_DIMS = tuple(GLUON_FORWARD_MIN_LEN)
GLUON_BACKWARD_HEAD_DIMS = tuple(GLUON_BACKWARD_MIN_LEN)
GLUON_TRITON = (3, 6)
MIN_CAPABILITY = (8, 0)
# Score rules the kernels do not apply (they apply segment ids, prefix, softcap, ALiBi and sinks).
KERNELS_LACK = ()


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def device_reasons(device: torch.device) -> list[str]:
    if device.type == "cpu":
        if interpreting():
            return []
        return ["inputs are on the CPU (set TRITON_INTERPRET=1 to run the kernels in the interpreter)"]
    if device.type != "cuda" or torch.version.cuda is None:
        return [f"device {device} is not a CUDA device"]
    if interpreting():
        return []
    capability = capability_of(device)
    if capability < MIN_CAPABILITY:
        return [f"GPU compute capability {capability} is below {MIN_CAPABILITY}"]
    return []


def problem_reasons(problem: AttentionProblem) -> list[str]:
    """Every reason the kernels cannot serve this problem (empty if they can)."""
    rules = getattr(problem, "rules", None)
    mask = problem.mask
    reasons = list(kernel_reasons(problem.q.device, problem.q.dtype, None if mask is None else mask.device,
                                  tuple(rules.in_use()) if rules else ()))
    return reasons + size_reasons(problem.head_dim, problem.value_dim, problem.params.block_m, problem.params.block_n)


def size_reasons(head_dim: int, value_dim: int, block_m: int | None = None, block_n: int | None = None) -> list[str]:
    """Why the kernels cannot take these head dims and tile sizes (symbolic under torch.compile's dynamic
    shapes, so traced there)."""
    reasons = [f"{name}={dim} exceeds {MAX_HEAD_DIM}" for name, dim in (("head dim D", head_dim),
                                                                         ("value dim Dv", value_dim))
               if dim > MAX_HEAD_DIM]
    return reasons + tile_problems(block_m, block_n)


# Under torch.compile: called at trace time rather than traced (Dynamo warns about a cache wrapper it
# traces); its arguments are constants there.
@torch.compiler.assume_constant_result
def kernel_reasons(device: torch.device, dtype: torch.dtype, mask_device: torch.device | None,
                   rules_in_use: tuple[str, ...]) -> tuple[str, ...]:
    """Every reason the kernels cannot serve inputs of this kind, sizes apart (empty if they can)."""
    return reasons_for(device, dtype, mask_device, rules_in_use, interpreting())


@functools.lru_cache(maxsize=256)
def reasons_for(device, dtype, mask_device, rules_in_use, interpret) -> tuple[str, ...]:
    """`kernel_reasons`, cached: it is on every call's host path."""
    if not triton_importable():
        return ("triton is not installed",)
    reasons = device_reasons(device)
    if dtype not in SUPPORTED_DTYPES:
        reasons.append(f"dtype {dtype} is not supported (float16, bfloat16, float32)")
    if mask_device is not None and mask_device != device:
        reasons.append(f"mask is on {mask_device}, not {device}")
    reasons += [f"{name} is not in the Triton kernels yet" for name in rules_in_use if name in KERNELS_LACK]
    return tuple(reasons)


def gluon_usable(q: torch.Tensor, min_len: dict[int, int], len_q: int) -> bool:
    """Whether the Gluon kernels are switched on, written for this Triton, and measured faster for q's
    head dim at this query length (`min_len`: GLUON_FORWARD_MIN_LEN or GLUON_BACKWARD_MIN_LEN); their own
    support checks say whether they serve the inputs."""
    return (backend_settings().use_gluon and q.is_cuda and gluon_length_ok(min_len, q.shape[-1], len_q)
            and gluon_written_for_this_triton())


def gluon_backward_faster(head_dim: int, params: AttentionParams, rules, packing=None) -> bool:
    """Whether the Gluon backward is measured faster than the Triton kernels for these rules and packing
    (`gluon_backward.faster_than_triton`); plain problems: always."""
    from .gluon_backward import backward_rule_bits, faster_than_triton

    return faster_than_triton(backward_rule_bits(params, rules, packing), head_dim)


def gluon_written_for_this_triton() -> bool:
    """Gluon is experimental and its API moves between releases: the kernel is written for 3.6."""
    import triton

    return major_minor(triton.__version__) == GLUON_TRITON


@functools.lru_cache(maxsize=8)
def major_minor(version: str) -> tuple[int, int]:
    """(3, 6) of "3.6.0" or "3.6.1+git1234"."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def gluon_length_ok(min_len: dict[int, int], head_dim: int, len_q: int) -> bool:
    """Whether a Gluon kernel is measured faster for this head dim and query length."""
    return head_dim in min_len and len_q >= min_len[head_dim]


@functools.cache
def backend_settings():
    """`passes.settings`, imported on first use (it imports triton): a function-level import on every
    call would cost the host path microseconds."""
    from .passes import settings

    return settings


def replay_key() -> tuple:
    """What a replayed pass depends on beyond its arguments: the backend's settings."""
    settings = backend_settings()
    return (settings.atomic_dq, settings.ordered_dq, settings.rotated_dq_order, settings.use_tma, settings.use_gluon,
            settings.replay)


def replays(tensor: torch.Tensor, dropout_p: float) -> bool:
    """Whether a pass's launches are replayed (`replay.py`): on CUDA, without dropout (whose seed
    changes every call)."""
    return backend_settings().replay and tensor.is_cuda and dropout_p == 0 and not interpreting()


@replayable(replay_key, lambda q, k, v, mask, params, rules=None: replays(q, params.dropout_p))
def triton_forward(q, k, v, mask, params: AttentionParams, rules=None):
    """Raw forward pass: out (B, Hq, Nq, Dv), lse (B, Hq, Nq) float32 natural log.

    On Hopper at the head dims and lengths of GLUON_FORWARD_MIN_LEN the Gluon kernel
    (`gluon_forward.py`, score rules included) serves what it can; everything else runs the Triton
    forward kernel.
    """
    from .passes import triton_forward as run

    if gluon_usable(q, GLUON_FORWARD_MIN_LEN, q.shape[2]):
        from .gluon_forward import gluon_supports, run_gluon_forward

        if not gluon_supports(q, k, v, mask, params, rules):
            return run_gluon_forward(q, k, v, params, rules)
    return run(q, k, v, mask, params, rules=rules)


@replayable(replay_key, lambda dout, q, k, v, mask, out, lse, params, *rest, **named: replays(q, params.dropout_p))
def triton_backward(dout, q, k, v, mask, out, lse, params: AttentionParams, accumulate_into=None, rules=None):
    """Raw backward pass: dq, dk, dv for `triton_forward`, or added into `accumulate_into`.

    On Hopper at the head dims and lengths of GLUON_BACKWARD_MIN_LEN the Gluon kernels
    (`gluon_backward.py`, deterministic, score rules included; with `settings.atomic_dq` their atomic dQ
    variant where it exists, without rules) serve what they can; everything else runs the Triton kernels.
    """
    from .passes import triton_backward as run

    settings = backend_settings()
    if gluon_usable(q, GLUON_BACKWARD_MIN_LEN, q.shape[2]) and gluon_backward_faster(q.shape[-1], params, rules):
        from . import gluon_backward as gb

        atomic = (settings.atomic_dq and q.shape[-1] in gb.ATOMIC_CONFIGS
                  and not gb.backward_rule_bits(params, rules))
        if not gb.gluon_backward_supports(q, k, v, mask, params, dout, atomic, rules):
            return gb.run_gluon_backward(dout, q, k, v, out, lse, params, accumulate_into, atomic, rules)
    return run(dout, q, k, v, mask, out, lse, params, accumulate_into, rules=rules)


class TritonBackend:
    """Fused Triton kernels; deterministic by default."""

    name = "triton"
    forward = staticmethod(triton_forward)
    backward = staticmethod(triton_backward)

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        return problem_reasons(problem)

    def auto_reasons(self, problem: AttentionProblem) -> list[str]:
        """Extra reasons `"auto"` passes this backend over: the interpreter is for tests only."""
        if problem.q.device.type != "cuda":
            return [f"auto uses triton only on CUDA devices, inputs are on {problem.q.device.type}"]
        return []

    def run(self, problem: AttentionProblem) -> tuple[torch.Tensor, torch.Tensor]:
        reasons = self.not_supported_reasons(problem)
        if reasons:
            raise ValueError(f"backend 'triton' cannot serve these inputs: {'; '.join(reasons)}")
        if torch.compiler.is_compiling():
            from ..custom_ops import compiled_attention

            return compiled_attention(self.name, problem)  # the same passes, opaque to the compiler
        return recomputing_attention(problem, self)


def __getattr__(name: str):
    if name == "settings":
        return backend_settings()
    raise AttributeError(name)
