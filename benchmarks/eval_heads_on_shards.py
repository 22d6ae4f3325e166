"""Held-out scores of a heads directory on training-layout shards (the training job's own
evaluation, without training): for comparing heads versions on the same held-out data.

    python benchmarks/eval_heads_on_shards.py vllm_mtpspec/shipped_heads/smollm2-135m-instruct runs/sharegpt-sd/held-out
"""
import argparse
import json

from vllm_mtpspec.checkpoint import load_heads
from vllm_mtpspec.models import resolve_model
from vllm_mtpspec.shards import list_shards
from vllm_mtpspec.weights import embedding_and_lm_head
from vllm_mtpspec_train.evaluate import evaluate_heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heads", help="a heads directory")
    parser.add_argument("shards", help="a folder of shard-*.pt (e.g. the training job's held-out data)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-tree-nodes", type=int, default=16,
                        help="node budget of the replayed trees (consensus, or the grown dynamic tree of heads that "
                             "grow their own; default 16)")
    args = parser.parse_args()
    embed, lm_head = embedding_and_lm_head(resolve_model(args.model, dtype="fp32"))
    scores = evaluate_heads(load_heads(args.heads), list_shards(args.shards), lm_head=lm_head, embed=embed,
                            max_tree_nodes=args.max_tree_nodes)
    print(json.dumps({k: v for k, v in scores.items() if k not in ("rank_accuracy", "per_category")}, indent=1))


if __name__ == "__main__":
    main()
