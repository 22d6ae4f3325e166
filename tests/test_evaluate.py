"""Greedy replay along a recorded answer: what eval-heads and the training summary report."""
import torch

from training.evaluate import replay_tree
from vllm_mtpspec.tree import chain_tree, tree_from_paths


def test_replay_accepts_the_longest_right_path_and_adds_the_bonus_token():
    answer = torch.tensor([10, 11, 12, 13, 14, 15])
    rows = torch.full((6, 2), 99)
    rows[0] = torch.tensor([11, 12])        # both right: 2 accepted + bonus
    rows[3] = torch.tensor([14, 99])        # first right only
    assert replay_tree(chain_tree(2), rows, answer) == [3, 2]  # rows 0 and 3, then the answer ends
    # A tree: the second-rank candidate at depth 1 is right where the first is not.
    tree = tree_from_paths([(0,), (1,), (1, 0)])
    nodes = torch.full((6, 3), 99)
    nodes[0] = torch.tensor([77, 11, 12])
    assert replay_tree(tree, nodes, answer)[0] == 3


def test_a_looked_up_chain_replaces_the_heads_where_there_is_one():
    answer = torch.tensor([10, 11, 12, 13, 14, 15])
    rows = torch.full((6, 2), 99)
    lookup = {0: [11, 12, 13], 4: [77]}
    assert replay_tree(chain_tree(2), rows, answer, lambda r: lookup.get(r, [])) == [4, 1]


def test_scores_are_reported_per_context_length_bucket(tmp_path, tiny_model, tiny_model_dir):
    """Two answers, one after a short prompt and one after a long conversation: each lands in
    its own bucket, with its own rows."""
    from training.data import write_shard
    from training.evaluate import context_bucket, evaluate_heads
    from vllm_mtpspec.heads_init import init_heads

    assert [context_bucket(n) for n in (1, 256, 257, 1024, 1500)] == ["<=256", "<=256", "257-512", "513-1024",
                                                                       ">1024"]
    d, vocab = tiny_model.config.hidden_size, tiny_model.config.vocab_size
    lengths = (12, 20)
    write_shard(tmp_path, 0, {"ids": ["a", "b#1"], "categories": ["general", "code"],
                              "prompt_ids": [[1] * 30, [1] * 1300], "offsets": torch.tensor([0, 12, 32]),
                              "tokens": torch.randint(0, vocab, (32,), dtype=torch.int32),
                              "hidden": torch.randn(32, d).half()})
    heads = init_heads(tiny_model, tiny_model_dir, num_heads=2)
    embed = tiny_model.get_input_embeddings().weight.detach()
    report = evaluate_heads(heads, sorted(tmp_path.glob("shard-*.pt")), lm_head=embed, embed=embed)
    buckets = report["per_context_length"]
    assert set(buckets) == {"<=256", ">1024"}
    assert buckets["<=256"]["rows"] == lengths[0] - 1 and buckets[">1024"]["rows"] == lengths[1] - 1
    assert set(buckets[">1024"]["mean_accepted_len"]) == set(report["mean_accepted_len"])


def test_scores_are_reported_per_source_folder(tmp_path, tiny_model, tiny_model_dir):
    from training.data import write_shard
    from training.evaluate import evaluate_heads
    from vllm_mtpspec.heads_init import init_heads

    d, vocab = tiny_model.config.hidden_size, tiny_model.config.vocab_size
    for folder, n in (("first-turns", 10), ("later-turns", 16)):
        write_shard(tmp_path / folder, 0, {"ids": ["a"], "categories": ["general"], "prompt_ids": [[1] * 8],
                                           "offsets": torch.tensor([0, n]),
                                           "tokens": torch.randint(0, vocab, (n,), dtype=torch.int32),
                                           "hidden": torch.randn(n, d).half()})
    heads = init_heads(tiny_model, tiny_model_dir, num_heads=2)
    embed = tiny_model.get_input_embeddings().weight.detach()
    shards = sorted(tmp_path.glob("*/shard-*.pt"))
    report = evaluate_heads(heads, shards, lm_head=embed, embed=embed)
    sources = report["per_source"]
    assert {name: s["rows"] for name, s in sources.items()} == {"first-turns": 9, "later-turns": 15}
    assert sources["later-turns"]["rows"] + sources["first-turns"]["rows"] == report["rows"]
