"""Peak GPU memory of one forward beyond its output and lse (issue 4's check), with SDPA as the anchor.

B=1, H=16, N=65536, D=128, bf16, non-causal and causal. For each implementation:
extra = max_memory_allocated during the forward - memory before it - bytes of
out (and lse, for exattn). The check: extra <= 1% of the inputs' bytes (q, k, v).

    PYTHONPATH=src python3 benchmarks/gpu_memory.py --out benchmarks/results/gpu-memory-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import exattn  # noqa: E402

MIB = 2**20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=65536)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/gpu-memory-h200.json"))
    return p.parse_args(argv)


def implementations(causal):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel([backend]):
                return (F.scaled_dot_product_attention(q, k, v, is_causal=causal),)
        return run

    return {
        "exattn-triton": lambda q, k, v: exattn.attention(q, k, v, causal=causal, backend="triton",
                                                          return_lse=True),
        "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
    }


def extra_bytes(fn, q, k, v) -> tuple[int, int]:
    """(peak bytes beyond the inputs and the returned tensors, bytes returned)."""
    with torch.no_grad():
        fn(q, k, v)  # compile and create handles outside the measurement
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        results = fn(q, k, v)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    returned = sum(r.numel() * r.element_size() for r in results)
    return peak - before - returned, returned


def main(argv=None):
    args = parse_args(argv)
    shape = (args.batch, args.heads, args.seqlen, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    input_bytes = 3 * q.numel() * q.element_size()
    rows = []
    for causal in (False, True):
        for name, fn in implementations(causal).items():
            try:
                extra, returned = extra_bytes(fn, q, k, v)
                row = dict(impl=name, causal=causal, extra_mib=extra / MIB, returned_mib=returned / MIB,
                           input_mib=input_bytes / MIB, extra_fraction=extra / input_bytes, error=None)
            except Exception as exc:
                row = dict(impl=name, causal=causal, extra_mib=None, error=f"{type(exc).__name__}: {exc}")
            rows.append(row)
            print(json.dumps(row), flush=True)
    ours = [r for r in rows if r["impl"] == "exattn-triton" and r["error"] is None]
    passed = bool(ours) and all(r["extra_fraction"] <= 0.01 for r in ours)
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "shape": list(shape), "dtype": "bfloat16", "date": time.strftime("%Y-%m-%d"),
            "check": "exattn extra <= 1% of input bytes", "passed": passed}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"memory check {'PASSED' if passed else 'FAILED'}: "
          + ", ".join(f"causal={int(r['causal'])} extra {r['extra_mib']:.2f} MiB "
                      f"({100 * r['extra_fraction']:.3f}% of {r['input_mib']:.0f} MiB inputs)" for r in ours))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
