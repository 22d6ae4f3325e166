"""Greedy replay along a recorded answer: what eval-heads and the training summary report."""
import pytest
import torch

from vllm_mtpspec.tree import chain_tree, tree_from_paths
from vllm_mtpspec_train.evaluate import replay_tree


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
    from vllm_mtpspec.heads_init import init_heads
    from vllm_mtpspec.shards import write_shard
    from vllm_mtpspec_train.evaluate import context_bucket, evaluate_heads

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
    from vllm_mtpspec.heads_init import init_heads
    from vllm_mtpspec.shards import write_shard
    from vllm_mtpspec_train.evaluate import evaluate_heads

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


@torch.no_grad()
def test_replayed_grown_trees_accept_what_the_reference_decoder_accepts(tmp_path, tiny_model, tiny_model_dir):
    """Sequential heads' dynamic trees, replayed along the model's own greedy answer from
    its recorded states, accept exactly what decoding with them accepts step by step."""
    from vllm_mtpspec.config import SpecOptions
    from vllm_mtpspec.drafter import HeadsDrafter
    from vllm_mtpspec.heads_init import init_heads
    from vllm_mtpspec.reference import ReferenceDecoder
    from vllm_mtpspec.shards import write_shard
    from vllm_mtpspec_train.evaluate import evaluate_heads, grown_trees_along, replay_trees

    heads = init_heads(tiny_model, tiny_model_dir, num_heads=3, head_input="hidden+token", init_std=0.3, seed=1,
                       head_kind="sequential")
    with torch.no_grad():  # every depth keeps the root's state: it guesses the root's token again, and the
        for last in heads.last_layers():  # tiny model's greedy answers repeat tokens, so some are kept
            last.weight.mul_(0.01)
        heads.temperatures.fill_(0.05)  # sure enough of it to pass the default min_path_prob
    prompt = [3, 99, 100, 101, 7, 8, 200, 13]
    options = SpecOptions(tree="dynamic", max_tree_nodes=6, prompt_lookup_max=0)  # evaluate_heads' defaults
    decoded = ReferenceDecoder(tiny_model, HeadsDrafter(heads, tiny_model), options).decode(prompt, max_new_tokens=48)
    answer = decoded.tokens
    # Row r of the answer: the state that produced answer token r (the shards' layout).
    out = tiny_model.model(torch.tensor([prompt + answer]))
    hidden = out.last_hidden_state[0, len(prompt) - 1:len(prompt) - 1 + len(answer)]
    write_shard(tmp_path, 0, {"ids": ["a"], "categories": ["general"], "prompt_ids": [prompt],
                              "offsets": torch.tensor([0, len(answer)]), "tokens": torch.tensor(answer),
                              "hidden": hidden.float()})
    embed = tiny_model.get_input_embeddings().weight.detach()
    report = evaluate_heads(heads, sorted(tmp_path.glob("shard-*.pt")), lm_head=embed, embed=embed,
                            max_tree_nodes=6, prompt_lookup=None)
    assert set(report["mean_accepted_len"]) == {"chain", "dynamic"} and report["tree_nodes"]["dynamic"] == 6
    trees = grown_trees_along(heads, hidden, torch.tensor(answer), heads.lm_head_for(embed), embed, max_nodes=6,
                              top_k=options.dynamic_top_k, min_path_prob=options.min_path_prob)
    replayed = replay_trees(trees.__getitem__, torch.tensor(answer))
    decoded_lengths = [step.accepted_len for step in decoded.steps]
    # The replay stops where the answer does: the decoder's last step may run past it.
    assert replayed[:-1] == decoded_lengths[:len(replayed) - 1]
    assert report["mean_accepted_len"]["dynamic"] == pytest.approx(sum(replayed) / len(replayed), abs=1e-4)
    assert max(decoded_lengths) > 1  # some drafts were kept: the comparison is not of empty trees


