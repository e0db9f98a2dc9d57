"""`exattn.warmup`: compile the GPU kernels ahead of time, into Triton's on-disk cache.

The first call of a new shape family compiles exattn's Triton kernels, which takes seconds.
Triton specializes a kernel on its integer arguments (divisible by 16? equal to 1? for head
counts, lengths and strides; not for tile counts, `configs.COUNTS`) and on constexprs picked
from the length, so a warmup reaches the cache only with the model's own head counts, head dim,
dtype and sequence lengths.
Compiled kernels land in TRITON_CACHE_DIR (default ~/.triton/cache), where every later
process finds them.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

import exattn
from exattn.problem import check_bool

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass(frozen=True)
class WarmupPlan:
    """Validated `warmup` arguments, kv_heads resolved."""

    head_dims: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    lengths: tuple[int, ...]
    heads: int
    kv_heads: int
    batch: int
    causal: tuple[bool, ...]
    backward: bool
    decode: bool
    device: torch.device

    def jobs(self) -> Iterator[tuple[str, torch.dtype, int, int, bool | None]]:
        """(kind, dtype, head_dim, length, causal) for every row, causal None for decode."""
        for dtype in self.dtypes:
            for head_dim in self.head_dims:
                for length in self.lengths:
                    for causal in self.causal:
                        yield "prefill", dtype, head_dim, length, causal
                    if self.decode:
                        yield "decode", dtype, head_dim, length, None


# ---------------------------------------------------------------- validation

def positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return int(value)


def kernel_head_dim(name: str, value: object) -> int:
    from .backends.triton import MAX_HEAD_DIM

    head_dim = positive_int(name, value)
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"{name} must be at most {MAX_HEAD_DIM} (the Triton kernels' limit), got {head_dim}")
    return head_dim


def kernel_dtype(name: str, value: object) -> torch.dtype:
    expected = "torch.float16, torch.bfloat16 or torch.float32"
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must hold torch dtypes ({expected}), got {value!r} ({type(value).__name__})")
    if value not in DTYPE_NAMES:
        raise ValueError(f"{name} must hold {expected}, got {value}")
    return value


def values_of(name: str, value: object, check: Callable[[str, object], object]) -> tuple:
    """A lone value or an iterable of them, each through `check`; duplicates dropped, never empty."""
    many = isinstance(value, Iterable) and not isinstance(value, (str, bytes))
    values = tuple(value) if many else (value,)
    if not values:
        raise ValueError(f"{name} must hold at least one value, got {value!r}")
    return tuple(dict.fromkeys(check(name, v) for v in values))


def resolve_kv_heads(heads: int, kv_heads: object) -> int:
    kv = heads if kv_heads is None else positive_int("kv_heads", kv_heads)
    if heads % kv:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv}): query head h reads "
                         f"key/value head h // (heads // kv_heads)")
    return kv


def cuda_device(device: object) -> torch.device:
    wanted = "a CUDA device such as 'cuda' or 'cuda:0': warmup compiles the GPU kernels"
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be {wanted}; got {device!r}") from None
    if resolved.type != "cuda":
        raise ValueError(f"device must be {wanted}; got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: no CUDA device is available (torch.cuda.is_available() is False); "
                         "warmup compiles the GPU kernels and needs one")
    count = torch.cuda.device_count()
    if resolved.index is not None and resolved.index >= count:
        raise ValueError(f"device={device!r}: there are {count} CUDA devices (indices 0..{count - 1})")
    return resolved


def check_triton_installed() -> None:
    from .backends.triton import triton_importable

    if not triton_importable():
        raise ImportError("warmup compiles exattn's Triton kernels, but triton is not installed "
                          "(pip install 'exattn[triton]')")


def warmup_plan(*, head_dims=(64, 128), dtypes=(torch.bfloat16,), lengths=(1024, 2048, 4096), heads=16,
                kv_heads=None, batch=1, causal=(False, True), backward=True, decode=True,
                device="cuda") -> WarmupPlan:
    """`warmup`'s arguments checked (TypeError or ValueError naming the argument); nothing runs."""
    heads = positive_int("heads", heads)
    plan = WarmupPlan(
        head_dims=values_of("head_dims", head_dims, kernel_head_dim),
        dtypes=values_of("dtypes", dtypes, kernel_dtype),
        lengths=values_of("lengths", lengths, positive_int),
        heads=heads,
        kv_heads=resolve_kv_heads(heads, kv_heads),
        batch=positive_int("batch", batch),
        causal=values_of("causal", causal, check_bool),
        backward=check_bool("backward", backward),
        decode=check_bool("decode", decode),
        device=cuda_device(device),
    )
    check_triton_installed()
    return plan


# ---------------------------------------------------------------- running

