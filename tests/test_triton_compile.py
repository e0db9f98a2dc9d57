"""The Triton kernels (prefill and decode) compiled for sm_90 on the CPU, from the arguments the
host launches pass.

The interpreter (tests/test_triton_backend.py) runs the kernels' Python semantics,
not Triton's compiler; this module catches what only compilation rejects (types
of helpers' results, constexpr use, TMA descriptors) without a GPU. Under the
interpreter `triton.jit` gives functions the compiler does not take, so each case
compiles in a fresh Python process without TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
from triton.runtime.jit import mangle_type

from exattn.backends.triton import decode_kernel, passes
from exattn.problem import AttentionParams, ScoreRules

KERNELS = {"forward": "attention_forward_kernel", "delta": "attention_delta_kernel",
           "dkdv": "attention_dkdv_kernel", "dq": "attention_dq_kernel"}
DECODE_KERNELS = {"decode-split": "decode_split_kernel", "decode-combine": "decode_combine_kernel"}
POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.bool: "*i1",
                 torch.int32: "*i32"}


class RecordedLaunch:
    """Stands in for a Triton kernel: `kernel[grid](*args, **kwargs)` records the arguments."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def recorded_launches(params: AttentionParams, mask, use_tma: bool, rows: int = 300, dim: int = 96,
                      alibi: bool = False) -> dict:
    """{kind: (args, kwargs)} of one forward and one backward of the Triton passes on CPU tensors, `rows`
    query rows, head dim `dim`, GQA 2:1, with ALiBi or no rule (for a throwaway process: the kernels in
    `passes` stay replaced by recorders)."""
    recorders = {kind: RecordedLaunch() for kind in KERNELS}
    for kind, name in KERNELS.items():
        setattr(passes, name, recorders[kind])
    passes.can_use_tma = lambda *tensors: use_tma
    torch.manual_seed(0)
    q = torch.randn(2, 4, rows, dim, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 211, dim, dtype=torch.bfloat16) for _ in range(2))
    rules = ScoreRules(alibi_slopes=torch.rand(2, 4)) if alibi else None
    out, lse = passes.launch_forward(q, k, v, mask, params, rules=rules)
    passes.launch_backward(out, q, k, v, mask, out, lse, params, rules=rules)
    return {kind: recorder.calls[0] for kind, recorder in recorders.items()}


def recorded_decode_launches(paged: bool, merge_in_split: bool = False, page_stride: int | None = None,
                             rules: bool = False, validate: bool = False, num_splits: int = 3) -> dict:
    """{kind: (args, kwargs)} of one decode step (2 new tokens, GQA 4:1, d = 96, 3 splits) on CPU
    tensors, contiguous or with 16-key pages, merged by the combine kernel or in the split kernel
    (throwaway process, as `recorded_launches`). `page_stride`: paged caches of that page stride
    (meta tensors, never read: a stride past int32, or 1, which the launch makes a constant).
    `rules`: every score rule on (window, softcap, ALiBi, sinks, left padding); `validate`: the launch records
    invalid lengths and pages."""
    recorders = {kind: RecordedLaunch() for kind in DECODE_KERNELS}
    for kind, name in DECODE_KERNELS.items():
        setattr(decode_kernel, name, recorders[kind])
    q = torch.randn(2, 8, 2, 96, dtype=torch.bfloat16)
    seqlens = torch.tensor([300, 77], dtype=torch.int32)
    if page_stride is not None:
        k = v = torch.empty_strided((40, 2, 16, 96), (page_stride, 16 * 96, 96, 1), dtype=torch.bfloat16, device="meta")
        table = torch.randperm(40, dtype=torch.int32)[:38].reshape(2, 19)
    elif paged:
        k, v = (torch.randn(40, 2, 16, 96, dtype=torch.bfloat16) for _ in range(2))
        table = torch.randperm(40, dtype=torch.int32)[:38].reshape(2, 19)
    else:
        (k, v), table = (torch.randn(2, 2, 304, 96, dtype=torch.bfloat16) for _ in range(2)), None
    config = decode_kernel.default_config(8, 96, 96)._replace(merge_in_split=merge_in_split)
    score_rules = decode_kernel.DecodeRules(
        window_left=100, softcap=30.0, alibi_slopes=torch.rand(8).expand(2, 8), sinks=torch.randn(8),
        leftpad=torch.tensor([5, 40], dtype=torch.int32),
    ) if rules else decode_kernel.NO_RULES
    decode_kernel.decode_forward(q, k, v, seqlens, table, 0.1, num_splits=num_splits, config=config,
                                 rules=score_rules, validate=validate)
    return {kind: recorder.calls[0] for kind, recorder in recorders.items() if recorder.calls}


