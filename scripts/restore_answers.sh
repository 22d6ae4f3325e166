#!/usr/bin/env bash
# Restores the self-distilled training answer files (18 MB, 5.1M answer tokens) from git
# history into data/self-distilled/, where the training configs look for them, and the later
# turns' held-out answers as generated, which only the audit reads (its audited copy stays
# tracked). They left the tracked tree so that a clone stays small enough to travel to a GPU
# machine; the held-out answer files the evaluations read stay tracked. Idempotent: files
# already present are kept.
set -euo pipefail
cd "$(dirname "$0")/.."

ANSWERS=data/self-distilled/smollm2-135m-instruct
# Each folder with the last commit that tracked it.
RESTORE=("664d8ce $ANSWERS/train" "664d8ce $ANSWERS/train-later-turns" "664d8ce $ANSWERS/train-dataframebench"
         "664d8ce $ANSWERS/held-out-later-turns" "877bdb1 $ANSWERS/train-tasks"
         "691e1ba $ANSWERS/train-tasks-4800" "691e1ba $ANSWERS/train-exams")

for entry in "${RESTORE[@]}"; do
    read -r commit folder <<<"$entry"
    if ! git cat-file -e "$commit^{commit}" 2>/dev/null; then
        echo "restore_answers: commit $commit is not in this clone (a shallow clone?)." >&2
        echo "Fix: git fetch --unshallow (or clone without --depth), then run this again." >&2
        exit 1
    fi
    git archive "$commit" "$folder" | tar -x --skip-old-files
    echo "restore_answers: $folder: $(ls "$folder" | wc -l) answer files"
done
