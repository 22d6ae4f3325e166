"""The proposer inside a real vLLM engine at batch 1 (chain of 4, prompt lookup off): the
share of time drafting, each INT8 product's mean time by shape (in features, out features,
rows), and a cProfile of the proposer's calls. The products are counted from the warm-up
prompt on, the drafting time and the profile over the 4 prompts after it.

    python benchmarks/proposer_profile.py runs/block-v2-layers-dv8k
"""
import cProfile
import os
import pstats
import sys
import time
from collections import defaultdict

# Set before vLLM is imported: the engine must run in this process for cProfile to see it.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams  # noqa: E402 (after the environment variable above)

import vllm_mtpspec.vllm.hooks as hooks  # noqa: E402 (likewise)
from vllm_mtpspec.models import resolve_model  # noqa: E402 (likewise)
from vllm_mtpspec.prompts import apply_chat_template  # noqa: E402 (likewise)
from vllm_mtpspec.quant.int8_dynamic import Int8Linear  # noqa: E402 (likewise)

heads = sys.argv[1]
model = str(resolve_model("smollm2-135m-instruct", dtype="fp32"))
engine = dict(dtype="float32", max_model_len=640, enforce_eager=True, max_num_seqs=1, max_num_batched_tokens=2048,
              kv_cache_memory_bytes=200 << 20, disable_log_stats=False, seed=0)
llm = LLM(model, **engine, speculative_config={"method": "mtpspec", "model": heads, "num_speculative_tokens": 4,
                                               "prompt_lookup_max": 0})
# Imported once the engine exists, as the engine itself imports it (the platform is settled).
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

orig = GPUModelRunner.propose_draft_token_ids
prof = cProfile.Profile()
def wrapped(self, *a, **k):
    prof.enable()
    try:
        return orig(self, *a, **k)
    finally:
        prof.disable()
GPUModelRunner.propose_draft_token_ids = wrapped
times = defaultdict(lambda: [0, 0.0])
fwd = Int8Linear.forward
def timed(self, x):
    t0 = time.perf_counter()
    y = fwd(self, x)
    r = times[(self.in_features, self.out_features, x.reshape(-1, self.in_features).shape[0])]
    r[0] += 1
    r[1] += time.perf_counter() - t0
    return y
Int8Linear.forward = timed
tok = llm.get_tokenizer()
texts = ["Write a Python function that checks whether a string is a palindrome.",
         "Explain the difference between a list and a tuple in Python.",
         "What is the capital of France, and what is it known for?",
         "Summarize the plot of Romeo and Juliet in three sentences."]
params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
for t in texts[:1]:
    llm.generate([apply_chat_template(tok, t, [])], params, use_tqdm=False)
prof = cProfile.Profile()
d0, c0 = hooks.draft_time.seconds, hooks.draft_time.calls
t0 = time.perf_counter()
for t in texts:
    llm.generate([apply_chat_template(tok, t, [])], params, use_tqdm=False)
wall = time.perf_counter() - t0
ds, dc = hooks.draft_time.seconds - d0, hooks.draft_time.calls - c0
print(f"wall {wall:.2f}s, drafting {ds:.2f}s ({ds / wall:.1%}), {dc} calls, {ds / dc * 1e3:.2f} ms per call")
for k, (n, t) in sorted(times.items()):
    print(k, n, f"{t / n * 1e6:.0f} us")
pstats.Stats(prof).sort_stats("cumulative").print_stats(12)
