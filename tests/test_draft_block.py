"""The attention draft block: what training computes for every position at once is what
drafting computes one request at a time, from its cache of accepted entries."""
import pytest
import torch

from vllm_mtpspec.checkpoint import HeadsError, load_heads, save_heads
from vllm_mtpspec.config import BlockConfig, ConfigError, HeadsConfig
from vllm_mtpspec.draft_block import DraftBlock, rotary, rotate

D, VOCAB = 32, 50


def make_block(*, window: int = 1024, num_heads: int = 3, seed: int = 0, feature_layers=()) -> DraftBlock:
    config = HeadsConfig(num_heads=num_heads, hidden_size=D, vocab_size=VOCAB, head_kind="attention",
                         head_input="hidden+token",
                         block=BlockConfig(attention_heads=4, kv_heads=2, head_dim=8, mlp_size=64, window=window,
                                           feature_layers=list(feature_layers)))
    torch.manual_seed(seed)
    block = DraftBlock(config).double().eval()
    with torch.no_grad():  # non-trivial norms, so a wrong one shows
        for module in block.modules():
            if hasattr(module, "eps"):
                module.weight.uniform_(0.5, 1.5)
        if feature_layers:  # a trained fusion, not the zero it starts at
            block.layer_fuse.weight.normal_(0.0, 0.3)
    return block


