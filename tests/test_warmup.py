"""`exattn.warmup` and `exattn warmup`: argument checks, the job loop with fake kernels on the CPU,
and one run on a CUDA GPU (-m gpu)."""

from __future__ import annotations

import dataclasses
import importlib
from collections import Counter

import pytest
import torch

import exattn
from exattn.cli import main

warmup_module = importlib.import_module("exattn.warmup")  # `exattn.warmup` is the function
ROW_KEYS = {"kind", "dtype", "head_dim", "length", "causal", "heads", "kv_heads", "seconds"}
NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@pytest.fixture
def fake_cuda(monkeypatch):
    """Two CUDA devices as far as the checks can tell; returns the devices synchronized."""
    synchronized = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronized.append(device))
    return synchronized


class FakeKernels:
    """Stands in for exattn.attention and exattn.decode: records each call, returns CPU tensors."""

    def __init__(self, monkeypatch):
        self.calls = []
        monkeypatch.setattr(exattn, "attention", self.attention)
        monkeypatch.setattr(exattn, "decode", self.decode)

    def attention(self, q, k, v, **flags):
        self.calls.append(("attention", *shapes(q, k, v), q.dtype, sorted(flags.items()),
                           all(x.requires_grad for x in (q, k, v))))
        out = q * 1
        if out.requires_grad:
            out.register_hook(lambda grad: self.calls.append(("backward", tuple(grad.shape), grad.dtype)))
        return out

    def decode(self, q, k_cache, v_cache, **flags):
        self.calls.append(("decode", *shapes(q, k_cache, v_cache), q.dtype, sorted(flags.items())))
        return q.clone()

    def counted(self) -> Counter:
        return Counter(repr(call) for call in self.calls)


def shapes(*tensors) -> tuple:
    return tuple(tuple(t.shape) for t in tensors)


def expected_calls(dtypes, head_dims, lengths, causal, heads, kv_heads, batch, backward, decode) -> Counter:
    calls = []
    for dtype in dtypes:
        for d in head_dims:
            for n in lengths:
                kv = (batch, kv_heads, n, d)
                for c in causal:
                    calls.append(("attention", (batch, heads, n, d), kv, kv, dtype,
                                  [("backend", "triton"), ("causal", c)], backward))
                    calls += [("backward", (batch, heads, n, d), dtype)] if backward else []
                for validate in (True, False) if decode else ():
                    calls.append(("decode", (batch, heads, 1, d), kv, kv, dtype,
                                  [("backend", "triton"), ("validate", validate)]))
    return Counter(repr(call) for call in calls)


GOOD = dict(head_dims=(64, 128), dtypes=(torch.bfloat16,), lengths=(1024,), heads=16, kv_heads=4)


def test_good_arguments_pass_the_checks(fake_cuda):
    plan = warmup_module.warmup_plan(**GOOD)
    assert plan.kv_heads == 4 and plan.device == torch.device("cuda")


@pytest.mark.parametrize("change, error, message", [
    (dict(head_dims=(64, 0)), ValueError, "head_dims must be a positive int, got 0"),
    (dict(head_dims=(64.0,)), TypeError, "head_dims must be a positive int, got 64.0 (float)"),
    (dict(head_dims=(True,)), TypeError, "head_dims must be a positive int, got True (bool)"),
    (dict(head_dims=(512,)), ValueError, "head_dims must be at most 256 (the Triton kernels' limit), got 512"),
    (dict(head_dims=()), ValueError, "head_dims must hold at least one value, got ()"),
    (dict(dtypes=("bf16",)), TypeError, "dtypes must hold torch dtypes (torch.float16, torch.bfloat16 or "
                                        "torch.float32), got 'bf16' (str)"),
    (dict(dtypes=(torch.float64,)), ValueError, "dtypes must hold torch.float16, torch.bfloat16 or torch.float32, "
                                                "got torch.float64"),
    (dict(lengths=(1024, -1)), ValueError, "lengths must be a positive int, got -1"),
    (dict(lengths="1024"), TypeError, "lengths must be a positive int, got '1024' (str)"),
    (dict(lengths=[]), ValueError, "lengths must hold at least one value"),
    (dict(heads=0), ValueError, "heads must be a positive int, got 0"),
    (dict(heads=16.0), TypeError, "heads must be a positive int, got 16.0 (float)"),
    (dict(kv_heads=3), ValueError, "heads (16) must be a multiple of kv_heads (3)"),
    (dict(kv_heads=0), ValueError, "kv_heads must be a positive int, got 0"),
    (dict(batch=0), ValueError, "batch must be a positive int, got 0"),
    (dict(causal=("yes",)), TypeError, "causal must be a bool, got 'yes' (str)"),
    (dict(causal=()), ValueError, "causal must hold at least one value"),
    (dict(backward=1), TypeError, "backward must be a bool, got 1 (int)"),
    (dict(decode=None), TypeError, "decode must be a bool, got None (NoneType)"),
    (dict(device="cpu"), ValueError, "device must be a CUDA device such as 'cuda' or 'cuda:0': warmup compiles "
                                     "the GPU kernels; got 'cpu'"),
    (dict(device=torch.device("cpu")), ValueError, "device must be a CUDA device"),
    (dict(device="gpu"), ValueError, "device must be a CUDA device such as 'cuda' or 'cuda:0'"),
    (dict(device="cuda:2"), ValueError, "device='cuda:2': there are 2 CUDA devices (indices 0..1)"),
    (dict(progress="print"), TypeError, "progress must be callable or None, got str"),
])
def test_bad_arguments_are_refused_by_name(change, error, message, fake_cuda):
    with pytest.raises(error) as info:
        exattn.warmup(**{**GOOD, **change})
    assert message in str(info.value)
    assert not fake_cuda  # nothing ran


