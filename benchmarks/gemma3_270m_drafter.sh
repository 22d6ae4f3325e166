#!/usr/bin/env bash
# Gemma 3 270M's trained block (runs/gemma/block, vllm_mtpspec_train/configs/gemma3-270m-block.json)
# made into its shipped form: INT2 (GPTQ, ranges refitted), the 8,192 most frequent answer
# tokens as its draft vocabulary and a copy bias, calibrated and fitted on one training answer
# file; then scored teacher-forced on the held-out sources it never trained on. Resumable.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
M=${M:-.venv/bin/mtpspec}
D=data/self-distilled/gemma3-270m
OUT=${OUT:-benchmarks/results/held_out_gemma3_270m}
mkdir -p runs/gemma/calib-answers && cp -n $D/train/answers-00001.npz runs/gemma/calib-answers/
[ -d runs/gemma/calib-shards ] || $PY -m vllm_mtpspec_train.data --model gemma3-270m --from-answers \
    --answers runs/gemma/calib-answers --context-rows 512 --feature-layers 2,9,15 --out runs/gemma/calib-shards
[ -d runs/gemma/held-out-shards ] || $PY -m vllm_mtpspec_train.data --model gemma3-270m --from-answers \
    --answers $D/held-out-sources-audited --context-rows 512 --feature-layers 2,9,15 --out runs/gemma/held-out-shards
$M heads quantize runs/gemma/block --bits 2 --method gptq-refit --calibration runs/gemma/calib-shards \
    --model gemma3-270m --out runs/gemma/block-int2
$M heads draft-vocab runs/gemma/block-int2 --size 8192 --answers $D/train,$D/train-tasks --out runs/gemma/block-int2-8k
$PY -m vllm_mtpspec_train.fit_copy_bias runs/gemma/block-int2-8k --shards runs/gemma/calib-shards \
    --model gemma3-270m --out runs/gemma/ship
# Scored over the draft vocabulary only: over Gemma's 262,144 tokens the table's trees take
# hours on a 2-core CPU.
$PY benchmarks/held_out_table.py runs/gemma/ship --label "block, INT2, 8,192 tokens, copy bias" \
    --compare "without the copy bias=runs/gemma/block-int2-8k" --model gemma3-270m \
    "Sources never trained on=runs/gemma/held-out-shards" --json $OUT.json --markdown $OUT.md