def random_sequence(t: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(t, D, generator=generator, dtype=torch.float64)
    embed = torch.randn(VOCAB, D, generator=generator, dtype=torch.float64)
    tokens = torch.randint(0, VOCAB, (t + 4,), generator=generator)
    return features, embed, tokens


def unrolled_all(block, features, embed, tokens, depth, start_position=0):
    t = features.shape[0]
    embeds = [embed[tokens[i:i + t]][None] for i in range(depth)]
    positions = torch.arange(start_position, start_position + t)[None]
    return block.unrolled(features[None], embeds, positions, torch.ones(1, t, dtype=torch.bool))


def drafted_chain(block, cache, g, embed, tokens_after, depth):
    """g^1 (from extend) then depths 2..depth as drafting runs them (each depth's entry
    appended, then all cut off), the chain's tokens given."""
    out, end = [g], cache.length
    for j in range(2, depth + 1):
        g = block.extend(cache, g[None], embed[tokens_after[j - 2]][None])[-1]
        out.append(g)
    block.truncate(cache, end)
    return out


@torch.no_grad()
def test_drafting_from_the_cache_matches_the_unrolled_training_pass_at_every_position():
    block = make_block()
    t, depth = 10, 3
    features, embed, tokens = random_sequence(t)
    expected = unrolled_all(block, features, embed, tokens, depth)
    for p in range(t):
        cache = block.empty_cache(dtype=torch.float64)
        g = block.extend(cache, features[:p + 1], embed[tokens[:p + 1]])[-1]
        # depth j reads the token drafted at depth j - 1: along a right chain, s_{p+j}.
        got = drafted_chain(block, cache, g, embed, tokens[p + 1:], depth)
        for j in range(depth):
            torch.testing.assert_close(got[j], expected[j][0, p])
        assert cache.length == p + 1  # drafting left no entries behind


@torch.no_grad()
def test_a_block_reading_other_layers_drafts_from_the_cache_what_training_computes():
    """The layer features enter the context's entries only: a chain's own entries (depth
    > 1) have no target states, in training and in drafting alike."""
    block = make_block(feature_layers=[0, 2])
    t, depth = 9, 3
    features, embed, tokens = random_sequence(t)
    layers = torch.randn(t, 2, D, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    embeds = [embed[tokens[i:i + t]][None] for i in range(depth)]
    expected = block.unrolled(features[None], embeds, torch.arange(t)[None], torch.ones(1, t, dtype=torch.bool),
                              layers[None])
    without = block.unrolled(features[None], embeds, torch.arange(t)[None], torch.ones(1, t, dtype=torch.bool),
                             torch.zeros_like(layers)[None])
    assert not torch.allclose(expected[0], without[0])  # the layers change what it drafts
    for p in (1, 4, t - 1):
        cache = block.empty_cache(dtype=torch.float64)
        # In two pieces, the way decoding feeds a prefill and then accepted rows.
        a = p // 2 + 1
        block.extend(cache, features[:a], embed[tokens[:a]], layers[:a])
        g = block.extend_many([cache], [features[a:p + 1]], [embed[tokens[a:p + 1]]], [layers[a:p + 1]])[0][-1]
        got = drafted_chain(block, cache, g, embed, tokens[p + 1:], depth)
        for j in range(depth):
            torch.testing.assert_close(got[j], expected[j][0, p])
    with pytest.raises(ValueError, match="feature_layers"):
        block.unrolled(features[None], embeds, torch.arange(t)[None], torch.ones(1, t, dtype=torch.bool))


@torch.no_grad()
def test_a_block_grown_to_read_other_layers_starts_as_the_block_it_grew_from():
    from vllm_mtpspec.heads_init import grown_block

    block = make_block()
    grown = grown_block(block, [1, 3])
    assert grown.feature_layers == [1, 3] and block.feature_layers == []
    t, depth = 8, 3
    features, embed, tokens = random_sequence(t)
    layers = torch.randn(1, t, 2, D, dtype=torch.float64)
    embeds = [embed[tokens[i:i + t]][None] for i in range(depth)]
    args = (features[None], embeds, torch.arange(t)[None], torch.ones(1, t, dtype=torch.bool))
    for before, after in zip(block.unrolled(*args), grown.unrolled(*args, layers)):
        torch.testing.assert_close(after, before)
    with pytest.raises(ConfigError, match="already reads layers"):
        grown_block(grown, [2])


@torch.no_grad()
def test_requests_extended_together_get_what_each_gets_alone():
    block = make_block()
    features, embed, tokens = random_sequence(12)
    caches = [block.empty_cache(dtype=torch.float64) for _ in range(3)]
    block.extend(caches[0], features[:5], embed[tokens[:5]])     # three requests at different lengths
    block.extend(caches[2], features[:9], embed[tokens[:9]])
    alone = [block.extend(c, f, e) for c, f, e in zip(
        [c.clone() for c in caches],
        [features[5:7], features[:3], features[9:10]], [embed[tokens[5:7]], embed[tokens[:3]], embed[tokens[9:10]]])]
    together = block.extend_many(caches, [features[5:7], features[:3], features[9:10]],
                                 [embed[tokens[5:7]], embed[tokens[:3]], embed[tokens[9:10]]])
    for mine, theirs in zip(together, alone):
        torch.testing.assert_close(mine, theirs)
    assert [c.length for c in caches] == [7, 3, 10]


@torch.no_grad()
def test_requests_extended_together_compute_their_own_rows_only():
    """A step that prefills a long prompt beside one-token decodes: every product of the
    block reads the requests' rows packed, never each request padded to the longest."""
    block = make_block()
    features, embed, tokens = random_sequence(12)
    caches = [block.empty_cache(dtype=torch.float64) for _ in range(4)]
    block.extend(caches[1], features[:3], embed[tokens[:3]])
    rows_read = []
    hooks = [m.register_forward_hook(lambda m, args, out: rows_read.append(args[0].reshape(-1, args[0].shape[-1]).shape[0]))
             for m in (block.fuse, block.q_proj, block.o_proj, block.down_proj)]
    block.extend_many(caches, [features[:9], features[3:4], features[:1], features[:1]],
                      [embed[tokens[:9]], embed[tokens[3:4]], embed[tokens[:1]], embed[tokens[:1]]])
    for hook in hooks:
        hook.remove()
    assert rows_read == [12, 12, 12, 12]


@torch.no_grad()
def test_extending_in_pieces_is_extending_at_once():
    block = make_block()
    features, embed, tokens = random_sequence(9)
    whole = block.extend(block.empty_cache(dtype=torch.float64), features, embed[tokens[:9]])
    cache = block.empty_cache(dtype=torch.float64)
    parts = [block.extend(cache, features[a:b], embed[tokens[a:b]]) for a, b in ((0, 4), (4, 5), (5, 9))]
    torch.testing.assert_close(torch.cat(parts), whole)


@torch.no_grad()
def test_attention_one_request_at_a_time_gives_what_the_padded_batch_gives(monkeypatch):
    """A CPU attends one request at a time; other devices pad every request's keys to one
    batch. Both, for requests of unequal contexts and rows, past the window too."""
    block = make_block(window=6)
    features, embed, tokens = random_sequence(16)
    lm_head = torch.randn(VOCAB, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def extended_and_drafted():
        caches = [block.empty_cache(dtype=torch.float64) for _ in range(3)]
        for cache, length in zip(caches, (3, 9, 5)):
            block.extend(cache, features[:length], embed[tokens[:length]])
        rows = [slice(3, 5), slice(9, 10), slice(5, 8)]
        out = block.extend_many(caches, [features[r] for r in rows], [embed[tokens[r]] for r in rows])
        drafts = block.draft_chains(caches, torch.stack([o[-1] for o in out]), 3, lambda x: x @ lm_head.T,
                                    lambda t: embed[t])
        return out, drafts

    each_out, each_drafts = extended_and_drafted()
    monkeypatch.setattr(DraftBlock, "_attend_each", DraftBlock._attend_padded)
    padded_out, padded_drafts = extended_and_drafted()
    for got, expected in zip(padded_out, each_out):
        torch.testing.assert_close(got, expected)
    torch.testing.assert_close(padded_drafts, each_drafts)


@torch.no_grad()
def test_the_window_keeps_the_last_entries_only():
    window = 4
    block = make_block(window=window)
    features, embed, tokens = random_sequence(11)
    cache = block.empty_cache(dtype=torch.float64)
    for p in range(11):
        g = block.extend(cache, features[p:p + 1], embed[tokens[p:p + 1]])[-1]
        block.trim(cache)
    assert cache.size == window and cache.length == 11
    # RoPE scores depend on distances only: the last `window` entries alone, anywhere, give the same.
    alone = unrolled_all(block, features[-window:], embed, tokens[11 - window:], 1, start_position=3)
    torch.testing.assert_close(g, alone[0][0, -1])
    # A deeper draft sees the window too: its own entry plus the newest window - 1.
    g2 = block.extend(cache, g[None], embed[tokens[11]][None])[-1]
    block.truncate(cache, 11)
    newest = block.empty_cache(dtype=torch.float64)
    block.extend(newest, features[-(window - 1):], embed[tokens[11 - (window - 1):11]])
    torch.testing.assert_close(g2, block.extend(newest, g[None], embed[tokens[11]][None])[-1])


def test_padding_does_not_reach_real_positions():
    block = make_block()
    features, embed, tokens = random_sequence(6)
    short = unrolled_all(block, features[:4], embed, tokens, 2)
    padded_features = torch.cat([features[:4], torch.randn(2, D, dtype=torch.float64)])[None]
    embeds = [embed[torch.cat([tokens[i:i + 4], torch.tensor([7, 9])])][None] for i in range(2)]
    valid = torch.tensor([[True] * 4 + [False] * 2])
    padded = block.unrolled(padded_features, embeds, torch.arange(6)[None], valid)
    for j in range(2):
        torch.testing.assert_close(padded[j][0, :4], short[j][0])


def test_rope_rotates_by_distance():
    q, k = torch.randn(1, 8, dtype=torch.float64), torch.randn(1, 8, dtype=torch.float64)
    rope = lambda x, p: rotate(x, *rotary(torch.tensor([p]), x.shape[-1], 100.0, x.dtype))  # noqa: E731
    score = lambda a, b: (rope(q, a) * rope(k, b)).sum()  # noqa: E731
    torch.testing.assert_close(score(5, 2), score(13, 10))
    assert not torch.allclose(score(5, 2), score(5, 4))


def test_a_draft_block_saves_loads_and_refuses_disagreeing_directories(tmp_path):
    block = make_block().float()
    save_heads(block, tmp_path / "block")
    loaded = load_heads(tmp_path / "block")
    assert isinstance(loaded, DraftBlock) and loaded.config.block == block.config.block
    for name, tensor in block.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)
    # A config whose head kind disagrees with the weights is refused by file and field.
    config_path = tmp_path / "block" / "config.json"
    config_path.write_text(config_path.read_text().replace('"head_kind": "attention"', '"head_kind": "parallel"'))
    with pytest.raises(HeadsError, match="config.json: head_kind='parallel' with block=set"):
        load_heads(tmp_path / "block")


def test_a_block_reading_layers_saves_loads_and_is_refused_where_its_config_disagrees(tmp_path):
    from vllm_mtpspec.checkpoint import check_heads_match_model, read_heads_config

    block = make_block(feature_layers=[1, 4]).float()
    save_heads(block, tmp_path / "block")
    loaded = load_heads(tmp_path / "block")
    assert loaded.feature_layers == [1, 4]
    for name, tensor in block.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)
    config = read_heads_config(tmp_path / "block")
    # A model with fewer layers than the block reads.
    with pytest.raises(HeadsError, match=r"config.json: block.feature_layers=\[1, 4\] but the model has 4 layers"):
        check_heads_match_model(config, heads_dir=tmp_path / "block", hidden_size=D, vocab_size=VOCAB,
                                fingerprint=None, num_layers=4)
    check_heads_match_model(config, heads_dir=tmp_path / "block", hidden_size=D, vocab_size=VOCAB,
                            fingerprint=None, num_layers=5)
    # Weights of a fusion the config does not declare: refused, naming the file.
    config_path = tmp_path / "block" / "config.json"
    config_path.write_text(config_path.read_text().replace('"feature_layers": [\n      1,\n      4\n    ]',
                                                           '"feature_layers": []'))
    assert read_heads_config(tmp_path / "block").block.feature_layers == []
    with pytest.raises(HeadsError, match="heads.safetensors"):
        load_heads(tmp_path / "block")


def test_new_blocks_are_refused_layers_the_target_lacks():
    from vllm_mtpspec.heads_init import check_feature_layers

    with pytest.raises(ConfigError, match=r"feature_layers=\[2, 30\]: layers \[30\] are not among the target's 30 layers"):
        check_feature_layers([2, 30], 30, where="feature_layers")
    check_feature_layers([0, 15, 29], 30, where="feature_layers")


def test_block_configs_are_checked():
    with pytest.raises(ConfigError, match="head_kind='attention' with block=unset"):
        HeadsConfig(num_heads=2, hidden_size=D, vocab_size=VOCAB, head_kind="attention")
    with pytest.raises(ConfigError, match="head_kind='nested'"):
        HeadsConfig(num_heads=2, hidden_size=D, vocab_size=VOCAB, head_kind="nested")
    with pytest.raises(ConfigError, match="block.attention_heads=6 is not a multiple of block.kv_heads=4"):
        BlockConfig(attention_heads=6, kv_heads=4, head_dim=8, mlp_size=8)
    with pytest.raises(ConfigError, match=r"block: unknown field\(s\) \['heads'\]"):
        HeadsConfig(num_heads=2, hidden_size=D, vocab_size=VOCAB, head_kind="attention",
                    block={"attention_heads": 4, "kv_heads": 2, "head_dim": 8, "mlp_size": 8, "heads": 3})
    with pytest.raises(ConfigError, match="tied=false"):
        HeadsConfig(num_heads=2, hidden_size=D, vocab_size=VOCAB, head_kind="attention", tied=False,
                    block=BlockConfig(attention_heads=4, kv_heads=2, head_dim=8, mlp_size=8))


def test_a_draft_vocabulary_copy_keeps_the_block():
    block = make_block().float()
    ids = torch.tensor([3, 1, 7, 20])
    small = block.with_draft_vocab(ids)
    assert isinstance(small, DraftBlock) and torch.equal(small.draft_vocab, ids)
    torch.testing.assert_close(small.fuse.weight, block.fuse.weight)


def tiny_block_for(model, *, num_heads: int = 3, seed: int = 0, feature_layers=()) -> DraftBlock:
    cfg = model.config
    config = HeadsConfig(num_heads=num_heads, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                         head_kind="attention", head_input="hidden+token",
                         block=BlockConfig(attention_heads=4, kv_heads=2, head_dim=16, mlp_size=96,
                                           feature_layers=list(feature_layers)))
    torch.manual_seed(seed)
    block = DraftBlock(config).eval()
    if feature_layers:  # a fusion that matters, not the zero it starts at
        torch.nn.init.normal_(block.layer_fuse.weight, std=0.02)
    return block


@pytest.mark.parametrize("feature_layers", [(), (2, 15)], ids=["final state", "layers 2 and 15 too"])
@torch.no_grad()
def test_reference_decoding_with_a_block_is_lossless_and_drafts_what_the_scorer_replays(smollm2_fp32, feature_layers):
    """The scorer's replay (teacher forcing along the answer) and real decoding must read
    the same cache at every step: any entry missed, doubled or left from a rejected draft
    changes the depth-1 draft. A random block on the real SmolLM2 (a tiny random model
    only repeats one token, where a shifted cache goes unseen)."""
    from types import SimpleNamespace

    from vllm_mtpspec.config import SpecOptions
    from vllm_mtpspec.drafter import drafter_for
    from vllm_mtpspec.prompts import apply_chat_template
    from vllm_mtpspec.reference import ReferenceDecoder, plain_greedy
    from vllm_mtpspec_train.answers import shard_from_answers
    from vllm_mtpspec_train.evaluate import block_answer_logits

    model, tokenizer = smollm2_fp32.model, smollm2_fp32.tokenizer
    text = "Copy this list twice: apple, pear, plum, fig, lime, kiwi."
    prompt = tokenizer.encode(apply_chat_template(tokenizer, text), add_special_tokens=False)
    expected = plain_greedy(model, prompt, max_new_tokens=48, eos_token_ids=set())
    block = tiny_block_for(model, feature_layers=feature_layers)
    drafter = drafter_for(block, model)
    first_drafts = []
    draft = drafter.head_logits

    def recording(hidden, root):
        logits = draft(hidden, root)
        first_drafts.append(logits[0, 0])
        return logits
    drafter.head_logits = recording
    result = ReferenceDecoder(model, drafter, SpecOptions()).decode(prompt, max_new_tokens=48)
    assert result.tokens == expected
    assert any(step.accepted_len > 2 for step in result.steps)  # steps that kept several rows
    shard = shard_from_answers(SimpleNamespace(model=model), ["a"], ["general"], [prompt], [expected],
                               top_k=4, context_rows=512, feature_layers=list(feature_layers))
    replay = torch.cat([logits for _, logits in block_answer_logits(
        block, shard, 0, model.get_output_embeddings().weight, model.get_input_embeddings().weight)])
    row = 0  # the answer row of each step's root
    for step, logits in zip(result.steps, first_drafts):
        # The shard keeps states in fp16: the same drafts, to that precision.
        torch.testing.assert_close(logits, replay[row, 0], atol=0.05, rtol=0.02)
        row += step.accepted_len
    assert len(first_drafts) == len(result.steps) and drafter.cache.length == len(prompt) + row - 1


def served_setting():
    """A small fp32 block, 14 rows of states and their tokens, and a model around its embedding
    and LM head: what the served-cache tests feed the block and its reference drafter."""
    block = make_block(num_heads=3).float()
    features, embed, tokens = random_sequence(14)
    features, embed = features.float(), embed.float()
    lm_head = torch.randn(VOCAB, D)
    return block, features, embed, tokens, lm_head, SimpleModel(embed, lm_head)


@torch.no_grad()
def test_served_drafts_follow_the_same_chain_as_the_reference_drafter():
    """vLLM's side (block_context.py: caches fed from a step's rows, chains drafted from
    them) against the reference drafter, for two requests in one batch."""
    import numpy as np

    from vllm_mtpspec.drafter import BlockDrafter
    from vllm_mtpspec.vllm.block_context import BlockContexts, ScheduledRows

    block, features, embed, tokens, lm_head, model = served_setting()
    contexts = BlockContexts(block, model.get_input_embeddings())
    # Request "a": a prefill of 6 rows; request "b": 8 rows, whose last produced token was just sampled.
    token_ids = np.zeros((2, 20), dtype=np.int64)
    token_ids[0, :7], token_ids[1, :9] = tokens[:7].numpy(), tokens[5:14].numpy()
    rows = ScheduledRows(hidden_states=torch.cat([features[:6], features[6:14]]), num_scheduled=[6, 8],
                         num_computed=[0, 0])
    contexts.update(["a", "b"], rows, [7, 9], token_ids)
    probs = contexts.chain_probs([0, 1], ["a", "b"], 3, lambda x: x @ lm_head.T, torch.ones(3), None)
    for batch_index, (states, seq) in enumerate([(features[:6], tokens[:7]), (features[6:14], tokens[5:14])]):
        drafter = BlockDrafter(block, model)
        drafter.start()
        drafter.observe(states[:-1], seq[1:-1])
        expected = drafter.head_logits(states[-1:], seq[-1:])[0]
        torch.testing.assert_close(probs[batch_index], torch.softmax(expected, -1))


@torch.no_grad()
def test_while_the_heads_rest_a_request_keeps_its_latest_rows_unrun_and_drafts_from_them():
    """A step where the heads do not run: a request past max_pending_rows runs nothing
    through the block and keeps its last recent_rows rows; the next draft reads the block
    over those rows alone (as a request whose context began there), and a leaver stores
    only entries already run."""
    import numpy as np

    from vllm_mtpspec.drafter import BlockDrafter
    from vllm_mtpspec.vllm.block_context import BlockContexts, ScheduledRows
    from vllm_mtpspec.vllm.context_store import ContextStore

    block, features, embed, tokens, lm_head, model = served_setting()
    contexts = BlockContexts(block, model.get_input_embeddings(), store=ContextStore(max_bytes=1 << 20))
    contexts.max_pending_rows, contexts.recent_rows = 8, 3
    runs = []
    extend_many = block.extend_many
    block.extend_many = lambda *args: runs.append(sum(s.shape[0] for s in args[1])) or extend_many(*args)
    token_ids = np.zeros((1, 20), dtype=np.int64)
    token_ids[0, :14] = tokens[:14].numpy()
    rows = ScheduledRows(hidden_states=features[:13], num_scheduled=[13], num_computed=[0])
    contexts.update(["a"], rows, [14], token_ids, long_rest=True)
    assert runs == []
    assert contexts.caches["a"].length == 10 and contexts.pending["a"].rows == 3
    probs = contexts.chain_probs([0], ["a"], 3, lambda x: x @ lm_head.T, torch.ones(3), None)
    assert runs[0] == 3  # the kept rows, then the chain's own steps
    drafter = BlockDrafter(block, model)
    drafter.start()
    drafter.observe(features[10:12], tokens[11:13])
    expected = drafter.head_logits(features[12:13], tokens[13:14])[0]
    torch.testing.assert_close(probs[0], torch.softmax(expected, -1))
    ran = len(runs)
    stored = []
    contexts.store.put = lambda tokens, cache: stored.append((len(tokens), cache.start, cache.size))
    # One more row, then the request leaves while the heads rest: the store gets the three
    # entries run, and the new row is not run for it.
    token_ids[0, 14] = 5
    contexts.update(["a"], ScheduledRows(hidden_states=features[13:14], num_scheduled=[1], num_computed=[13]),
                    [15], token_ids, long_rest=True)
    contexts.update([], ScheduledRows(hidden_states=features[:0], num_scheduled=[], num_computed=[]), [], token_ids,
                    long_rest=True)
    assert len(runs) == ran and not contexts.held_requests()
    assert stored == [(14, 10, 3)]  # tokens 0..13 key entries 10..12


@torch.no_grad()
def test_after_a_tree_step_the_served_cache_takes_the_rows_of_the_accepted_path():
    """A tree step's rows are the root and every node breadth-first; the accepted path's
    are the root's and its nodes' (tree_paths), not the first rows after the root."""
    import numpy as np

    from vllm_mtpspec.drafter import BlockDrafter
    from vllm_mtpspec.vllm.block_context import BlockContexts, ScheduledRows

    block, features, embed, tokens, lm_head, model = served_setting()
    contexts = BlockContexts(block, model.get_input_embeddings())
    token_ids = np.zeros((1, 20), dtype=np.int64)
    token_ids[0, :7] = tokens[:7].numpy()
    contexts.update(["a"], ScheduledRows(hidden_states=features[:6], num_scheduled=[6], num_computed=[0]), [7],
                    token_ids)
    # The root at position 6 and five nodes; nodes 1 and 4 (rows 2 and 5) were accepted,
    # then the bonus token: positions 7..9 now hold tokens 7..9.
    step_rows = features[6:12]
    token_ids[0, 7:10] = tokens[7:10].numpy()
    contexts.update(["a"], ScheduledRows(hidden_states=step_rows, num_scheduled=[6], num_computed=[6]), [10],
                    token_ids, tree_paths={0: [0, 2, 5]})
    probs = contexts.chain_probs([0], ["a"], 3, lambda x: x @ lm_head.T, torch.ones(3), None)
    drafter = BlockDrafter(block, model)
    drafter.start()
    drafter.observe(torch.cat([features[:6], step_rows[[0, 2]]]), tokens[1:9])
    expected = drafter.head_logits(step_rows[5:6], tokens[9:10])[0]
    torch.testing.assert_close(probs[0], torch.softmax(expected, -1))


@torch.no_grad()
def test_a_block_with_a_draft_vocabulary_drafts_the_whole_blocks_chain_among_its_tokens():
    """Each depth picks its top-1 among the kept tokens and the next depth reads that
    token's target id: the whole block, its logits masked to the kept tokens, drafts the
    same chain, by the reference drafter and by the served contexts alike."""
    import numpy as np

    from vllm_mtpspec.drafter import BlockDrafter
    from vllm_mtpspec.vllm.block_context import BlockContexts, ScheduledRows

    block = make_block(num_heads=3).float()
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:20]  # not in id order
    small = block.with_draft_vocab(ids)
    features, embed, tokens = random_sequence(12)
    features, embed, seq = features.float(), embed.float(), tokens[:13]  # each row produced the next token
    lm_head = torch.randn(VOCAB, D)
    model = SimpleModel(embed, lm_head)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False

    def drafted(drafter):
        drafter.start()
        drafter.observe(features[:-1], seq[1:-1])
        return drafter.head_logits(features[-1:], seq[-1:])[0]

    whole = BlockDrafter(block, model)
    whole._project = lambda g: (g @ lm_head.T).masked_fill(outside, float("-inf"))
    expected = drafted(whole)
    got = drafted(BlockDrafter(small, model))
    assert got.shape == (3, VOCAB)
    torch.testing.assert_close(got, expected)
    assert len(set(expected.argmax(-1).tolist())) > 1  # a chain that moves, so a wrong map would show
    # Served: one prefill of the same rows, chains over the draft vocabulary's N entries.
    contexts = BlockContexts(small, model.get_input_embeddings())
    token_ids = np.zeros((1, 16), dtype=np.int64)
    token_ids[0, :13] = seq.numpy()
    rows = ScheduledRows(hidden_states=features, num_scheduled=[12], num_computed=[0])
    contexts.update(["a"], rows, [13], token_ids)
    probs = contexts.chain_probs([0], ["a"], 3, small.lm_head_for(lm_head), torch.ones(3), ids)
    torch.testing.assert_close(probs[0], torch.softmax(expected[:, ids], -1))


