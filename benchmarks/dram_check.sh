#!/usr/bin/env bash
# One device call (~2 min on the H200): measured DRAM bytes (Nsight Compute) next to the modeled traffic.
#
#   bash benchmarks/dram_check.sh
#
# Run from the repository root (exattn is not installed there: PYTHONPATH=src).
# 1. where ncu is and its version; 2. one run measured by hand, printing ncu's
# raw output (what to read if the sweep's rows say dram_error); 3. a small
# `exattn experiment --dram` sweep (triton vs the naive baseline, bf16, N = 1024
# and 4096, two tiles); 4. modeled vs measured bytes per run; everything in
# $OUT/dram and $OUT/dram.tgz.
set -u
OUT=${OUT:-/tmp/exattn-dram}
mkdir -p "$OUT"
export PYTHONPATH=src
START=$(date +%s)
stamp() { echo "[$(( $(date +%s) - START ))s] $*"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

stamp "ncu"
NCU=$(python3 -c "from exattn.experiment.dram import find_ncu; print(find_ncu() or '')")
if [ -z "$NCU" ]; then
    echo "ncu: NOT FOUND (PATH=$PATH)"; ls -d /opt/nvidia/nsight-compute/* 2>&1
    exit 1
fi
echo "ncu: found at $NCU"
"$NCU" --version | tail -1

stamp "one run under ncu, raw output"
timeout 120 python3 - > "$OUT/ncu-smoke.log" 2>&1 <<'EOF'
from exattn.experiment import dram
from exattn.experiment.workload import RunSpec

spec = RunSpec(phase="prefill", impl="triton", dtype="bf16", seq_len=1024, causal=False, dropout_p=0.0,
               block_m=64, block_n=64, batch=1, heads=2, heads_k=2, head_dim=64, seed=0, device="cuda")
ncu = dram.find_ncu()
command = dram.ncu_command(ncu, spec)
print("command:", " ".join(command))
outcome = dram.run_ncu(command, timeout=90)
print("exit status:", outcome.returncode)
print("---- stdout (first 40 lines) ----")
print("\n".join(outcome.stdout.splitlines()[:40]))
print("---- stderr (last 40 lines) ----")
print("\n".join(outcome.stderr.splitlines()[-40:]))
print("---- parsed ----")
print(dram.read_outcome(outcome, dram.ncu_version(ncu)))
EOF
echo "smoke exit $?"
cat "$OUT/ncu-smoke.log"
if ! grep -q "'dram_bytes'" "$OUT/ncu-smoke.log"; then
    echo "---- the smoke run was not measured; ncu options this version knows ----"
    "$NCU" --help 2>&1 | grep -E -- "--(csv|print-units|print-metric-name|profile-from-start|launch-count|cache-control|clock-control|metrics) " 
fi

stamp "experiment --dram"
timeout 170 python3 -m exattn.cli experiment --device cuda --dram --backends triton \
    --seq-lens 1024,4096 --tiles 64x64,128x64 --dtypes bf16 --phases prefill --causal off --dropout 0 \
    --repeats 3 --memory-timeout 60 --out "$OUT/dram" > "$OUT/experiment.log" 2>&1
echo "experiment exit $?"
tail -12 "$OUT/experiment.log"

stamp "modeled vs measured"
python3 - "$OUT/dram/results.json" <<'EOF'
import json, sys
from exattn.experiment.traffic import Shape, io_bytes

MIB = 2**20
data = json.load(open(sys.argv[1]))
print("dram_measured:", data["meta"]["dram_measured"])
print(f"{'N':>5} {'impl':>6} {'tile':>7} {'status':>6} {'model MiB':>10} {'DRAM MiB':>9} {'read':>8} "
      f"{'write':>8} {'meas/model':>10} {'io-once MiB':>11} {'kernels':>7}  error")
for r in data["rows"]:
    shape = Shape(r["batch"], r["heads"], r["len_q"], r["len_k"], r["head_dim"], r["head_dim"],
                  2 if r["dtype"] in ("bf16", "fp16") else 4, r["causal"])
    once = io_bytes(shape, backward=r["phase"] == "prefill") / MIB
    got = r.get("dram_bytes")
    mib = lambda key: f"{r[key] / MIB:8.2f}" if r.get(key) is not None else f"{'-':>8}"
    ratio = f"{got / r['traffic_model_bytes']:10.3f}" if got is not None else f"{'-':>10}"
    print(f"{r['seq_len']:>5} {r['impl']:>6} {r['tile']:>7} {r['status']:>6} {r['traffic_model_bytes'] / MIB:10.2f} "
          f"{mib('dram_bytes'):>9} {mib('dram_read_bytes')} {mib('dram_write_bytes')} {ratio} {once:11.2f} "
          f"{r.get('dram_kernels', '-')!s:>7}  {r.get('dram_error', '')} {r.get('note', '')}")
EOF
sed -n '/## What was found/,/## Plots/p' "$OUT/dram/report.md"

tar czf "$OUT/dram.tgz" -C "$OUT" dram experiment.log ncu-smoke.log
stamp "done: $OUT/dram.tgz"