def random_input(plan: WarmupPlan, heads: int, length: int, head_dim: int, dtype: torch.dtype,
                 requires_grad: bool = False) -> torch.Tensor:
    return torch.randn(plan.batch, heads, length, head_dim, dtype=dtype, device=plan.device,
                       requires_grad=requires_grad)


def run_prefill(plan: WarmupPlan, dtype: torch.dtype, head_dim: int, length: int, causal: bool) -> None:
    q = random_input(plan, plan.heads, length, head_dim, dtype, plan.backward)
    k, v = (random_input(plan, plan.kv_heads, length, head_dim, dtype, plan.backward) for _ in range(2))
    # Through the package, so what compiles is exactly what a user's call runs.
    out = exattn.attention(q, k, v, causal=causal, backend="triton")
    if plan.backward:
        out.backward(torch.randn_like(out))


def run_decode(plan: WarmupPlan, dtype: torch.dtype, head_dim: int, length: int) -> None:
    q = random_input(plan, plan.heads, 1, head_dim, dtype)
    k_cache, v_cache = (random_input(plan, plan.kv_heads, length, head_dim, dtype) for _ in range(2))
    for validate in (True, False):  # VALIDATE is a constexpr: two compilations
        exattn.decode(q, k_cache, v_cache, backend="triton", validate=validate)


def run_job(plan: WarmupPlan, kind: str, dtype: torch.dtype, head_dim: int, length: int,
            causal: bool | None) -> float:
    """Seconds for one job, inputs made, run and freed, the device synchronized."""
    start = time.perf_counter()
    if kind == "prefill":
        run_prefill(plan, dtype, head_dim, length, causal)
    else:
        run_decode(plan, dtype, head_dim, length)
    torch.cuda.synchronize(plan.device)
    return time.perf_counter() - start


def run_jobs(plan: WarmupPlan, progress: Callable[[dict], object] | None = None) -> list[dict]:
    """`warmup`'s rows for a checked plan."""
    rows = []
    for kind, dtype, head_dim, length, causal in plan.jobs():
        seconds = run_job(plan, kind, dtype, head_dim, length, causal)
        row = dict(kind=kind, dtype=DTYPE_NAMES[dtype], head_dim=head_dim, length=length, causal=causal,
                   heads=plan.heads, kv_heads=plan.kv_heads, seconds=seconds)
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows


def warmup(*, head_dims=(64, 128), dtypes=(torch.bfloat16,), lengths=(1024, 2048, 4096), heads=16,
           kv_heads=None, batch=1, causal=(False, True), backward=True, decode=True, device="cuda",
           progress=None) -> list[dict]:
    """Compile exattn's GPU kernels for these shapes ahead of time, into Triton's on-disk cache.

    Pass the model's own head counts, head dim, dtypes and sequence lengths: Triton specializes
    the kernels on them, so only those shapes hit the cache (TRITON_CACHE_DIR, default
    ~/.triton/cache) in later processes. For every dtype x head_dim x length x causal this runs
    `exattn.attention(q, k, v, causal=causal, backend="triton")` on random inputs, q (batch, heads,
    length, head_dim) and k, v (batch, kv_heads, length, head_dim), then its backward if
    `backward`. If `decode`, for every dtype x head_dim x length it also runs `exattn.decode` of one
    new token, q (batch, heads, 1, head_dim), over caches (batch, kv_heads, length, head_dim), with
    validate=True and validate=False. Each job's inputs are freed and the device synchronized
    before the next.

    Args:
        head_dims: positive ints <= 256 (D = Dv). A lone value is taken as one.
        dtypes: among torch.float16, torch.bfloat16, torch.float32.
        lengths: sequence lengths N (prefill Nq = Nk = N; decode: cache of N keys).
        heads: query heads Hq. kv_heads: key/value heads Hk dividing Hq (default Hq).
        batch: batch size B.
        causal: bools; prefill runs once for each.
        backward, decode: bools, as above.
        device: a CUDA device ("cuda", "cuda:1", torch.device).
        progress: called with each row as soon as it is done.

    Returns:
        One dict per job: kind ("prefill" or "decode"), dtype ("fp16", "bf16" or "fp32"), head_dim,
        length, causal (None for decode), heads, kv_heads, seconds (wall time, compilation
        included; near the run time alone when the cache already held the kernels).

    Raises:
        TypeError, ValueError: an argument is of the wrong type or value (the message names it),
            or no CUDA device is available.
        ImportError: triton is not installed.
    """
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be callable or None, got {type(progress).__name__}")
    plan = warmup_plan(head_dims=head_dims, dtypes=dtypes, lengths=lengths, heads=heads, kv_heads=kv_heads,
                       batch=batch, causal=causal, backward=backward, decode=decode, device=device)
    return run_jobs(plan, progress)
