"""One engine in this process on the bench's held-out prompts, for the benchmarks that
look inside a step (benchmarks/planner_trace.py, benchmarks/step_profile.py): with
VLLM_ENABLE_V1_MULTIPROCESSING=0 the engine core, the model runner and the proposer run
here, where a profiler or a recorder can see them."""
from __future__ import annotations

import os

PROMPT_SOURCES = "humaneval,sharegpt-held-out"
MAX_PROMPT_TOKENS = 512


def in_process_engine(batch_size: int, *, num_prompts: int, max_new_tokens: int, dtype: str = "fp32",
                      speculative_config: dict | None = None):
    """(the LLM, its batches as token-id prompts (prompt_ids)): the bench's prompts cut to its length
    budget, in batches of exactly batch_size (repeated where there are fewer prompts), and an
    engine sized for them as the bench sizes its own."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    from vllm_mtpspec.bench.command import _cut_prompts
    from vllm_mtpspec.bench.prompts import load_bench_prompts
    from vllm_mtpspec.bench.runner import batches_for, engine_settings, kv_bytes_per_token
    from vllm_mtpspec.models import resolve_model
    from vllm_mtpspec.prompts import prompt_ids

    model = str(resolve_model("smollm2-135m-instruct", dtype=dtype))
    prompts = _cut_prompts(load_bench_prompts(PROMPT_SOURCES, num_prompts), model, MAX_PROMPT_TOKENS)
    engine = engine_settings(batch_size, MAX_PROMPT_TOKENS, max_new_tokens, kv_bytes_per_token(model, dtype),
                             dtype=dtype)
    llm = LLM(model, **engine, **({"speculative_config": speculative_config} if speculative_config else {}))
    tokenizer = llm.get_tokenizer()
    batches = [[{"prompt_token_ids": prompt_ids(tokenizer, p.text, p.history)} for p in group]
               for group in batches_for(prompts, batch_size)]
    return llm, batches
