#!/usr/bin/env bash
# One lent GPU's session, prepared to fit a short lease: versions, the gpu tests, then the GPU
# benchmark's parts in order of value, each in its own process under its own time limit, every
# log and figure under $OUT (or ./gpu-out). Run from the repository root on the GPU machine:
#
#     bash bench/gpu_session.sh [budget seconds, default 450] [stage ...]
#
# The machine has its own Python with torch / triton / transformers but no xgrammar or gguf
# (engine imports both): wheels for them, fetched on a machine with pip access by
# `make gpu-wheels`, travel in .whl/ and are installed into /tmp/site first.
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
deadline=$((SECONDS + ${1:-450}))
only=("${@:2}") # the stages to run (all when none is named)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

# stage NAME CAP_SECONDS CMD...: runs CMD under min(CAP, time left), its output in $OUT/NAME.log.
stage() {
    local name=$1 cap=$2
    shift 2
    if ((${#only[@]})) && [[ " ${only[*]} " != *" $name "* ]]; then return; fi
    local left=$((deadline - SECONDS))
    ((left < cap)) && cap=$left
    if ((cap < 10)); then
        echo "== $name: skipped, $left s left" | tee -a "$OUT/summary.txt"
        return
    fi
    echo "== $name (limit ${cap}s): $*"
    local t0=$SECONDS
    timeout -k 5 "$cap" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log"
    echo "== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    uname -r
    $PY -c 'import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__)'
    nproc
} 2>&1 | tee "$OUT/versions.txt"

if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | tail -3
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -c 'import engine, xgrammar, gguf; print("imports ok")' 2>&1 | tee -a "$OUT/versions.txt"

# Correctness first: every gpu-marked test, a per-test limit so one hang cannot eat the lease.
# Only the files that hold gpu tests: the others import the server (fastapi is not there).
stage gpu_tests 200 $PY -m pytest -m gpu -q -p no:cacheprovider --timeout 100 -rfE --tb=short \
    $(grep -rl "mark.gpu" tests)
# The kernels against the copy bandwidth (attention, fused verification, SGMV LoRA).
stage bench_kernels 90 $PY -m bench.gpu --parts attention,verify,lora --models 1b --quick \
    --json "$OUT/bench_kernels.json"
# The engine: batch-1 decode against the roofline, the sweep against HF on the same GPU.
stage bench_1b 170 $PY -m bench.gpu --parts decode,sweep --models 1b --quick \
    --json "$OUT/bench_1b.json"
stage bench_spec 100 $PY -m bench.gpu --parts spec --models 1b --quick --json "$OUT/bench_spec.json"
stage bench_smollm2 120 $PY -m bench.gpu --parts decode,sweep --models smollm2 --quick \
    --json "$OUT/bench_smollm2.json"
cat "$OUT/summary.txt"