@torch.no_grad()
@pytest.mark.parametrize("matrices", ["fp32", "int2"])
def test_reference_decoding_with_a_draft_vocabulary_block_is_lossless(smollm2_fp32, matrices):
    """A block drafting among a draft vocabulary on the real SmolLM2 (in full precision or
    INT2): the output is the model's own, and every drafted token is one the vocabulary
    holds."""
    from vllm_mtpspec.config import SpecOptions
    from vllm_mtpspec.drafter import drafter_for
    from vllm_mtpspec.prompts import apply_chat_template
    from vllm_mtpspec.reference import ReferenceDecoder, plain_greedy

    model, tokenizer = smollm2_fp32.model, smollm2_fp32.tokenizer
    text = "Copy this list twice: apple, pear, plum, fig, lime, kiwi."
    prompt = tokenizer.encode(apply_chat_template(tokenizer, text), add_special_tokens=False)
    expected = plain_greedy(model, prompt, max_new_tokens=48, eos_token_ids=set())
    # Most of the answer's tokens and a spread of others; a few of the answer's left out.
    answer = sorted(set(expected))
    ids = torch.tensor(sorted(set(answer[: -3]) | set(range(0, model.config.vocab_size, 17))))
    block = tiny_block_for(model)
    if matrices == "int2":
        block = block.quantized(group_size=64)
    block = block.with_draft_vocab(ids)
    drafter = drafter_for(block, model)
    drafted = []
    draft = drafter.head_logits

    def recording(hidden, root):
        logits = draft(hidden, root)
        drafted.extend(logits[0].argmax(-1).tolist())
        return logits
    drafter.head_logits = recording
    result = ReferenceDecoder(model, drafter, SpecOptions()).decode(prompt, max_new_tokens=48)
    assert result.tokens == expected
    assert any(step.accepted_len > 2 for step in result.steps)
    assert drafted and set(drafted) <= set(ids.tolist())


