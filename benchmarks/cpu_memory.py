"""Peak RSS growth of attention on the CPU, each variant in its own process.

    python benchmarks/cpu_memory.py [--seq-len 8192] [--heads 8] [--head-dim 64]

Goal (issue 2): tiled forward+backward <= 1/8 of naive's; tiled forward
<= 1.5x torch SDPA's. Each variant is measured twice, in fresh processes:
"cold" (the first call in the process, so one-time library set-up such as
MKL's GEMM buffers counts) and "warm" (after one small call of the same
implementation, at N/16). Writes benchmarks/results/cpu-memory.json.

Each run also records what stays resident after the call returns and its
tensors are freed, split as /proc reports it: file-backed pages (library code
paged in at first use) and anonymous memory (e.g. MKL's GEMM buffers). That
is one-time process set-up (and allocator caches), not the call's working memory; `transient` is the
peak growth minus it. `--trace` instead runs one cold tiled forward and
records, per PyTorch operator, the resident memory its first calls added
(writes cpu-memory-first-call.json).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp

import torch

from common import environment, write_json

VARIANTS = ("naive fwd", "naive fwd+bwd", "tiled fwd", "tiled fwd+bwd", "sdpa fwd", "sdpa fwd+bwd")


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM, Linux). Not getrusage's ru_maxrss: a spawned child
    inherits through exec the peak of the parent it was forked from."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def resident_mib() -> dict[str, float]:
    """RssFile and RssAnon of this process, MiB (Linux)."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("RssFile", "RssAnon"):
                fields[key] = int(value.split()[0]) / 1024
    return fields


def call(variant: str, shape: tuple[int, int, int, int]) -> int:
    import exattn

    b, h, n, d = shape
    backward = variant.endswith("bwd")
    q, k, v = (torch.randn(b, h, n, d, requires_grad=backward) for _ in range(3))
    dout = torch.randn(b, h, n, d)
    impl = variant.split()[0]
    start = peak_rss_bytes()
    if impl == "sdpa":
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    else:
        out = exattn.attention(q, k, v, backend=impl)
    if backward:
        out.backward(dout)
    return start


def run_variant(variant: str, shape: tuple[int, int, int, int], warm: bool, queue) -> None:
    torch.manual_seed(0)
    if warm:
        b, h, n, d = shape
        call(variant, (b, h, max(1, n // 16), d))
    before = resident_mib()
    start = call(variant, shape)  # the peak once the inputs exist, before attention runs
    growth = (peak_rss_bytes() - start) / 2**20
    after = resident_mib()
    kept = {f"kept_{key.lower()}_mib": after[key] - before[key] for key in after}
    queue.put({"peak_rss_growth_mib": growth, **kept,
               "transient_mib": growth - sum(kept.values())})


def in_fresh_process(target, *args):
    """What target(*args, queue) puts on its queue, run in a spawned process."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def measure(variant: str, shape, warm: bool) -> dict[str, float]:
    return in_fresh_process(run_variant, variant, shape, warm)


def trace_first_calls(shape, queue) -> None:
    """Resident MiB each operator adds while a fresh process runs its first tiled forward."""
    from torch.overrides import TorchFunctionMode

    import exattn

    q, k, v = (torch.randn(shape) for _ in range(3))
    added: dict[str, dict[str, float]] = {}

    class Recorder(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            before = resident_mib()
            result = func(*args, **(kwargs or {}))
            name = getattr(func, "__name__", str(func))
            for key, value in resident_mib().items():
                entry = added.setdefault(name, {"RssFile": 0.0, "RssAnon": 0.0})
                entry[key] += max(0.0, value - before[key])
            return result

    with Recorder():
        exattn.attention(q, k, v, backend="tiled")
    queue.put(dict(sorted(added.items(), key=lambda item: -sum(item[1].values()))))


def trace(shape) -> None:
    added = in_fresh_process(trace_first_calls, shape)
    for name, mib in list(added.items())[:15]:
        print(f"{name:>20}: file-backed {mib['RssFile']:5.1f} MiB, anonymous {mib['RssAnon']:5.1f} MiB")
    print(f"total over {len(added)} operators: file-backed {sum(m['RssFile'] for m in added.values()):.1f} MiB, "
          f"anonymous {sum(m['RssAnon'] for m in added.values()):.1f} MiB")
    write_json("cpu-memory-first-call.json", {
        "shape_bhnd": shape, "dtype": "float32", "environment": environment(), "added_mib": added,
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--trace", action="store_true", help="per-operator first-call memory of a cold tiled forward")
    args = parser.parse_args()
    shape = (args.batch, args.heads, args.seq_len, args.head_dim)
    if args.trace:
        trace(shape)
        return
    rows, summary = [], {}
    for state in ("cold", "warm"):
        for variant in VARIANTS:
            result = measure(variant, shape, warm=state == "warm")
            rows.append({"variant": variant, "state": state, **result})
            print(f"{state} {variant:>15}: " + "  ".join(f"{k} {v:8.1f}" for k, v in result.items()))
        for metric in ("peak_rss_growth_mib", "transient_mib"):
            by = {r["variant"]: r[metric] for r in rows if r["state"] == state}
            summary[f"{state} {metric}"] = {
                "tiled_fwdbwd_over_naive_fwdbwd": by["tiled fwd+bwd"] / by["naive fwd+bwd"],
                "tiled_fwd_over_sdpa_fwd": by["tiled fwd"] / by["sdpa fwd"],
            }
    print(json.dumps(summary, indent=2))
    write_json("cpu-memory.json", {
        "shape_bhnd": shape, "dtype": "float32", "device": "cpu",
        "environment": environment(), "rows": rows, "ratios": summary,
    })


if __name__ == "__main__":
    main()
