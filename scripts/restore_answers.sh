#!/usr/bin/env bash
# Restores the self-distilled training answer files (12 MB, 4.0M answer tokens) from git
# history into data/self-distilled/, where the training configs look for them, and the later
# turns' held-out answers as generated, which only the audit reads (its audited copy stays
# tracked). They left the tracked tree so that a clone stays small enough to travel to a GPU
# machine; the held-out answer files the evaluations read stay tracked. Idempotent: files
# already present are kept.
set -euo pipefail
cd "$(dirname "$0")/.."

# The last commit that tracked them.
COMMIT=664d8ce
ANSWERS=data/self-distilled/smollm2-135m-instruct
FOLDERS=("$ANSWERS/train" "$ANSWERS/train-later-turns" "$ANSWERS/train-dataframebench"
         "$ANSWERS/held-out-later-turns")

if ! git cat-file -e "$COMMIT^{commit}" 2>/dev/null; then
    echo "restore_answers: commit $COMMIT is not in this clone (a shallow clone?)." >&2
    echo "Fix: git fetch --unshallow (or clone without --depth), then run this again." >&2
    exit 1
fi
git archive "$COMMIT" "${FOLDERS[@]}" | tar -x --skip-old-files
for folder in "${FOLDERS[@]}"; do
    echo "restore_answers: $folder: $(ls "$folder" | wc -l) answer files"
done