@torch.no_grad()
@pytest.mark.parametrize("held_back", [0, 100], ids=["run at once", "held back"])
def test_a_served_cache_that_ends_elsewhere_than_the_step_begins_is_cut_back_or_started_again(held_back):
    """Preemption recomputes positions the cache holds: it is cut back to where the step
    begins. A prefix-cache hit skips positions it never saw: it starts again there. Either
    way a request drafts from what a cache of exactly the positions it was fed holds,
    whether its rows ran through the block at once or were held back until the draft."""
    import numpy as np

    from vllm_mtpspec.vllm.block_context import BlockContexts, ScheduledRows

    block = make_block(num_heads=2)
    features, embed, tokens = random_sequence(16)
    contexts = BlockContexts(block, torch.nn.Embedding.from_pretrained(embed))
    contexts.max_pending_rows = held_back
    token_ids = np.zeros((1, 24), dtype=np.int64)
    token_ids[0, :20] = tokens.numpy()

    def step(start: int, n: int, drafted: bool = True) -> torch.Tensor | None:
        """vLLM computes positions start .. start + n - 1, each producing a known token;
        drafted: the request is then drafted for (its newest output)."""
        rows = ScheduledRows(hidden_states=features[start:start + n], num_scheduled=[n], num_computed=[start])
        contexts.update(["a"], rows, [start + n + 1], token_ids)
        if drafted:
            contexts._run_pending(["a"])
            return contexts.newest["a"]
        return None

    def fed_only(start: int, end: int) -> torch.Tensor:
        """The output at position end - 1 of a cache fed positions start .. end - 1 alone."""
        cache = block.empty_cache(dtype=torch.float64)
        cache.start = start
        return block.extend(cache, features[start:end], embed[tokens[start + 1:end + 1]])[-1]

    torch.testing.assert_close(step(4, 4), fed_only(4, 8))       # a prefix-cache hit on positions 0-3
    assert contexts.caches["a"].start == 4 and contexts.caches["a"].length == 8
    torch.testing.assert_close(step(8, 2), fed_only(4, 10))      # decoding on from there
    torch.testing.assert_close(step(6, 3), fed_only(4, 9))       # preempted: 6-9 computed again, cut back
    assert contexts.caches["a"].length == 9
    torch.testing.assert_close(step(2, 5), fed_only(2, 7))       # recomputed from before the cache began
    torch.testing.assert_close(step(9, 2), fed_only(9, 11))      # positions 7-8 skipped: started again
    assert contexts.caches["a"].start == 9
    # Steps not drafted for: rows held back are cut back too, then run when a draft asks.
    step(11, 1, drafted=False)
    step(12, 2, drafted=False)
    assert contexts.caches["a"].length == (11 if held_back else 14)
    torch.testing.assert_close(step(13, 2), fed_only(9, 15))     # 13 computed again, cut from what is held
    assert contexts.caches["a"].length == 15


