#!/usr/bin/env bash
# Every GPU check in one run, for the day a CUDA machine is lent (CI has none): run from the
# repository root as `bash tests/gpu_checks.sh OUT_DIR`, with the package and its dependencies
# importable. Writes into OUT_DIR:
#   pytest_gpu.log         the `-m gpu` tests: tests/test_gpu_stages.py (stages 0-3 x precisions,
#                          offload to CPU and NVMe, CPU activation checkpoints, FP8, compile,
#                          each against a reference run on the same GPU; a Hugging Face Llama),
#                          the Triton FP8 kernels and _scaled_mm, autocast with host parameters,
#                          the main job with parameter offload
#   gpu_train.json         test_gpu_stages.py's figures per configuration
#   main_job.log           the main job on the GPU (`experiment=shakespeare_gpu`, 200 steps):
#                          its summary's tokens/s and MFU
#   suite/gpu_<device>.*   with SUITE_S=seconds (0: skipped, the default): the single-GPU suite's
#                          configurations matching SUITE_ONLY (default: stages 0-3 and stage 3 with
#                          activation checkpointing; about 40 s each on an H100)
#   fp8_<device>.*         with FP8_S=seconds (0: skipped): benchmarks/bench_fp8.py's kernels and
#                          linear parts at 8192
# The tests run three at a time (the GPU is shared, so their timings are not figures to report);
# the main job runs alone after them. Each part has its own time limit, so one that hangs leaves
# the other's results.
set -u
out="$(mkdir -p "${1:-gpu-out}" && cd "${1:-gpu-out}" && pwd)"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
nvidia-smi -L
"$py" -c "import torch, lightning, transformers, triton; print('torch', torch.__version__, 'lightning', \
lightning.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"

# With pytest-xdist, three at a time: the stage matrix (test_gpu_stages.py, the longest) beside the rest.
parallel="$("$py" -c "import xdist" 2>/dev/null && echo "-n 3")"
AMPZERO_GPU_REPORT="$out/gpu_train.json" timeout "${PYTEST_S:-420}" "$py" -m pytest -m gpu $parallel -rA \
    -p no:cacheprovider tests/test_gpu_stages.py tests/test_gpu_fp8.py tests/test_gpu_precision.py \
    tests/test_fp8_kernels.py >"$out/pytest_gpu.log" 2>&1
echo "pytest exit $?" >>"$out/pytest_gpu.log"
(cd /tmp && timeout "${MAIN_JOB_S:-100}" "$py" -m lightning_ampzero.train experiment=shakespeare_gpu \
    trainer.max_steps=200 hydra.run.dir=/tmp/main-job >"$out/main_job.log" 2>&1; echo "main job exit $?" >>"$out/main_job.log")
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$out/pytest_gpu.log"
tail -n 40 "$out/main_job.log"
# Benchmarks last, alone on the GPU, each under its own limit.
if [ "${SUITE_S:-0}" -gt 0 ]; then
    timeout "$SUITE_S" "$py" benchmarks/run.py --gpu --only "${SUITE_ONLY:-ampzero/(s[0-3]|s3\+ac)\$}" --steps 8 \
        --warmup 3 --out "$out/suite" 2>&1 | grep -v Warning | tail -n 12
fi
if [ "${FP8_S:-0}" -gt 0 ]; then
    # Its results are written into benchmarks/results/ (the committed ones included): copied only when it ran through.
    if (set -o pipefail; timeout "$FP8_S" "$py" benchmarks/bench_fp8.py --parts kernels,linear --sizes 8192 \
        --recipes tensorwise,rowwise 2>&1 | tail -n 6); then
        cp benchmarks/results/fp8_*.json benchmarks/results/fp8_*.md "$out/"
    fi
fi