def compile_for_sm90(kernel, args, kwargs):
    """`kernel` (a triton.jit or gluon.jit function) compiled for sm_90a with the launch's arguments, specialized
    as the JIT specializes them: pointers and integers divisible by 16 get `tt.divisibility` 16,
    integers equal to 1 become constants."""
    kwargs = dict(kwargs)
    options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages", "maxnreg") if name in kwargs}
    values = dict(zip(kernel.arg_names, args))
    values.update(kwargs)
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        value = values[name] if name in values else kernel.signature.parameters[name].default
        if param.is_constexpr or value is None or (type(value) is int and value == 1):
            signature[name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = POINTER_TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, tuple):
            signature[name] = tuple("i64" for _ in value)
        else:
            signature[name] = mangle_type(value)
            if type(value) is int and value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source_type = GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource
    source = source_type(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


CASES = {
    "causal-tma": (AttentionParams(scale=0.1, window=(-1, 0)), False, True),
    "window-mask-dropout-pointers": (AttentionParams(scale=0.1, window=(40, 3), dropout_p=0.1, seed=5), True, False),
    # one query row, a constant the JIT specializes: the dK/dV kernel's head loop, which builds
    # descriptors, must stay out of the pipeliner
    "one-row-alibi-d128-tma": (AttentionParams(scale=0.1), False, True, 1, 128, True),
}
DECODE_CASES = {"decode-contiguous": (False, False), "decode-paged": (True, False),
                "decode-paged-merge-in-split": (True, True),
                "decode-paged-page-stride-past-int32": (True, False, 2**31 + 2 * 16 * 96),
                "decode-paged-page-stride-one": (True, False, 1),
                "decode-paged-rules-validate": (True, False, None, True, True),
                "decode-contiguous-rules-one-split": (False, False, None, True, False, 1),
                "decode-paged-merge-in-split-rules-validate": (True, True, None, True, True)}


def compile_case(case: str) -> dict:
    """{kernel kind: shared-memory bytes} of the four kernels compiled for one case."""
    if case in DECODE_CASES:
        real = {kind: getattr(decode_kernel, name) for kind, name in DECODE_KERNELS.items()}
        launches = recorded_decode_launches(*DECODE_CASES[case])
    else:
        params, with_mask, use_tma, *shape_and_rule = CASES[case]
        mask = torch.randn(2, 1, 300, 211) if with_mask else None
        real = {kind: getattr(passes, name) for kind, name in KERNELS.items()}
        launches = recorded_launches(params, mask, use_tma, *shape_and_rule)
    shared = {}
    for kind, (args, kwargs) in launches.items():
        compiled = compile_for_sm90(real[kind], args, kwargs)
        assert ".target sm_90a" in compiled.asm["ptx"], kind
        shared[kind] = compiled.metadata.shared
    return shared


@pytest.mark.parametrize("case", [*CASES, *DECODE_CASES])
def test_every_kernel_compiles_for_sm90(case):
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, __file__, case], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    shared = json.loads(run.stdout.strip().splitlines()[-1])
    split_only = ["decode-split"]
    expected = {"decode-paged-merge-in-split": split_only, "decode-paged-merge-in-split-rules-validate": split_only,
                "decode-contiguous-rules-one-split": split_only}.get(
        case, sorted(DECODE_KERNELS if case in DECODE_CASES else KERNELS))
    assert sorted(shared) == expected
    assert all(size <= 232448 for size in shared.values()), shared


if __name__ == "__main__":
    print(json.dumps(compile_case(sys.argv[1])))
