#!/usr/bin/env bash
# What the lead runs on the device machine (one call of at most 10 min; the timeouts add up to 560 s): GPU
# tests, the dispatchers alone against raw NCCL, then the verify benchmark.
# Usage: [SKIP_TESTS=1] bash bench/gpu_run.sh EP DP   (results under $OUT when set)
set -uo pipefail
EP=${1:-4}; DP=${2:-2}; OUT=${OUT:-/tmp/moetool-gpu-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# no network there, so no install: link formats/ and kernels/ where the moetool.formats /
# moetool.kernels imports look (the device works on a copy of the tree)
[ -e moetool/formats ] || ln -s ../formats moetool/formats
[ -e moetool/kernels ] || ln -s ../kernels moetool/kernels
export PYTHONPATH="$PWD"
nvidia-smi -L
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
[ -n "${SKIP_TESTS:-}" ] || timeout 180 python -m pytest -q -o addopts=-ra -p no:cacheprovider -m gpu tests 2>&1 | tail -15 | tee "$OUT/pytest_gpu.txt"
# the expert-parallel kernels and the dispatchers (not marked gpu: they run on CUDA when present)
[ -n "${SKIP_TESTS:-}" ] || timeout 80 python -m pytest -q -o addopts=-ra -p no:cacheprovider tests/kernels/test_kernels_ep_dispatch.py tests/kernels/test_kernels_ep_combine.py tests/verify/test_verify_dispatch.py 2>&1 | tail -5 | tee -a "$OUT/pytest_gpu.txt"
timeout 80 python bench/dispatch_gpu.py --ep "$EP" --dp "$DP" --out "$OUT/dispatch" 2>&1 | grep -v -i warn | tee "$OUT/dispatch_gpu.txt"
timeout 220 python bench/verify_gpu.py --ep "$EP" --dp "$DP" --skip-cpu ${BACKENDS:+--backends "$BACKENDS"} --json "$OUT/verify_gpu.json" 2>&1 | grep -v -i -E "warn|return func" | tee "$OUT/verify_gpu.txt"
