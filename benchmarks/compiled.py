"""torch.compile against eager around exattn on a GPU: milliseconds of one training step.

Two modules, each with exattn (`backend="auto"`: the Triton / Gluon kernels, through the custom
ops under torch.compile) and with SDPA's cuDNN backend in the same process:

- `attention`: causal attention alone, q, k, v (B, H, N, d) in, gradients of q, k, v out;
- `block`: a pre-norm attention block, x (B, N, hidden) -> x + out_proj(attention(rope(q), rope(k), v))
  with q, k, v = qkv_proj(rms_norm(x)); gradients of x and of every parameter.

Each runs eager, under `torch.compile(fullgraph=True)` (inductor) and under
`torch.compile(fullgraph=True, mode="reduce-overhead")` (CUDA graphs). The inputs are marked static
(as a layer inside a compiled model reads its activations in place), so the CUDA graphs copy nothing.
bf16, batch · N = 16k tokens, hidden 2048, d = 128 (H = 16), causal, N = 1k and 4k. A row is the
median over --rounds interleaved rounds of `triton.testing.do_bench` (every other round reversed);
`x_eager` is the same impl's and module's eager median over the row's (above 1: faster than eager).

    PYTHONPATH=src python3 benchmarks/compiled.py --out benchmarks/results/compiled-h200.json
    python3 benchmarks/compiled.py --table benchmarks/results/compiled-h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import interleaved_rounds, result_rows  # noqa: E402

IMPLS = ("exattn", "sdpa-cudnn")
MODULES = ("attention", "block")
MODES = ("eager", "inductor", "reduce-overhead")
TOKENS, HIDDEN, HEAD_DIM = 16384, 2048, 128


def attend(impl: str, q, k, v):
    import exattn

    if impl == "exattn":
        return exattn.attention(q, k, v, causal=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def backend_context(impl: str):
    """SDPA restricted to cuDNN for its rows (compiled graphs choose the kernel when traced)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION]) if impl == "sdpa-cudnn" else contextlib.nullcontext()


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over the last dim (halves rotated, as Llama's `rotate_half`)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class AttentionBlock(torch.nn.Module):
    """x + out(attention(rope(q), rope(k), v)), q, k, v from qkv(rms_norm(x)); causal."""

    def __init__(self, impl: str, seq_len: int, hidden=HIDDEN, head_dim=HEAD_DIM, device="cuda",
                 dtype=torch.bfloat16):
        super().__init__()
        self.impl, self.heads, self.head_dim = impl, hidden // head_dim, head_dim
        linear = {"bias": False, "device": device, "dtype": dtype}
        self.norm = torch.nn.RMSNorm(hidden, device=device, dtype=dtype)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, **linear)
        self.out = torch.nn.Linear(hidden, hidden, **linear)
        angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32),
                             10000.0 ** -(torch.arange(0, head_dim, 2, device=device) / head_dim))
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos().to(dtype), persistent=False)
        self.register_buffer("sin", angles.sin().to(dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, hidden = x.shape
        q, k, v = self.qkv(self.norm(x)).view(batch, seq_len, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = rotary(q, self.cos, self.sin), rotary(k, self.cos, self.sin)
        out = attend(self.impl, q, k, v)
        return x + self.out(out.transpose(1, 2).reshape(batch, seq_len, hidden))


def training_step(impl: str, module: str, seq_len: int, mode: str, seed=0):
    """A callable running one forward + backward of `module` (`MODULES`) under `mode` (`MODES`)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch = TOKENS // seq_len
    if module == "attention":
        heads = HIDDEN // HEAD_DIM
        leaves = [torch.randn(batch, heads, seq_len, HEAD_DIM, device="cuda", generator=g,
                              dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        fn = lambda q, k, v: attend(impl, q, k, v)  # noqa: E731
        inputs, wrt = leaves, leaves
    else:
        block = AttentionBlock(impl, seq_len)
        x = torch.randn(batch, seq_len, HIDDEN, device="cuda", generator=g, dtype=torch.bfloat16,
                        requires_grad=True)
        fn, inputs, wrt = block, [x], [x, *block.parameters()]
    for tensor in inputs:
        torch._dynamo.mark_static_address(tensor)
    if mode != "eager":
        fn = torch.compile(fn, fullgraph=True, mode="reduce-overhead" if mode == "reduce-overhead" else None)
    dout = torch.randn_like(inputs[0])

    def step():
        with backend_context(impl):
            torch.compiler.cudagraph_mark_step_begin()
            return torch.autograd.grad(fn(*inputs), wrt, dout)
    return step


def measure(args) -> list[dict]:
    from triton.testing import do_bench

    rows = []
    for seq_len in args.seqlens:
        torch._dynamo.reset()  # each length traced with static shapes
        names = [(impl, module, mode) for impl in args.impls for module in args.modules for mode in MODES]
        steps = {name: training_step(*name[:2], seq_len, name[2]) for name in names}
        for step in steps.values():
            for _ in range(3):  # compile, record the CUDA graphs, replay
                step()
        samples = interleaved_rounds(names, args.rounds, lambda name: do_bench(steps[name], warmup=25, rep=200),
                                     lambda error: f"failed: {type(error).__name__}: {error}"[:300])
        for row in rows_of(samples, seq_len):
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


def rows_of(samples: dict, seq_len: int) -> list[dict]:
    """One row per (impl, module, mode) of `samples` ({name: ms per round, or a note}): the median, and
    x_eager, the same impl's and module's eager median over it."""
    rows = []
    for impl, module, mode in samples:
        runs, eager = samples[(impl, module, mode)], samples.get((impl, module, "eager"), "no eager row")
        row = dict(impl=impl, module=module, seqlen=seq_len, mode=mode)
        if isinstance(runs, str) or isinstance(eager, str):
            row["note"] = runs if isinstance(runs, str) else f"eager: {eager}"
        else:
            row.update(ms=round(statistics.median(runs), 4), runs_ms=[round(t, 4) for t in runs],
                       x_eager=round(statistics.median(eager) / statistics.median(runs), 3))
        rows.append(row)
    return rows


def format_row(row: dict) -> str:
    head = f"{row['impl']:<11} {row['module']:<9} N={row['seqlen']:<5} {row['mode']:<15}"
    return head + (f" {row['ms']:8.3f} ms  x_eager {row['x_eager']:.3f}" if "ms" in row else f" {row['note']}")


def table(rows: list[dict]) -> str:
    """Markdown: one line per (module, N), ms and x eager per impl and compiled mode."""
    lines = ["| module | N | impl | eager ms | inductor ms (× eager) | reduce-overhead ms (× eager) |",
             "|---|---|---|---|---|---|"]
    cells = {(r["impl"], r["module"], r["seqlen"], r["mode"]): r for r in rows}
    for module, seq_len, impl in sorted({(r["module"], r["seqlen"], r["impl"]) for r in rows}):
        def cell(mode):
            row = cells.get((impl, module, seq_len, mode))
            if row is None or "ms" not in row:
                return "–"
            return f"{row['ms']:.3f}" if mode == "eager" else f"{row['ms']:.3f} ({row['x_eager']:.2f})"
        lines.append(f"| {module} | {seq_len} | {impl} | " + " | ".join(cell(mode) for mode in MODES) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", type=lambda s: s.split(","), default=list(IMPLS))
    p.add_argument("--modules", type=lambda s: s.split(","), default=list(MODULES))
    p.add_argument("--seqlens", type=lambda s: [int(n) for n in s.split(",")], default=[1024, 4096])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/compiled-h200.json"))
    p.add_argument("--table", metavar="FILE", help="print the table of a results file and exit")
    args = p.parse_args(argv)
    unknown = sorted(set(args.impls) - set(IMPLS)) + sorted(set(args.modules) - set(MODULES))
    if unknown:
        p.error(f"unknown impls or modules {unknown}: choose from {IMPLS} and {MODULES}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.table:
        print(table(result_rows(args.table)))
        return
    from prefill import versions

    rows = measure(args)
    meta = dict(versions(), dtype="bf16", tokens=TOKENS, hidden=HIDDEN, head_dim=HEAD_DIM, causal=True,
                rounds=args.rounds)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
