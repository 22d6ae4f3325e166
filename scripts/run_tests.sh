#!/usr/bin/env bash
# Runs the test suite inside the project's venv. A run that collects no test fails:
# pytest exits 5 then, and this script turns that into a failure with a message.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TOKENIZERS_PARALLELISM=false
# Keep vLLM's and the compilers' caches inside the run, not in the user's home.
export MTPSPEC_TEST_TMP=${MTPSPEC_TEST_TMP:-$(mktemp -d)}
export VLLM_CACHE_ROOT="$MTPSPEC_TEST_TMP/vllm" TORCHINDUCTOR_CACHE_DIR="$MTPSPEC_TEST_TMP/inductor"
# Lint first: a finding fails the run before any test starts.
if ! .venv/bin/ruff check --quiet .; then
    echo "run_tests: ruff check found problems (fix them, or \`.venv/bin/ruff check --fix .\` for the safe ones)" >&2
    exit 1
fi
echo "ruff: clean"
.venv/bin/python -m pytest -ra --durations=15 "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "run_tests: pytest collected no tests; that is a failure here" >&2
    exit 1
fi
exit "$status"
