#!/usr/bin/env bash
# GPU check (docs/engine-kernels.md#gpu-check): `bash loadtest/gpu_check.sh` on a machine with an NVIDIA GPU runs the
# GPU tests, W1 on CUDA (loadtest.bench_engine, 1 repeat) and the decode-step sweep (loadtest.decode_sweep, with and
# without CUDA graphs), then a summary with their targets, into $OUT (else reports/gpu/: reports/ holds the CPU
# engine_throughput.*) within $BUDGET_S (540) s. Knobs: OUT, BUDGET_S, VENV, PYTHON, MODEL_DIR, BENCH_ENGINES
# (native,hf,vllm), BENCH_ARGS, SWEEP_ARGS, GPU_CHECK_DEVICE=cpu (a dry run without a GPU). It installs nothing (the
# GPU machines are offline). Exit status 0 when the tests, the benchmark and the sweep all succeeded.
set -euo pipefail
cd "$(dirname "$0")/.."

BUDGET_S=${BUDGET_S:-540}
VENV=${VENV:-.venv-gpu}
SYS_PY=${PYTHON:-python3}
MODEL_DIR=${MODEL_DIR:-models/smollm2-135m-instruct}
OUT_DIR=${OUT:-reports/gpu}
BENCH_ENGINES=${BENCH_ENGINES:-native,hf,vllm}
read -r -a BENCH_ARGS <<<"${BENCH_ARGS:-}"
read -r -a SWEEP_ARGS <<<"${SWEEP_ARGS:-}"
DEVICE=${GPU_CHECK_DEVICE:-cuda}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOG="$OUT_DIR/gpu_check.log"
: >"$LOG"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1

say() { printf '[gpu-check %3ds] %s\n' "$SECONDS" "$*" | tee -a "$LOG" >&2; }
die() { say "ERROR: $*"; exit 1; }
# seconds left before the deadline, keeping $1 s for the steps after this one, capped at $2 (at least 10)
budget() {
    local left=$((BUDGET_S - SECONDS - $1))
    ((left > $2)) && left=$2
    ((left < 10)) && left=10
    echo "$left"
}
has_cuda() {  # (any torch for a dry run on the CPU)
    "$1" -c "import sys, torch; sys.exit(0 if '$DEVICE' == 'cpu' or torch.cuda.is_available() else 1)" >/dev/null 2>&1
}

# ---- 0. the machine; 1. a CUDA torch: $VENV's (never .venv, the CPU one), else $PYTHON's with PYTHONPATH=. --------
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG" \
    || say "no nvidia-smi (continuing: torch decides whether CUDA is usable)"
if [[ -x "$VENV/bin/python" ]] && has_cuda "$VENV/bin/python"; then
    PY="$VENV/bin/python"
elif has_cuda "$SYS_PY" && "$SYS_PY" -c 'import torch, transformers, safetensors, tokenizers, jinja2, numpy, pytest' >/dev/null 2>&1; then
    PY="$SYS_PY"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    die "no usable CUDA torch here ($VENV, $SYS_PY): make a venv with one (make install VENV=$VENV, then a CUDA build of torch)"
fi
"$PY" -c 'import torch, transformers, sys
print(f"{sys.executable}: python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}")' \
    2>&1 | tee -a "$LOG" || say "$PY cannot import torch and transformers (continuing: the steps below say what fails)"

# ---- 2. the model: $MODEL_DIR; with only its small files there, random weights with its architecture
# (build/random-model, marked RANDOM_WEIGHTS: the GPU tests skip the text check) ---------------------------------
if [[ ! -f "$MODEL_DIR/model.safetensors" || ! -f "$MODEL_DIR/config.json" ]]; then
    [[ -f "$MODEL_DIR/config.json" && -f "$MODEL_DIR/tokenizer.json" ]] \
        || die "no model in $MODEL_DIR: copy a converted model directory there (make model)"
    say "no weights in $MODEL_DIR: RANDOM weights with its architecture and tokenizer"
    "$PY" - "$MODEL_DIR" build/random-model <<'EOF' 2>&1 | tee -a "$LOG" || die "could not write the random-weight model (see $LOG)"
import shutil, sys, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM
like, out = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(like), dtype=torch.float32).save_pretrained(out)
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json", "special_tokens_map.json"):
    if (like / name).is_file():
        shutil.copy2(like / name, out / name)
(out / "RANDOM_WEIGHTS").write_text(f"random weights (seed 0) with the architecture of {like}\n")
EOF
    MODEL_DIR=build/random-model
fi
say "model: $MODEL_DIR"

# ---- 3. GPU tests, 4. W1, 5. the decode-step sweep ----------------------------------------------
tests_rc=0 bench_rc=0 sweep_rc=0
GPU_TEST_MODEL="$MODEL_DIR" GPU_TEST_DEVICE="$DEVICE" timeout "$(budget 210 240)" "$PY" -m pytest -m "gpu or not gpu" \
    tests/gpu tests/engine/test_triton_kernels.py -q -rs -p no:cacheprovider \
    --junitxml "$OUT_DIR/gpu_tests.xml" 2>&1 | tee "$OUT_DIR/gpu_tests.log" || tests_rc=$?
tests_line=$(grep -E '(passed|failed|error|skipped)' "$OUT_DIR/gpu_tests.log" | tail -n 1 || true)
say "GPU tests: ${tests_line:-no summary} (exit $tests_rc); W1 on $DEVICE: $BENCH_ENGINES, bf16, 1 repeat ..."
timeout "$(budget 15 300)" "$PY" -m loadtest.bench_engine --device "$DEVICE" --dtype bfloat16 --repeats 1 --engines "$BENCH_ENGINES" \
    --model "$MODEL_DIR" --out-dir "$OUT_DIR" "${BENCH_ARGS[@]}" 2>&1 | tee "$OUT_DIR/bench.log" || bench_rc=$?
say "W1 exit $bench_rc; decode-step sweep on $DEVICE (batch 1-256, CUDA graphs) ..."
timeout "$(budget 30 150)" "$PY" -m loadtest.decode_sweep --device "$DEVICE" --model "$MODEL_DIR" --out-dir "$OUT_DIR" \
    "${SWEEP_ARGS[@]}" 2>&1 | tee "$OUT_DIR/decode_sweep.log" || sweep_rc=$?
timeout "$(budget 15 60)" "$PY" -m loadtest.decode_sweep --device "$DEVICE" --model "$MODEL_DIR" --out-dir "$OUT_DIR/eager" \
    --enforce-eager --batch-sizes 1,64 --steps 20 "${SWEEP_ARGS[@]}" 2>&1 | tee -a "$OUT_DIR/decode_sweep.log" || true

# ---- 6. summary: the reports hold their targets ------------------------------------------------------------
{ echo "GPU tests: ${tests_line:-no summary} (exit $tests_rc); model $MODEL_DIR; total ${SECONDS} s"
  cat "$OUT_DIR/engine_throughput.md" "$OUT_DIR/decode_sweep.md" "$OUT_DIR/eager/decode_sweep.md" 2>/dev/null || true
} | tee "$OUT_DIR/gpu_check_summary.md"
((tests_rc == 0 && bench_rc == 0 && sweep_rc == 0)) || die "FAILED (tests exit $tests_rc, W1 exit $bench_rc, sweep exit $sweep_rc); logs in $OUT_DIR"
say "done in ${SECONDS}s; outputs in $OUT_DIR"