@torch.no_grad()
def test_rows_wait_for_a_draft_and_run_together_once_a_request_holds_enough():
    """Steps nobody drafts for run nothing through the block; a request's rows run once it
    holds max_pending_rows of them, or when it is drafted for, into the same entries. What
    it holds is a copy, not vLLM's buffer (vLLM reuses it): of the step's rows in a decode
    step, of its own where a request took a prompt's chunk."""
    import numpy as np

    from vllm_mtpspec.vllm.block_context import BlockContexts, ScheduledRows

    block = make_block(num_heads=2)
    features, embed, tokens = random_sequence(12)
    contexts = BlockContexts(block, torch.nn.Embedding.from_pretrained(embed))
    contexts.max_pending_rows = 5
    contexts.max_shared_rows = 2  # the first step, with 3 rows of "a", counts as a prompt's chunk
    token_ids = np.zeros((2, 20), dtype=np.int64)
    token_ids[0, :16] = tokens.numpy()
    token_ids[1, :16] = tokens.flip(0).numpy()
    passes = []
    extend_many = block.extend_many
    block.extend_many = lambda caches, *args: passes.append(len(caches)) or extend_many(caches, *args)
    lm_head = torch.randn(VOCAB, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))

    def step(start: list[int], n: list[int]) -> None:
        states = torch.cat([features[s:s + k] for s, k in zip(start, n)])
        contexts.update(["a", "b"], ScheduledRows(states, n, start), [s + k + 1 for s, k in zip(start, n)],
                        token_ids)
        states.fill_(float("nan"))  # vLLM writes its next step's states over this one's

    step([0, 0], [3, 2])
    step([3, 2], [1, 1])
    assert passes == [] and contexts.pending["a"].rows == 4 and contexts.caches["a"].size == 0
    step([4, 3], [2, 1])                                          # "a" holds 6 rows: they run; "b" 4 wait
    assert passes == [1] and contexts.caches["a"].length == 6 and "a" not in contexts.pending
    assert contexts.pending["b"].rows == 4 and contexts.caches["b"].size == 0
    def rows_in_storage(held: torch.Tensor) -> int:
        return held.untyped_storage().nbytes() // (held.shape[1] * held.element_size())

    first, last = contexts.pending["b"].states[0], contexts.pending["b"].states[-1]
    assert (first.shape[0], rows_in_storage(first)) == (2, 2)  # its own copy: "a" prefilled beside it
    assert (last.shape[0], rows_in_storage(last)) == (1, 3)    # a view of the step's 3 accepted rows
    probs = contexts.chain_probs([1], ["a", "b"], 2, lambda x: x @ lm_head.T, torch.ones(2), None)
    assert passes == [1, 1] and contexts.caches["b"].length == 4 and "b" not in contexts.pending
    alone = block.empty_cache(dtype=torch.float64)
    newest = block.extend(alone, features[:4], embed[torch.as_tensor(token_ids[1, 1:5])])[-1]
    expected = block.draft_chains([alone], newest[None], 2, lambda x: x @ lm_head.T, lambda t: embed[t])
    torch.testing.assert_close(probs, torch.softmax(expected.float(), -1).to(probs.dtype))