def test_no_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device='cuda': no CUDA device is available .*warmup compiles the GPU"):
        exattn.warmup(**GOOD)


def test_missing_triton_is_refused(fake_cuda, monkeypatch):
    monkeypatch.setattr("exattn.backends.triton.triton_importable", lambda: False)
    with pytest.raises(ImportError, match=r"triton is not installed \(pip install 'exattn\[triton\]'\)"):
        exattn.warmup(**GOOD)


def test_warmup_runs_the_checked_plan(fake_cuda, monkeypatch):
    seen = []
    monkeypatch.setattr(warmup_module, "run_jobs", lambda plan, progress: seen.append((plan, progress)) or ["row"])

    progress = [].append  # any callable: the test checks it is handed on as it is

    rows = exattn.warmup(head_dims=64, dtypes=[torch.float16, torch.float16], lengths=range(1, 3), heads=8,
                         kv_heads=2, causal=True, device="cuda:1", progress=progress)
    assert rows == ["row"]
    assert seen == [(warmup_module.WarmupPlan(
        head_dims=(64,), dtypes=(torch.float16,), lengths=(1, 2), heads=8, kv_heads=2, batch=1, causal=(True,),
        backward=True, decode=True, device=torch.device("cuda:1")), progress)]


@pytest.mark.parametrize("args", [
    dict(head_dims=(16, 32), dtypes=(torch.bfloat16, torch.float16), lengths=(16, 48), heads=4, kv_heads=2,
         batch=2, causal=(False, True), backward=True, decode=True),
    dict(head_dims=(8,), dtypes=(torch.float32,), lengths=(1, 17), heads=3, kv_heads=None, batch=1,
         causal=(True,), backward=False, decode=False),
    dict(head_dims=(8,), dtypes=(torch.float16,), lengths=(5,), heads=6, kv_heads=1, batch=3,
         causal=(False,), backward=False, decode=True),
])
def test_every_combination_runs_with_its_shapes_and_flags(args, fake_cuda, monkeypatch):
    kernels = FakeKernels(monkeypatch)
    plan = dataclasses.replace(warmup_module.warmup_plan(**args), device=torch.device("cpu"))
    reported = []
    rows = warmup_module.run_jobs(plan, progress=reported.append)

    kv_heads = args["kv_heads"] or args["heads"]
    assert kernels.counted() == expected_calls(
        args["dtypes"], args["head_dims"], args["lengths"], args["causal"], args["heads"], kv_heads,
        args["batch"], args["backward"], args["decode"])
    jobs = [("prefill", c) for c in args["causal"]] + ([("decode", None)] if args["decode"] else [])
    expected_rows = [dict(kind=kind, dtype=NAMES[dtype], head_dim=d, length=n, causal=c, heads=args["heads"],
                          kv_heads=kv_heads)
                     for dtype in args["dtypes"] for d in args["head_dims"] for n in args["lengths"]
                     for kind, c in jobs]
    assert reported == rows
    assert all(set(row) == ROW_KEYS and row["seconds"] >= 0 for row in rows)
    assert Counter(repr({k: v for k, v in row.items() if k != "seconds"}) for row in rows) == Counter(
        repr(row) for row in expected_rows)
    assert fake_cuda == [torch.device("cpu")] * len(rows)  # one synchronize per job


