#!/usr/bin/env bash
# The shipped drafter on every held-out set, teacher-forced along the target's own greedy
# answers: ShareGPT's held-out splits as drawn and as audited against the training answers,
# and the held-out sources it never trained on (vllm_mtpspec/held_out_sources.py).
# Resumable: answer files and shards already made are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
D=data/self-distilled/smollm2-135m-instruct
HEADS=${HEADS:-vllm_mtpspec/shipped_heads/smollm2-135m-instruct}
PER_SOURCE=${PER_SOURCE:-16}
OUT=${OUT:-benchmarks/results/held_out_block_v2}

# The target's greedy answers to the held-out sources (fp32, up to 256 new tokens).
$PY -m vllm_mtpspec_train.data --prompts held-out-sources:$PER_SOURCE --split all --answers-only \
    --max-prompt-tokens 2048 --kv-cache-gib 2 --answers $D/held-out-sources --out runs/held-out-sources
bash scripts/restore_answers.sh
.venv/bin/mtpspec audit-held-out --train $D/train,$D/train-later-turns,$D/train-dataframebench \
    --held-out $D/held-out-sources --out $D/held-out-sources-audited
# Shards: the target's states along each answer, with up to 512 prompt rows and the layers
# the block reads.
for set in held-out held-out-audited held-out-later-turns-audited held-out-dataframebench-audited \
           held-out-sources-audited; do
    $PY -m vllm_mtpspec_train.data --from-answers --answers $D/$set --context-rows 512 \
        --feature-layers 2,15,27 --out runs/held-out-shards/$set
done
$PY benchmarks/held_out_table.py "$HEADS" \
    "ShareGPT first turns, split by part (as trained)=runs/held-out-shards/held-out" \
    "ShareGPT first turns, audited=runs/held-out-shards/held-out-audited" \
    "ShareGPT later turns, audited=runs/held-out-shards/held-out-later-turns-audited" \
    "DataFrameBench, audited=runs/held-out-shards/held-out-dataframebench-audited" \
    "Sources never trained on=runs/held-out-shards/held-out-sources-audited" \
    --json $OUT.json --markdown $OUT.md