@torch.no_grad()
def test_the_held_out_replay_grows_at_every_answer_row_the_tree_a_drafter_fed_up_to_it_grows(monkeypatch):
    """vllm_mtpspec_train.evaluate.block_grown_trees_along against the reference drafter fed the
    shard's rows up to each answer row: the same trees, path probabilities included."""
    import vllm_mtpspec_train.evaluate
    from vllm_mtpspec.drafter import BlockDrafter
    from vllm_mtpspec.grown_tree import grow_trees
    from vllm_mtpspec_train.evaluate import block_grown_trees_along

    block = make_block(num_heads=3).float()
    features, embed, tokens = random_sequence(16)
    features, embed = features.float(), embed.float()
    lm_head = 3 * torch.randn(VOCAB, D, generator=torch.Generator().manual_seed(2))
    model = SimpleModel(embed, lm_head)
    # Rows 0..7 are the prompt's (they produced prompt tokens 1..8), rows 8..15 the answer's.
    prompt, answer = tokens[:9], tokens[9:17]
    shard = {"prompt_ids": [prompt.tolist()], "offsets": torch.tensor([0, 8]), "tokens": answer,
             "hidden": features[8:], "context_hidden": features[:8], "context_offsets": torch.tensor([0, 8])}
    replayed = []

    def recording(*args, **kwargs):
        trees = grow_trees(*args, **kwargs)
        replayed.extend(trees)
        return trees
    monkeypatch.setattr(vllm_mtpspec_train.evaluate, "grow_trees", recording)
    tree = dict(max_nodes=10, top_k=3, min_path_prob=0.0)
    paths = block_grown_trees_along(block, shard, 0, lambda g: g @ lm_head.T, embed, chunk=3, **tree)
    assert len(paths) == len(replayed) == 8
    for r in range(8):
        q = 8 + r
        drafter = BlockDrafter(block, model)
        drafter.start()
        drafter.observe(features[:q], tokens[1:q + 1])
        expected, = grow_trees(drafter.draft_step(), features[q:q + 1], tokens[q + 1:q + 2], depth=3, **tree)
        assert replayed[r].shape == expected.shape and len(expected.shape) == 10
        assert replayed[r].tokens.tolist() == expected.tokens.tolist() and paths[r][1] == expected.tokens.tolist()
        assert replayed[r].path_probs == pytest.approx(expected.path_probs, rel=1e-4)


def test_the_reference_decoder_refuses_a_fixed_tree_shape_for_a_block(tiny_model, tiny_model_dir):
    from vllm_mtpspec.config import SpecOptions
    from vllm_mtpspec.drafter import BlockDrafter
    from vllm_mtpspec.heads_init import init_draft_block
    from vllm_mtpspec.reference import ReferenceDecoder

    block = init_draft_block(tiny_model, tiny_model_dir, num_heads=2)
    with pytest.raises(ConfigError, match=r"tree='consensus': head_kind='attention' drafts chains and dynamic trees "
                                          r"only .*; use tree='chain' or tree='dynamic'$"):
        ReferenceDecoder(tiny_model, BlockDrafter(block, tiny_model), SpecOptions(tree="consensus"))


@torch.no_grad()
def test_reference_decoding_with_the_trained_block_growing_trees_is_lossless(smollm2_fp32):
    """The shipped-format trained block (reading layers 2, 15 and 27) grows dynamic trees
    on the real SmolLM2: the output is the model's own, trees of several branches are
    verified, and the block's cache ends holding exactly the accepted positions."""
    from vllm_mtpspec.config import SpecOptions
    from vllm_mtpspec.drafter import drafter_for
    from vllm_mtpspec.prompts import apply_chat_template
    from vllm_mtpspec.reference import ReferenceDecoder, plain_greedy
    from vllm_mtpspec.shipped import shipped_heads_dir

    model, tokenizer = smollm2_fp32.model, smollm2_fp32.tokenizer
    text = "Write a Python function that returns the squares of the even numbers in a list."
    prompt = tokenizer.encode(apply_chat_template(tokenizer, text), add_special_tokens=False)
    expected = plain_greedy(model, prompt, max_new_tokens=48, eos_token_ids=set())
    block = load_heads(shipped_heads_dir())  # the shipped drafter is a trained block
    drafter = drafter_for(block, model)
    options = SpecOptions(tree="dynamic", max_tree_nodes=12, dynamic_top_k=3, min_path_prob=0.0,
                          prompt_lookup_max=0)
    result = ReferenceDecoder(model, drafter, options).decode(prompt, max_new_tokens=48)
    assert result.tokens == expected
    assert all(step.num_nodes == 12 for step in result.steps[:-1])  # trees, not chains of 4
    assert sum(step.accepted_len for step in result.steps) / len(result.steps) > 2.0  # a trained block's trees
    assert drafter.cache.length == len(prompt) + sum(step.accepted_len for step in result.steps) - 1


