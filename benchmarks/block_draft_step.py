"""One draft step of an attention draft block (extend by the step's accepted entries, then a
chain of 4 depths), this tree's draft_block.py against an older commit's, same weights, batch
1 and 8, contexts of 256 and 1,024 entries unless told (--batches, --contexts); median of a
number of steps each, the two trees' steps interleaved, and whether the logits agree.

    python benchmarks/block_draft_step.py --against 6fd6ed2 --heads runs/block-v1-dv16k --threads 2
    python benchmarks/block_draft_step.py --against 9eb901e --heads runs/block-v2-layers-dv8k --int8 --accepted 3

Each tree drafts in the form its proposer drafted with (prepare_drafting, where the tree has
it). --int8 drafts as the proposer does on CPUs without bf16: the block's matrices and the LM
head's rows in INT8. A block that reads target layers gets random states for them.
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
parser.add_argument("--int8", action="store_true", help="draft in INT8, as the proposer does on AVX2-only CPUs")
parser.add_argument("--accepted", type=int, default=1, help="entries each step appends before drafting")
parser.add_argument("--repeats", type=int, default=30)
parser.add_argument("--batches", default="1,8", help="requests drafted together, comma-separated")
parser.add_argument("--contexts", default="256,1024", help="entries each request's cache holds, comma-separated")
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
if args.int8:
    from vllm_mtpspec.quant.int8_dynamic import Int8Linear, int8_linears  # noqa: E402

    for heads in (heads_old, heads_new):
        int8_linears(heads)
    if hasattr(old, "_dense_weight"):  # an INT8 matrix holds its codes only: read their values the same way
        import vllm_mtpspec.draft_block as this_tree  # noqa: E402

        old._dense_weight = this_tree._dense_weight
for heads in (heads_old, heads_new):  # the form the proposer drafts with, where a tree has one
    if hasattr(heads, "prepare_drafting"):
        heads.prepare_drafting(None if heads_new.draft_vocab is None else embed[heads_new.draft_vocab])
    elif hasattr(heads, "fuse_projections"):  # its first form, fused products only
        heads.fuse_projections()


def layer_states(rows: int, gen: torch.Generator):
    """Random states entering the block's feature layers ([rows, n, d]), or None."""
    layers = len(heads_new.feature_layers)
    return torch.randn(rows, layers, d, generator=gen) if layers else None


def draft_step(heads, batch, context):
    """A step function over fresh caches of `context` entries, and its first logits."""
    project = heads_new.lm_head_for(lm_head)
    if args.int8:
        rows = lm_head if heads_new.draft_vocab is None else lm_head[heads_new.draft_vocab]
        project = Int8Linear.from_weight(rows)
    gen = torch.Generator().manual_seed(0)
    caches = []
    for _ in range(batch):
        c = heads.empty_cache()
        heads.extend(c, torch.randn(context, d, generator=gen), embed[torch.randint(0, 49152, (context,), generator=gen)],
                     layer_states(context, gen))
        caches.append(c)
    n = args.accepted
    h = [torch.randn(n, d, generator=gen) for _ in range(batch)]
    tok = [embed[torch.randint(0, 49152, (n,), generator=gen)] for _ in range(batch)]
    layers = [layer_states(n, gen) for _ in range(batch)]

    @torch.no_grad()
    def step():
        outputs = heads.extend_many(caches, h, tok, None if layers[0] is None else layers)
        newest = torch.stack([out[-1] for out in outputs])
        logits = heads.draft_chains(caches, newest, 4, project, lambda t: embed[t], heads_new.draft_vocab)
        for c in caches:
            heads.truncate(c, context)
        return logits
    return step, step()


def median_ms(times):
    return sorted(times)[len(times) // 2] * 1e3


for batch in [int(b) for b in args.batches.split(",")]:
    for context in [int(c) for c in args.contexts.split(",")]:
        (step_old, la), (step_new, lb) = draft_step(heads_old, batch, context), draft_step(heads_new, batch, context)
        times_old, times_new = [], []
        for _ in range(args.repeats):  # interleaved: the machine's drifts reach both alike
            for step, times in ((step_old, times_old), (step_new, times_new)):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
        a, b = median_ms(times_old), median_ms(times_new)
        tolerance = 0.05 if args.int8 else 1e-4  # INT8 quantizes each product's input afresh
        same = torch.allclose(la, lb, atol=tolerance, rtol=tolerance)
        same_drafts = bool((la.argmax(-1) == lb.argmax(-1)).all())
        print(f"batch {batch} context {context}: {args.against} {a:.2f} ms, this tree {b:.2f} ms, ratio {a / b:.2f}x, "
              f"same logits {same}, same drafts {same_drafts}", flush=True)
