"""The logger of mtpspec's code inside vLLM's processes: a child of vLLM's own.

vLLM configures only its "vllm" logger (its handler, its level from VLLM_LOGGING_LEVEL,
no propagation to the root), so in an engine core or worker process a logger outside that
tree reaches no handler below WARNING: what the heads loaded and what the draft planner
chose and why would never be shown. Under "vllm." it is shown the way vLLM's own lines
are; where vLLM has not configured logging it propagates to the root as any logger does."""
from __future__ import annotations

import logging

logger = logging.getLogger("vllm.mtpspec")