def path_probability(block, cache, newest, entries, target_ids, project, embed, temperatures):
    """A node's path probability as the chain through it computes it: depth 1 from
    newest, each deeper depth from the block's entry for the token before (extend), every
    entry cut off again. entries: the path's tokens as indices of project's outputs;
    target_ids: the same tokens as the target's ids (what the next depth embeds)."""
    end, g, p = cache.length, newest, 1.0
    for j, (entry, token) in enumerate(zip(entries, target_ids)):
        p *= float(torch.softmax(project(g).double() / temperatures[j], -1)[entry])
        if j + 1 < len(entries):
            g = block.extend(cache, g[None], embed(torch.tensor([token])))[-1]
    block.truncate(cache, end)
    return p


@torch.no_grad()
@pytest.mark.parametrize("window", [1024, 9], ids=["whole context", "window shorter than the context"])
@pytest.mark.parametrize("drafting_form", [False, True], ids=["separate weights", "drafting form, draft vocab"])
def test_every_node_of_a_grown_block_tree_is_the_chain_through_it(window, drafting_form):
    """A tree grown by the block (tree_step, three requests together, each node's
    children from its own output and its own path's entries): every node's path
    probability is the product along the chain through it drafted alone, so no node reads
    a sibling's entry, another request's, or a position off by one; the caches end as
    they began."""
    from vllm_mtpspec.grown_tree import grow_trees

    block = make_block(num_heads=4, window=window)
    features, embed_table, tokens = random_sequence(16)
    lm_head = torch.randn(VOCAB, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 3
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[:20] if drafting_form else None
    rows = lm_head if ids is None else lm_head[ids]
    project = lambda g: g @ rows.T  # noqa: E731
    embed = lambda t: embed_table[t]  # noqa: E731
    temperatures = torch.tensor([1.0, 0.7, 1.3, 1.0], dtype=torch.float64)
    caches, newest = [], []
    for length in (7, 12, 16):
        cache = block.empty_cache(dtype=torch.float64)
        newest.append(block.extend(cache, features[:length], embed(tokens[:length]))[-1])
        caches.append(cache)
    newest = torch.stack(newest)
    if drafting_form:
        block.prepare_drafting(embed(ids))
    step = block.tree_step(caches, project, embed, temperatures, ids)
    trees = grow_trees(step, newest, torch.zeros(3, dtype=torch.long), depth=4, max_nodes=40, top_k=3,
                       min_path_prob=0.0, token_ids=ids)
    assert [(c.length, c.size) for c in caches] == [(7, 7), (12, 12), (16, 16)]
    block._drafting = None  # the chains below through the separate weights
    to_entry = {int(t): e for e, t in enumerate(ids)} if drafting_form else None
    for b, tree in enumerate(trees):
        assert tree.shape.max_depth == 4 and len(tree.shape) == 3 + 9 + 9 + 9  # every node grown
        node_tokens = tree.tokens.tolist()
        for node, path in enumerate(tree.shape.paths):
            path_tokens = [node_tokens[tree.shape.paths.index(path[:n])] for n in range(1, len(path) + 1)]
            entries = path_tokens if to_entry is None else [to_entry[t] for t in path_tokens]
            expected = path_probability(block, caches[b], newest[b], entries, path_tokens, project, embed,
                                        temperatures)
            assert tree.path_probs[node] == pytest.approx(expected, rel=1e-5), (b, path)  # grown in fp32


class SimpleModel:
    """Just what a drafter reads from a Hugging Face model: its embedding and LM head."""

    def __init__(self, embed, lm_head):
        self._embed, self._lm_head = torch.nn.Embedding.from_pretrained(embed), torch.nn.Linear(D, VOCAB, bias=False)
        self._lm_head.weight.data = lm_head

    def get_input_embeddings(self):
        return self._embed

    def get_output_embeddings(self):
        return self._lm_head


@torch.no_grad()
def test_drafted_chains_are_the_unrolled_pass_along_their_own_drafts_and_leave_the_caches_as_they_were():
    block = make_block(num_heads=4)
    features, embed, tokens = random_sequence(16)
    lm_head = torch.randn(VOCAB, D, dtype=torch.float64)
    caches, newest = [], []
    for length in (7, 12):  # two requests, drafted together
        cache = block.empty_cache(dtype=torch.float64)
        newest.append(block.extend(cache, features[:length], embed[tokens[:length]])[-1])
        caches.append(cache)
    logits = block.draft_chains(caches, torch.stack(newest), 4, lambda x: x @ lm_head.T, lambda t: embed[t])
    assert [c.length for c in caches] == [7, 12] and [c.size for c in caches] == [7, 12]
    for b, length in enumerate((7, 12)):
        drafted = logits[b].argmax(-1)
        # Depth j at the last position reads s_{p+j}: the real token, then the chain's own drafts.
        chain_tokens = torch.cat([tokens[:length], drafted[:-1]])
        expected = unrolled_all(block, features[:length], embed, chain_tokens, 4)
        for j in range(4):
            torch.testing.assert_close(logits[b, j], expected[j][0, -1] @ lm_head.T)


@torch.no_grad()
@pytest.mark.parametrize("matrices", ["fp32", "int8", "int2"])
@pytest.mark.parametrize("draft_vocab", [False, True])
def test_the_drafting_form_drafts_what_the_separate_weights_draft_and_is_never_saved(tmp_path, matrices, draft_vocab):
    from vllm_mtpspec.quant.int8_dynamic import int8_linears

    block = make_block(num_heads=4, feature_layers=(1,)).float()
    int8 = matrices == "int8"
    if int8:
        int8_linears(block)
    if matrices == "int2":
        block = block.quantized(group_size=16)
    features, embed, tokens = random_sequence(16)
    features, embed = features.float(), embed.float()
    layers = torch.randn(16, 1, D, generator=torch.Generator().manual_seed(3))
    lm_head = torch.randn(VOCAB, D, generator=torch.Generator().manual_seed(4))
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[:20] if draft_vocab else None
    rows = lm_head if ids is None else lm_head[ids]

    def draft():
        caches = []
        for length in (7, 12):  # two requests: padded, masked, then one each
            caches.append(block.empty_cache(dtype=torch.float32))
            block.extend(caches[-1], features[:length - 3], embed[tokens[:length - 3]], layers[:length - 3])
        outputs = block.extend_many(caches, [features[4:7], features[9:12]], [embed[tokens[4:7]], embed[tokens[9:12]]],
                                    [layers[4:7], layers[9:12]])
        newest = torch.stack([out[-1] for out in outputs])
        together = block.draft_chains(caches, newest, 4, lambda x: x @ rows.T, lambda t: embed[t], ids)
        alone = block.draft_chains(caches[1:], newest[1:], 4, lambda x: x @ rows.T, lambda t: embed[t], ids)
        return together, alone

    separate = draft()
    saved_before = {name: tensor.clone() for name, tensor in block.state_dict().items()}
    block.prepare_drafting(None if ids is None else embed[ids])
    prepared = draft()
    for got, expected in zip(prepared, separate):
        if int8 and draft_vocab:
            # INT8 quantizes the fused input as a whole, the prepared form its feature half
            # alone (the token half is fp32 over fuse's INT8 values): the drafts differ as
            # INT8's from fp32's do.
            assert (got - expected).abs().max() <= 0.12 * expected.abs().max()
        else:
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert block.state_dict().keys() == saved_before.keys()
    if draft_vocab:  # the table belongs to the vocabulary it was built for
        with pytest.raises(ValueError, match="20 draft tokens"):
            block.draft_chains([block.empty_cache()], torch.zeros(1, D), 2, lambda x: x @ lm_head.T,
                               lambda t: embed[t])
    if not int8:
        save_heads(block, tmp_path)
        loaded = load_heads(tmp_path)
        assert loaded.state_dict().keys() == saved_before.keys()


@torch.no_grad()
def test_an_int2_block_computes_what_its_codes_stand_for_and_saves_them(tmp_path):
    from vllm_mtpspec.quant import Int2Linear, dequantize_int2

    block = make_block(num_heads=3, feature_layers=(1,)).float()
    int2 = block.quantized(group_size=16, method="rtn")
    names = [name for name, m in block.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(names) == 9 and all(isinstance(int2.get_submodule(name), Int2Linear) for name in names)
    assert int2.is_quantized and not int2.training and int2.config.quantization.group_size == 16
    # The block with each matrix replaced by the values its codes stand for (norms kept).
    dequantized = make_block(num_heads=3, feature_layers=(1,)).float()
    for name in names:
        dequantized.get_submodule(name).weight.copy_(dequantize_int2(int2.get_submodule(name).qweight))
    features, embed, tokens = random_sequence(12)
    features, embed = features.float(), embed.float()
    layers = torch.randn(12, 1, D, generator=torch.Generator().manual_seed(3))

    def states(b):
        t = features.shape[0]
        return b.unrolled(features[None], [embed[tokens[i:i + t]][None] for i in range(3)], torch.arange(t)[None],
                          torch.ones(1, t, dtype=torch.bool), layers[None])

    got, full = states(int2), states(block)
    for g, expected, original in zip(got, states(dequantized), full):
        torch.testing.assert_close(g, expected, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(g, original, atol=1e-3)  # 2-bit codes are not the weights
    loaded = load_heads(save_heads(int2, tmp_path))
    assert loaded.is_quantized and loaded.config.quantization.method == "rtn"
    for g, again in zip(got, states(loaded)):
        torch.testing.assert_close(again, g)
    with pytest.raises(ValueError, match="already quantized"):
        int2.quantized()


@torch.no_grad()
def test_a_fresh_block_drafts_what_the_lm_head_says_on_h(tiny_model, tiny_model_dir):
    from vllm_mtpspec.heads_init import init_draft_block

    block = init_draft_block(tiny_model, tiny_model_dir, num_heads=2).eval()
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    h = tiny_model.model(input_ids=ids).last_hidden_state[0]
    embed, lm_head = tiny_model.get_input_embeddings(), tiny_model.get_output_embeddings()
    out = block.extend(block.empty_cache(), h, embed(ids[0]))
    # A positive multiple of h (its RMS put on the norm weight's scale): the same ranking of tokens.
    assert torch.equal(lm_head(out).argmax(-1), lm_head(h).argmax(-1))
    cosine = torch.nn.functional.cosine_similarity(out, h, dim=-1)
    torch.testing.assert_close(cosine, torch.ones_like(cosine))


@torch.no_grad()
def test_shards_keep_the_states_entering_the_layers_a_block_reads(tiny_model):
    """Layer l's input: the token embeddings for layer 0, layer 0's output for layer 1
    (what vLLM's aux_hidden_states hold), at the answer rows and the kept prompt rows."""
    from types import SimpleNamespace

    from vllm_mtpspec.shards import ShardsError, answer_sequence
    from vllm_mtpspec_train.answers import shard_from_answers

    prompt, answer = [3, 14, 15, 92, 65], [35, 89, 79]
    shard = shard_from_answers(SimpleNamespace(model=tiny_model), ["a"], ["general"], [prompt], [answer],
                               top_k=2, context_rows=3, feature_layers=[1, 0])
    ids = torch.tensor([prompt + answer])
    out = tiny_model.model(input_ids=ids, output_hidden_states=True)
    # hidden_states[0]: the embeddings; [1]: layer 0's output, what enters layer 1.
    entering = {layer: out.hidden_states[layer][0] for layer in (0, 1)}
    torch.testing.assert_close(entering[0], tiny_model.get_input_embeddings()(ids)[0])
    rows = torch.arange(len(prompt) - 1, len(prompt) + len(answer) - 1)        # the states behind answer tokens
    context = torch.arange(len(prompt) - 4, len(prompt) - 1)
    assert shard["feature_layers"].tolist() == [1, 0]
    for column, layer in enumerate([1, 0]):
        torch.testing.assert_close(shard["layer_hidden"][:, column].float(), entering[layer][rows],
                                   atol=2e-3, rtol=1e-2)
        torch.testing.assert_close(shard["context_layer_hidden"][:, column].float(), entering[layer][context],
                                   atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(shard["hidden"].float(), out.last_hidden_state[0, rows], atol=2e-3, rtol=1e-2)
    sequence = answer_sequence(shard, 0, [0])
    torch.testing.assert_close(sequence["layer_features"][:, 0], entering[0][torch.cat([context, rows])].float(),
                               atol=2e-3, rtol=1e-2)
    with pytest.raises(ShardsError, match="--feature-layers 2"):
        answer_sequence(shard, 0, [2])
