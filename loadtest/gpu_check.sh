#!/usr/bin/env bash
# GPU check, in one command on a machine with an NVIDIA GPU and this repo: `bash loadtest/gpu_check.sh`
#
# 1. A Python with a CUDA torch, in this order of preference: $VENV (default .venv-gpu; never .venv) if
#    its torch sees CUDA; else, when the system python's torch does, a venv over the system packages
#    (--system-site-packages, plus a .pth file when that python is itself a venv, so its torch is reused:
#    `==2.13.0` accepts 2.13.0+cuXXX) + `make install VENV=$VENV`, or when that fails or pip's index does
#    not answer, the system python itself with PYTHONPATH=. when it has what the tests need; else
#    `make install VENV=$VENV`, then torch==2.13.0 from $TORCH_CUDA_INDEX_URL if its torch is a CPU build.
#    Nothing is installed when pip's index ($PIP_INDEX_URL, default PyPI) does not answer.
# 2. The model: $MODEL_DIR as it is, else `make model`; with only its small files there (config,
#    tokenizer, chat template: no weights), a random-weight stand-in (loadtest/random_model.py): the
#    token-exact tests and throughput still mean something, the bf16 "Paris" check is skipped.
# 3. pytest -m gpu tests/gpu and the Triton kernels against the reference (tests/engine/test_triton_kernels.py).
# 4. W1 on cuda, 1 repeat (python -m loadtest.bench_engine); 5. the decode-step latency sweep, batch
#    1-256, with CUDA graphs and, at batch 1 and 64, without (python -m loadtest.decode_sweep).
# 6. A summary with the targets. Outputs go to $OUT if set, else reports/gpu/ (not reports/, whose CPU
#    engine_throughput.* it would overwrite); everything runs under a deadline of $BUDGET_S (540) s.
#
# Knobs (environment): OUT, BUDGET_S, VENV, PYTHON (the system python), MODEL_DIR, BENCH_ENGINES
# (native,hf,vllm), SWEEP_ARGS, BENCH_ARGS (extra options), CONVERT_MODEL=0 (never run make model),
# GPU_CHECK_DEVICE=cpu (a dry run without a GPU, e.g. with BENCH_ARGS=--quick).
# Exit status: 0 when the GPU tests, the benchmark and the sweep all succeeded.
set -euo pipefail
cd "$(dirname "$0")/.."

BUDGET_S=${BUDGET_S:-540}
VENV=${VENV:-.venv-gpu}
SYS_PY=${PYTHON:-python3}
MODEL_DIR=${MODEL_DIR:-models/smollm2-135m-instruct}
OUT_DIR=${OUT:-reports/gpu}
BENCH_ENGINES=${BENCH_ENGINES:-native,hf,vllm}
read -r -a BENCH_ARGS <<<"${BENCH_ARGS:-}"
CONVERT_MODEL=${CONVERT_MODEL:-1}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOG="$OUT_DIR/gpu_check.log"
: >"$LOG"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1

