# The two commands of the README. Both set the machine up first (idempotent: a second
# run reuses .venv), then run the demo or the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1

.PHONY: setup demo test test-fast clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/mtpspec demo

test: setup
	bash scripts/run_tests.sh

test-fast: setup
	bash scripts/run_tests.sh -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache
