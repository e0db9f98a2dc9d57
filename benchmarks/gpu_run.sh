#!/usr/bin/env bash
# The GPU tests, then the canonical GPU benchmarks, on one GPU machine.
#
#   bash benchmarks/gpu_run.sh                       # all steps: tests memory prefill decode ... compiled
#   bash benchmarks/gpu_run.sh prefill decode        # only the steps named
#   SKIP=tests bash benchmarks/gpu_run.sh            # every step but those in SKIP (comma-separated)
#   GPU_TESTS=tests/test_decode_gpu.py bash benchmarks/gpu_run.sh tests   # some test files only
#   PREFILL_ARGS="--dtypes bf16 --head-dims 128" bash benchmarks/gpu_run.sh prefill   # a part of the table
#
# Steps: tests = pytest -m gpu (parallel workers, so kernel compilation overlaps);
# memory = benchmarks/gpu_memory.py; prefill = the prefill table (benchmarks/prefill.py);
# decode = the decode table (benchmarks/decode.py); varlen = packed batches (benchmarks/varlen.py); masks = score rules (benchmarks/masks.py);
# host = host time per call and first-call seconds (benchmarks/host.py); compiled = torch.compile against
# eager (benchmarks/compiled.py). Run from the repository root
# (exattn need not be installed: PYTHONPATH=src). Logs and JSON go to $OUT (default
# /tmp/exattn-gpu); a benchmark run with its canonical flags (no *_ARGS) is also copied
# to benchmarks/results/. GPU_TEST_TIMEOUT (seconds, default 900) bounds the tests;
# PREFILL_ARGS and DECODE_ARGS are appended to those commands (later flags win).
set -u
STEPS="${*:-tests memory prefill decode varlen masks host compiled}"
SKIP=",${SKIP:-},"
OUT=${OUT:-/tmp/exattn-gpu}
mkdir -p "$OUT" benchmarks/results
export PYTHONPATH=src
export NCCL_NVLS_ENABLE=0
START=$(date +%s)
stamp() { echo "[$(( $(date +%s) - START ))s] $*"; }
wanted() { [[ " $STEPS " == *" $1 "* && "$SKIP" != *",$1,"* ]]; }
keep() { [ -z "$2" ] && [ -f "$OUT/$1" ] && cp "$OUT/$1" benchmarks/results/; }  # keep FILE EXTRA_ARGS

for step in $STEPS; do
    case $step in tests|memory|prefill|decode|varlen|masks|host|compiled) ;; *) echo "unknown step '$step'"; exit 2 ;; esac
done

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
    > "$OUT/nvidia-smi.csv" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.backends.cudnn.version())" \
    | tee "$OUT/versions.txt"

if wanted tests; then
    stamp "pytest -m gpu"
    # a kernel that hangs (a semaphore wait that never ends) must not take the whole run;
    # test_transformers_integration.py has no GPU tests and needs a model package
    timeout "${GPU_TEST_TIMEOUT:-900}" python3 -m pytest -m gpu -q -p no:cacheprovider -p no:benchmark -n 14 \
        --durations=8 --ignore=tests/test_transformers_integration.py ${GPU_TESTS:-tests} \
        > "$OUT/pytest-gpu.log" 2>&1
    echo "pytest exit $?" >> "$OUT/pytest-gpu.log"
    tail -25 "$OUT/pytest-gpu.log"
fi

if wanted memory; then
    stamp "memory"
    python3 benchmarks/gpu_memory.py --out "$OUT/gpu-memory-h200.json" > "$OUT/memory.log" 2>&1
    keep gpu-memory-h200.json ""
    tail -3 "$OUT/memory.log"
fi

if wanted prefill; then
    stamp "prefill"
    python3 benchmarks/prefill.py --warmup-ms 10 --rep-ms 30 --rounds 3 --workers 14 --flex-dtypes bf16 \
        --impls exattn-triton,exattn-triton-atomic,sdpa-cudnn,sdpa-flash,sdpa-efficient,flex \
        ${PREFILL_ARGS:-} --out "$OUT/prefill-h200.json" > "$OUT/prefill.log" 2>&1
    keep prefill-h200.json "${PREFILL_ARGS:-}"
    tail -90 "$OUT/prefill.log"
fi

if wanted decode; then
    stamp "decode"
    python3 benchmarks/decode.py --batches 1,8,64 --contexts 1024,2048,4096,8192,16384,32768,65536,131072 \
        --page-sizes 16,256 --impls exattn,sdpa_cudnn,sdpa_flash,flex --rounds 3 --deadline-s 250 \
        ${DECODE_ARGS:-} --out "$OUT/decode-h200.json" > "$OUT/decode.log" 2>&1
    keep decode-h200.json "${DECODE_ARGS:-}"
    tail -40 "$OUT/decode.log"
fi
if wanted varlen; then
    stamp "varlen"
    python3 benchmarks/varlen.py ${VARLEN_ARGS:-} --out "$OUT/varlen-h200.json" > "$OUT/varlen.log" 2>&1
    keep varlen-h200.json "${VARLEN_ARGS:-}"
    tail -20 "$OUT/varlen.log"
fi
if wanted masks; then
    stamp "masks"
    python3 benchmarks/masks.py ${MASKS_ARGS:-} --out "$OUT/masks-h200.json" > "$OUT/masks.log" 2>&1
    keep masks-h200.json "${MASKS_ARGS:-}"
    tail -14 "$OUT/masks.log"
fi
if wanted host; then
    stamp "host"
    python3 benchmarks/host.py --first-call --profile ${HOST_ARGS:-} --out "$OUT/host-h200.json" > "$OUT/host.log" 2>&1
    keep host-h200.json "${HOST_ARGS:-}"
    grep -v "^ " "$OUT/host.log" | head -40
fi
if wanted compiled; then
    stamp "compiled"
    python3 benchmarks/compiled.py ${COMPILED_ARGS:-} --out "$OUT/compiled-h200.json" > "$OUT/compiled.log" 2>&1
    keep compiled-h200.json "${COMPILED_ARGS:-}"
    tail -40 "$OUT/compiled.log"
fi
stamp "done"