# ---------------------------------------------------------------- the command

@pytest.mark.parametrize("argv, message", [
    (["warmup", "--device", "cpu"], "--device must be cuda or cuda:INDEX (warmup compiles the GPU kernels), got 'cpu'"),
    (["warmup", "--dtypes", "bf16,fp8"], "argument --dtypes: --dtypes must hold fp32, fp16 or bf16, got 'fp8'"),
    (["warmup", "--lengths", "1024,0"], "argument --lengths: --lengths must hold positive integers, got '0'"),
    (["warmup", "--head-dims", "64,x"], "argument --head-dims: --head-dims must hold positive integers, got 'x'"),
    (["warmup", "--heads", "0"], "argument --heads: must be a positive int, got '0'"),
    (["warmup", "--causal", "maybe"], "argument --causal: invalid choice: 'maybe'"),
    (["warmup", "--heads", "16", "--kv-heads", "3"], "heads (16) must be a multiple of kv_heads (3)"),
    (["warmup", "--head-dims", "512"], "head_dims must be at most 256"),
])
def test_command_refuses_bad_arguments(argv, message, fake_cuda, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_command_refuses_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        main(["warmup", "--head-dims", "128", "--lengths", "4096"])
    assert exit_info.value.code == 2
    assert ("--device cuda: no CUDA device is available (torch.cuda.is_available() is False); warmup compiles "
            "the GPU kernels and needs one") in capsys.readouterr().err


def test_command_passes_its_flags_and_prints_each_row(fake_cuda, monkeypatch, capsys):
    plans = []

    def fake_run(plan, progress):
        plans.append(plan)
        rows = [dict(kind="prefill", dtype="fp16", head_dim=128, length=4096, causal=True, heads=16, kv_heads=4,
                     seconds=2.5),
                dict(kind="decode", dtype="fp16", head_dim=128, length=4096, causal=None, heads=16, kv_heads=4,
                     seconds=0.25)]
        for row in rows:
            progress(row)
        return rows

    monkeypatch.setattr(warmup_module, "run_jobs", fake_run)
    code = main(["warmup", "--head-dims", "128,64", "--dtypes", "fp16,bf16", "--lengths", "4096,512", "--heads", "16",
                 "--kv-heads", "4", "--batch", "2", "--causal", "yes", "--no-backward", "--device", "cuda:1"])
    assert code == 0
    assert plans == [warmup_module.WarmupPlan(
        head_dims=(128, 64), dtypes=(torch.float16, torch.bfloat16), lengths=(4096, 512), heads=16, kv_heads=4,
        batch=2, causal=(True,), backward=False, decode=True, device=torch.device("cuda:1"))]
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("prefill fp16 d=128 N=4096") and "causal" in lines[0] and lines[0].endswith("2.50 s")
    assert lines[1].startswith("decode  fp16 d=128 N=4096") and lines[1].endswith("0.25 s")
    assert lines[2].startswith("total: 2 jobs in ") and "Triton's cache" in lines[2]


def test_command_defaults_match_the_function(fake_cuda, monkeypatch):
    plans = []
    monkeypatch.setattr(warmup_module, "run_jobs", lambda plan, progress: plans.append(plan) or [])
    assert main(["warmup"]) == 0
    assert plans == [warmup_module.warmup_plan()]


# ---------------------------------------------------------------- on a GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_warmup_compiles_and_runs_on_the_gpu():
    reported = []
    rows = exattn.warmup(head_dims=(64,), dtypes=(torch.bfloat16,), lengths=(256,), heads=4, kv_heads=2, batch=2,
                         progress=reported.append)
    assert reported == rows
    assert [(row["kind"], row["causal"]) for row in rows] == [("prefill", False), ("prefill", True),
                                                               ("decode", None)]
    for row in rows:
        assert set(row) == ROW_KEYS
        assert (row["dtype"], row["head_dim"], row["length"], row["heads"], row["kv_heads"]) == ("bf16", 64, 256, 4, 2)
        assert row["seconds"] > 0