say() { printf '[gpu-check %3ds] %s\n' "$SECONDS" "$*" | tee -a "$LOG" >&2; }
die() { say "ERROR: $*"; exit 1; }
# seconds left before the deadline, keeping $1 s for the steps after this one, capped at $2
budget() {
    local left=$((BUDGET_S - SECONDS - $1))
    ((left > $2)) && left=$2
    ((left < 10)) && left=10
    echo "$left"
}
has_cuda() {
    [[ "$DEVICE" == cpu ]] && { "$1" -c 'import torch' >/dev/null 2>&1; return; }
    "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}
# what the GPU tests import (neither they, the engine nor the scripts below need psutil, which the
# GPU machine's system python lacks)
can_run_tests() {
    "$1" -c 'import torch, transformers, safetensors, tokenizers, jinja2, numpy, pytest' >/dev/null 2>&1
}
# whether pip's index answers: offline, each pip call of `make install` fails only after its
# retries and timeouts, minutes of the budget
online() {
    timeout 15 "$SYS_PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' \
        "${PIP_INDEX_URL:-https://pypi.org/simple/}" >/dev/null 2>&1
}
# $VENV over the system python's packages; false, with no $VENV left behind, if that fails (e.g. a
# Debian/Ubuntu python without python3-venv: no ensurepip)
make_system_venv() {
    [[ -d "$VENV" ]] && return 0
    local sys_site venv_site
    if "$SYS_PY" -m venv --system-site-packages "$VENV" >>"$LOG" 2>&1 \
        && sys_site=$("$SYS_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
        && venv_site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); then
        # when $SYS_PY is itself a venv, --system-site-packages shows its base Python, not its packages:
        # a .pth file appends them to the new venv's path (packages installed in the new venv win)
        echo "$sys_site" >"$venv_site/zz_system_packages.pth"
        return 0
    fi
    say "could not create $VENV with $SYS_PY -m venv (see $LOG)"
    rm -rf "$VENV"
    return 1
}

# ---- 0. the machine ----------------------------------------------------------------------------
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG" || true
else
    say "nvidia-smi not found (continuing: torch decides whether CUDA is usable)"
fi

# ---- 1. python environment ---------------------------------------------------------------------
PY=""
ONLINE=0
if online; then ONLINE=1; else say "pip's index does not answer (no network): nothing will be installed"; fi
if [[ -x "$VENV/bin/python" ]] && has_cuda "$VENV/bin/python"; then
    PY="$VENV/bin/python"
    if ((ONLINE)); then
        say "using $VENV (its torch can use $DEVICE); running make install to bring it up to date"
        timeout "$(budget 300 240)" make install VENV="$VENV" >>"$LOG" 2>&1 || say "make install failed (see $LOG); using $VENV as it is"
    else
        say "using $VENV as it is (its torch can use $DEVICE)"
    fi
elif has_cuda "$SYS_PY"; then
    if ((ONLINE)); then
        say "system $SYS_PY has a CUDA torch: venv $VENV with --system-site-packages + make install"
        if make_system_venv && timeout "$(budget 300 240)" make install VENV="$VENV" >>"$LOG" 2>&1 && has_cuda "$VENV/bin/python"; then
            PY="$VENV/bin/python"
        fi
    fi
    if [[ -z "$PY" ]] && can_run_tests "$SYS_PY"; then
        say "no install (offline, or it failed: see $LOG): using $SYS_PY with PYTHONPATH=. and no install"
        PY="$SYS_PY"
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    elif [[ -z "$PY" ]]; then
        die "no install, and $SYS_PY lacks packages the tests need (torch, transformers, safetensors, tokenizers, jinja2, numpy, pytest)"
    fi
else
    ((ONLINE)) || die "no CUDA torch here ($VENV, $SYS_PY) and no network to install one"
    say "no CUDA torch found: make install VENV=$VENV"
    timeout "$(budget 300 300)" make install VENV="$VENV" >>"$LOG" 2>&1 || die "make install failed (see $LOG)"
    if ! has_cuda "$VENV/bin/python" && [[ -n "${TORCH_CUDA_INDEX_URL:-}" ]]; then
        say "installing torch==2.13.0 from \$TORCH_CUDA_INDEX_URL"
        timeout "$(budget 240 300)" "$VENV/bin/pip" install -q --force-reinstall --no-deps torch==2.13.0 \
            --index-url "$TORCH_CUDA_INDEX_URL" >>"$LOG" 2>&1 || die "CUDA torch install failed (see $LOG)"
    fi
    has_cuda "$VENV/bin/python" || die "torch in $VENV cannot use CUDA (CPU wheel?); set TORCH_CUDA_INDEX_URL or use a system CUDA torch"
    PY="$VENV/bin/python"
fi
"$PY" -c 'import torch, transformers, sys
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, GPU {gpu}")' 2>&1 | tee -a "$LOG" \
    || say "$PY cannot import torch and transformers (continuing: the steps below say what fails)"

# ---- 2. the model ------------------------------------------------------------------------------
if [[ ! -f "$MODEL_DIR/model.safetensors" || ! -f "$MODEL_DIR/config.json" ]]; then
    if [[ "$PY" == "$VENV/bin/python" && "$CONVERT_MODEL" != 0 ]] && timeout "$(budget 240 180)" make model VENV="$VENV" MODEL_DIR="$MODEL_DIR" >>"$LOG" 2>&1; then
        say "model converted into $MODEL_DIR"
    elif [[ -f "$MODEL_DIR/config.json" && -f "$MODEL_DIR/tokenizer.json" ]]; then
        say "no weights in $MODEL_DIR and no way to convert them: using RANDOM weights with its architecture and tokenizer"
        "$PY" -m loadtest.random_model --like "$MODEL_DIR" --out build/random-model 2>&1 | tee -a "$LOG" \
            || die "could not write the random-weight model (see $LOG)"
        MODEL_DIR=build/random-model
    else
        die "no model in $MODEL_DIR and make model failed (see $LOG); copy a converted model directory there"
    fi
fi
say "model: $MODEL_DIR"

# ---- 3. GPU tests ------------------------------------------------------------------------------
say "pytest -m gpu tests/gpu + tests/engine/test_triton_kernels.py ..."
tests_rc=0
GPU_TEST_MODEL="$MODEL_DIR" GPU_TEST_DEVICE="$DEVICE" timeout "$(budget 210 240)" "$PY" -m pytest -m "gpu or not gpu" \
    tests/gpu tests/engine/test_triton_kernels.py -q -rs -p no:cacheprovider \
    --junitxml "$OUT_DIR/gpu_tests.xml" 2>&1 | tee "$OUT_DIR/gpu_tests.log" || tests_rc=$?
tests_line=$(grep -E '(passed|failed|error|skipped)' "$OUT_DIR/gpu_tests.log" | tail -n 1 || true)
say "GPU tests: ${tests_line:-no summary} (exit $tests_rc)"

# ---- 4. W1 on cuda -----------------------------------------------------------------------------
say "W1 on $DEVICE: $BENCH_ENGINES, bf16, 1 repeat ..."
bench_rc=0
timeout "$(budget 15 300)" "$PY" -m loadtest.bench_engine --device "$DEVICE" --dtype bfloat16 --repeats 1 --engines "$BENCH_ENGINES" \
    --model "$MODEL_DIR" --out-dir "$OUT_DIR" "${BENCH_ARGS[@]}" 2>&1 | tee "$OUT_DIR/bench.log" || bench_rc=$?
say "W1 exit $bench_rc"

# ---- 5. decode-step latency sweep ---------------------------------------------------------------
read -r -a SWEEP_ARGS <<<"${SWEEP_ARGS:-}"
say "decode-step sweep on $DEVICE (batch 1-256, CUDA graphs) ..."
sweep_rc=0
timeout "$(budget 30 150)" "$PY" -m loadtest.decode_sweep --device "$DEVICE" --model "$MODEL_DIR" --out-dir "$OUT_DIR" \
    "${SWEEP_ARGS[@]}" 2>&1 | tee "$OUT_DIR/decode_sweep.log" || sweep_rc=$?
timeout "$(budget 15 60)" "$PY" -m loadtest.decode_sweep --device "$DEVICE" --model "$MODEL_DIR" --out-dir "$OUT_DIR/eager" \
    --enforce-eager --batch-sizes 1,64 --steps 20 "${SWEEP_ARGS[@]}" 2>&1 | tee -a "$OUT_DIR/decode_sweep.log" || true
say "sweep exit $sweep_rc"

# ---- 6. summary --------------------------------------------------------------------------------
# (a failed summary must not end the script here, before the exit status below)
{ echo "GPU tests: ${tests_line:-no summary} (exit $tests_rc); model $MODEL_DIR; total ${SECONDS} s"
  cat "$OUT_DIR/engine_throughput.md" "$OUT_DIR/decode_sweep.md" "$OUT_DIR/eager/decode_sweep.md" 2>/dev/null
  "$PY" - "$OUT_DIR" <<'EOF' || echo "(targets: no results)"
import json, sys
from pathlib import Path
w1, sweep = (json.loads((Path(sys.argv[1]) / f).read_text()) for f in ("engine_throughput.json", "decode_sweep.json"))
native = w1["engines"].get("native", {}).get("ratio_vs_baseline")
if native:
    print(f"target W1 native >= 5x HF static: {native['median']:.2f}x -> {'MET' if native['median'] >= 5 else 'NOT MET'}")
ms = sweep["rows"][0]["step_ms"]
if sweep["cuda_graphs"] and sweep["rows"][0]["batch"] == 1:
    print(f"target batch-1 decode step <= 1 ms with CUDA graphs: {ms:.3f} ms -> {'MET' if ms <= 1 else 'NOT MET'}")
EOF
} | tee "$OUT_DIR/gpu_check_summary.md"

if ((tests_rc != 0 || bench_rc != 0 || sweep_rc != 0)); then
    say "FAILED (tests exit $tests_rc, W1 exit $bench_rc, sweep exit $sweep_rc); logs in $OUT_DIR"
    exit 1
fi
say "done in ${SECONDS}s; outputs in $OUT_DIR"