def test_replayed_block_trees_accept_what_the_reference_decoder_accepts(tmp_path, tiny_model, tiny_model_dir,
                                                                        monkeypatch):
    """An attention draft block's dynamic trees, replayed along the model's own greedy
    answer from its recorded states (the prompt's rows before it), are the trees decoding
    grows step by step, path probabilities included, and accept what they accept."""
    import vllm_mtpspec.grown_tree
    import vllm_mtpspec_train.evaluate
    from vllm_mtpspec.config import SpecOptions
    from vllm_mtpspec.drafter import BlockDrafter
    from vllm_mtpspec.heads_init import init_draft_block
    from vllm_mtpspec.reference import ReferenceDecoder
    from vllm_mtpspec.shards import write_shard
    from vllm_mtpspec_train.evaluate import block_grown_trees_along, evaluate_heads, replay_trees

    block = init_draft_block(tiny_model, tiny_model_dir, num_heads=3).float().eval()
    with torch.no_grad():  # sure enough of its drafts (the tiny model's repeated token) to pass min_path_prob
        block.temperatures.fill_(0.2)
    grown, original = {"decoding": [], "replay": []}, vllm_mtpspec.grown_tree.grow_trees

    def recording(into):
        def grow(*args, **kwargs):
            trees = original(*args, **kwargs)
            grown[into].extend(trees)
            return trees
        return grow
    monkeypatch.setattr(vllm_mtpspec.grown_tree, "grow_trees", recording("decoding"))
    prompt = [3, 99, 100, 101, 7, 8, 200, 13]
    options = SpecOptions(tree="dynamic", max_tree_nodes=6, prompt_lookup_max=0)  # evaluate_heads' defaults
    decoded = ReferenceDecoder(tiny_model, BlockDrafter(block, tiny_model), options).decode(prompt, max_new_tokens=48)
    answer = decoded.tokens
    # Row p: the state at position p, which produced token p + 1 (the shards' layout).
    hidden = tiny_model.model(torch.tensor([prompt + answer])).last_hidden_state[0].detach().float()
    first = len(prompt) - 1
    shard = {"ids": ["a"], "categories": ["general"], "prompt_ids": [prompt],
             "offsets": torch.tensor([0, len(answer)]), "tokens": torch.tensor(answer),
             "hidden": hidden[first:first + len(answer)],
             "context_hidden": hidden[:first], "context_offsets": torch.tensor([0, first])}
    write_shard(tmp_path, 0, shard)
    embed = tiny_model.get_input_embeddings().weight.detach()
    lm_head = tiny_model.get_output_embeddings().weight.detach()
    report = evaluate_heads(block, sorted(tmp_path.glob("shard-*.pt")), lm_head=lm_head, embed=embed,
                            max_tree_nodes=6, prompt_lookup=None)
    assert set(report["mean_accepted_len"]) == {"chain", "dynamic"} and report["tree_nodes"]["dynamic"] == 6
    monkeypatch.setattr(vllm_mtpspec_train.evaluate, "grow_trees", recording("replay"))
    trees = block_grown_trees_along(block, shard, 0, block.lm_head_for(lm_head), embed, max_nodes=6,
                                    top_k=options.dynamic_top_k, min_path_prob=options.min_path_prob)
    row = 0  # the answer row each decoding step drafted from
    for tree, step in zip(grown["decoding"], decoded.steps):
        if row < len(answer):
            replayed_tree = grown["replay"][row]
            assert replayed_tree.shape == tree.shape and replayed_tree.tokens.tolist() == tree.tokens.tolist()
            assert replayed_tree.path_probs == pytest.approx(tree.path_probs, rel=1e-4, abs=1e-6)
        row += step.accepted_len
    replayed = replay_trees(trees.__getitem__, torch.tensor(answer))
    decoded_lengths = [step.accepted_len for step in decoded.steps]
    # The replay stops where the answer does: the decoder's last step may run past it.
    assert replayed[:-1] == decoded_lengths[:len(replayed) - 1]
    assert report["mean_accepted_len"]["dynamic"] == pytest.approx(sum(replayed) / len(replayed), abs=1e-4)
    # Drafts were kept, from trees of several depths (their branching is checked in test_draft_block.py).
    assert max(decoded_lengths) > 2 and max(len(paths) for paths, _ in trees) >= 3
