"""One draft step of an attention draft block (extend by one accepted entry, then a chain of
4 depths), this tree's draft_block.py against an older commit's, same weights, batch 1 and 8,
contexts of 256 and 1,024 entries; median of 30 steps each, and whether the logits agree.

    python benchmarks/block_draft_step.py --against 6fd6ed2 --heads runs/block-v1-dv16k --threads 2
"""
import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, ".")
from vllm_mtpspec.checkpoint import load_heads  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--against", required=True, help="the commit whose draft_block.py is timed beside this tree's")
parser.add_argument("--heads", required=True, help="an attention draft block's directory")
parser.add_argument("--threads", type=int, default=2)
args = parser.parse_args()
source = subprocess.run(["git", "show", f"{args.against}:vllm_mtpspec/draft_block.py"], capture_output=True,
                        text=True, check=True).stdout
with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
    f.write(source)
spec = importlib.util.spec_from_file_location("old_draft_block", f.name)
old = importlib.util.module_from_spec(spec)
sys.modules["old_draft_block"] = old
spec.loader.exec_module(old)

torch.set_num_threads(args.threads)
heads_new = load_heads(args.heads).float().eval()
heads_old = old.DraftBlock(heads_new.config)
heads_old.load_state_dict(heads_new.state_dict())
from vllm_mtpspec.models import resolve_model  # noqa: E402
from vllm_mtpspec.weights import embedding_and_lm_head  # noqa: E402
embed, lm_head = embedding_and_lm_head(resolve_model("smollm2-135m-instruct", dtype="fp32"))
d = heads_new.config.hidden_size


@torch.no_grad()
def step_ms(heads, batch, context, repeats=30):
    project = heads_new.lm_head_for(lm_head)
    gen = torch.Generator().manual_seed(0)
    caches = []
    for _ in range(batch):
        c = heads.empty_cache()
        heads.extend(c, torch.randn(context, d, generator=gen), embed[torch.randint(0, 49152, (context,), generator=gen)])
        caches.append(c)
    h = torch.randn(batch, d, generator=gen)
    tok = torch.randint(0, 49152, (batch,), generator=gen)

    def step():
        newest = torch.cat(heads.extend_many(caches, list(h[:, None]), list(embed[tok][:, None])))
        logits = heads.draft_chains(caches, newest, 4, project, lambda t: embed[t], heads_new.draft_vocab)
        for c in caches:
            heads.truncate(c, context)
        return logits
    out = step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3, out


for batch in (1, 8):
    for context in (256, 1024):
        a, la = step_ms(heads_old, batch, context)
        b, lb = step_ms(heads_new, batch, context)
        same = torch.allclose(la, lb, atol=1e-4, rtol=1e-4)
        print(f"batch {batch} context {context}: {args.against} {a:.2f} ms, this tree {b:.2f} ms, ratio {a / b:.2f}x, "
              f"same logits {same}", flush=True)
