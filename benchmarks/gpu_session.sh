#!/usr/bin/env bash
# The one script for a GPU device call (issue 4): the GPU tests, then the benchmarks.
#
#   bash benchmarks/gpu_session.sh          # pytest -m gpu, memory check, prefill table
#   bash benchmarks/gpu_session.sh tune     # pytest -m gpu (triton tests), tile sweep, quick prefill
#   bash benchmarks/gpu_session.sh tune-fwd # pytest -m gpu, forward-only sweep, quick prefill (with Flex),
#                                           # decode split sweep at short contexts
#
# Run from the repository root on the device machine (exattn is not installed
# there: PYTHONPATH=src). Logs and JSON go to $OUT (the device tool's folder,
# default /tmp/exattn-gpu) and results to benchmarks/results/. GPU tests run
# in parallel workers (pytest-xdist) so kernel compilation overlaps.
# GPU_TESTS overrides which test paths run (default: every test marked gpu; "none": no tests);
# GPU_TEST_TIMEOUT (seconds, default 900) bounds them.
set -u
MODE=${1:-full}
OUT=${OUT:-/tmp/exattn-gpu}
mkdir -p "$OUT" benchmarks/results
export PYTHONPATH=src
export NCCL_NVLS_ENABLE=0
START=$(date +%s)
stamp() { echo "[$(( $(date +%s) - START ))s] $*"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
    > "$OUT/nvidia-smi.csv" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.backends.cudnn.version())" \
    | tee "$OUT/versions.txt"

TESTS=${GPU_TESTS:-tests}
if [ "$TESTS" != none ]; then
    stamp "pytest -m gpu"
    # a kernel that hangs (a semaphore wait that never ends) must not eat the device call
    # test_transformers_integration.py has no GPU tests, and its model package is not on the device image
    timeout "${GPU_TEST_TIMEOUT:-900}" python3 -m pytest -m gpu -q -p no:cacheprovider -p no:benchmark -n 14 \
        --durations=8 --ignore=tests/test_transformers_integration.py $TESTS > "$OUT/pytest-gpu.log" 2>&1
    echo "pytest exit $?" >> "$OUT/pytest-gpu.log"
    tail -25 "$OUT/pytest-gpu.log"
fi

if [ "$MODE" = tune-fwd ]; then
    stamp "forward sweep"
    python3 benchmarks/triton_tiles.py --kinds fwd --rep-ms 60 --out "$OUT/triton-tiles-fwd.json" \
        > "$OUT/tiles.log" 2>&1
    grep -v "^ *$" "$OUT/tiles.log" | tail -40
    stamp "quick prefill"
    python3 benchmarks/prefill.py --dtypes bf16 --seqlens 4096,8192,16384 --flex-dtypes bf16 \
        --impls exattn-triton,sdpa-cudnn,flex --warmup-ms 15 --rep-ms 60 \
        --out "$OUT/prefill-quick.json" > "$OUT/prefill-quick.log" 2>&1
    tail -30 "$OUT/prefill-quick.log"
    stamp "decode sweep"
    python3 benchmarks/decode.py --no-main --sweep --sweep-default-only --sweep-s 60 \
        --sweep-shapes 1x1024,8x1024,64x1024,1x8192,8x8192 --out "$OUT/decode-short.json" \
        > "$OUT/decode.log" 2>&1
    grep sweep "$OUT/decode.log" | tail -30
elif [ "$MODE" = tune ]; then
    stamp "tile sweep"
    python3 benchmarks/triton_tiles.py --out "$OUT/triton-tiles-h200.json" > "$OUT/tiles.log" 2>&1
    grep -v "^ *$" "$OUT/tiles.log" | tail -80
    stamp "quick prefill"
    python3 benchmarks/prefill.py --dtypes bf16 --seqlens 4096,16384 --flex-dtypes bf16 \
        --out "$OUT/prefill-quick.json" > "$OUT/prefill-quick.log" 2>&1
    tail -45 "$OUT/prefill-quick.log"
else
    stamp "memory"
    python3 benchmarks/gpu_memory.py --out "$OUT/gpu-memory-h200.json" > "$OUT/memory.log" 2>&1
    cp "$OUT/gpu-memory-h200.json" benchmarks/results/
    tail -3 "$OUT/memory.log"
    stamp "prefill"
    python3 benchmarks/prefill.py --warmup-ms 10 --rep-ms 30 --rounds 3 --workers 14 --flex-dtypes bf16 \
        --impls exattn-triton,exattn-triton-atomic,sdpa-cudnn,sdpa-flash,sdpa-efficient,flex \
        --out "$OUT/prefill-h200.json" > "$OUT/prefill.log" 2>&1
    cp "$OUT/prefill-h200.json" benchmarks/results/
    tail -90 "$OUT/prefill.log"
fi
stamp "done"
