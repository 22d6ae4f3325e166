"""The vLLM proposer's own logic, without an engine: which hidden state each request
drafts from, and how adaptive depth cuts drafts per request and per batch."""
from types import SimpleNamespace

import pytest
import torch

from tests.proposers import cpu_proposer
from vllm_mtpspec.checkpoint import save_heads
from vllm_mtpspec.heads_init import init_heads
from vllm_mtpspec.vllm.rows import last_sampled_rows


def test_rows_without_and_with_drafts():
    # No request carried drafts: one row each; a partial prefill sampled nothing.
    assert last_sampled_rows([[5], [], [7]], None, 3) == [(0, 0), (2, 2)]
    # Drafts 2, 0, 3 -> rows [0..2], [3], [4..7]; accepted 2, 1 and 4 tokens.
    assert last_sampled_rows([[1, 2], [3], [4, 5, 6, 7]], [2, 0, 3], 8) == [(0, 1), (1, 3), (2, 7)]
    # Metadata present, but nobody had drafts this step.
    assert last_sampled_rows([[1], [2]], [0, 0], 2) == [(0, 0), (1, 1)]


@pytest.fixture
def make_proposer(tiny_model, tiny_model_dir, tmp_path):
    heads = init_heads(tiny_model, tiny_model_dir, num_heads=3, init_std=0.5, seed=3)
    heads_dir = save_heads(heads, tmp_path / "heads")

    def make(max_drafts=3, **options):
        # The fixed back-off unless a test asks for another rule: these tests pin how much is drafted.
        options = {"heads": str(heads_dir), "min_path_prob": 0.0, "batch_backoff_start": 4, "draft_size": "fixed",
                   **options}
        return cpu_proposer(tiny_model, tiny_model_dir, options, max_drafts=max_drafts), heads, tiny_model

    return make


@pytest.fixture
def proposer(make_proposer):
    return make_proposer()


def expected_chain(heads, model, h):
    logits = heads(h[None], lm_head=model.get_output_embeddings())[0]
    return logits.argmax(-1).tolist()


def test_drafts_come_from_each_requests_last_accepted_row(proposer):
    p, heads, model = proposer
    hidden = torch.randn(6, model.config.hidden_size)
    meta = SimpleNamespace(num_draft_tokens=[2, 0, 2])
    p.capture_step(hidden, meta)
    drafts = p.propose([[11, 12], [13], []])  # third: a partial prefill
    assert drafts[0] == expected_chain(heads, model, hidden[1])
    assert drafts[1] == expected_chain(heads, model, hidden[3])
    assert drafts[2] == []


def test_adaptive_depth_per_request_and_per_batch(make_proposer):
    p, heads, model = make_proposer()
    hidden = torch.randn(1, model.config.hidden_size)
    p.capture_step(hidden, None)
    full = p.propose([[1]])[0]
    assert len(full) == 3
    unsure, _, _ = make_proposer(min_path_prob=0.999)  # no random head is that sure: nothing is drafted
    unsure.capture_step(hidden, None)
    assert unsure.propose([[1]]) == [[]]
    assert [p.draft_size.depth_for_batch(n) for n in (1, 4, 5, 8, 9, 16, 32)] == [3, 3, 2, 2, 1, 1, 0]


def test_trees_are_sent_breadth_first_and_remembered_while_blocked_requests_get_chains(make_proposer):
    from vllm_mtpspec.tree import consensus_tree

    p, heads, model = make_proposer(max_drafts=8, tree="consensus", num_speculative_tokens=3, max_tree_nodes=8)
    assert p.depth == 3 and p.static_shape == consensus_tree(3, max_nodes=8)
    hidden = torch.randn(3, model.config.hidden_size)
    p.capture_step(hidden, None, ["a", "b", "c"], tree_blocker=[None, "penalties", None].__getitem__)
    drafts = p.propose([[11], [12], [13]])
    logits = heads(hidden, token_embeds=model.get_input_embeddings()(torch.tensor([11, 12, 13])),
                   lm_head=model.get_output_embeddings())
    for i in (0, 2):
        topk = logits[i].topk(5, dim=-1).indices
        assert drafts[i] == p.static_shape.node_tokens(topk).tolist()
        assert p.proposed_trees[["a", "b", "c"][i]].tokens == tuple(drafts[i])
    assert drafts[1] == logits[1].argmax(-1).tolist() and "b" not in p.proposed_trees


def test_a_tree_requests_next_draft_reads_its_last_accepted_nodes_row(make_proposer):
    p, heads, model = make_proposer(max_drafts=8, tree="dynamic", max_tree_nodes=8)
    hidden = torch.randn(1 + 8, model.config.hidden_size)
    # The request carried 8 tree nodes; nodes 1 and 4 were accepted: its bonus token came
    # from node 4's row, row 5 of the request (row 0 is the root).
    p.capture_step(hidden, SimpleNamespace(num_draft_tokens=[8]), ["a"], tree_paths={0: [0, 2, 5]})
    drafts = p.propose([[21, 22, 23]])
    p.capture_step(hidden[5:6], None, ["a"])
    assert drafts == p.propose([[23]])


def test_trees_are_cut_to_the_depth_their_request_may_still_keep(make_proposer):
    p, _, model = make_proposer(max_drafts=8, tree="consensus", max_tree_nodes=8)
    hidden = torch.randn(3, model.config.hidden_size)
    p.capture_step(hidden, None, ["a", "b", "c"])
    whole = p.propose([[1], [2], [3]])
    p.proposed_trees["b"] = p.proposed_trees["a"]  # a tree left from an earlier step
    # Made 62, 63 and 10 of 64: the next step emits one token anyway, so trees of depth 1,
    # none and the whole depth can be kept.
    p.capture_step(hidden, None, ["a", "b", "c"], budget=[(64, 62), (64, 63), (64, 10)].__getitem__)
    drafts = p.propose([[1], [2], [3]])
    depth_of = dict(zip(p.static_shape.paths, (len(path) for path in p.static_shape.paths)))
    assert max(depth_of.values()) == 3
    first_level = [t for path, t in zip(p.static_shape.paths, whole[0]) if depth_of[path] == 1]
    assert drafts == [first_level, [], whole[2]] and len(first_level) < len(whole[0])
    assert p.proposed_trees["a"].tokens == tuple(first_level) and len(p.proposed_trees["a"].shape) == len(first_level)
    assert "b" not in p.proposed_trees and p.proposed_trees["c"].tokens == tuple(whole[2])


def test_low_confidence_tree_nodes_are_cut_and_what_stays_is_a_tree(make_proposer):
    p, heads, model = make_proposer(max_drafts=16, tree="consensus", min_path_prob=0.05)
    p.capture_step(torch.randn(4, model.config.hidden_size), None, list("abcd"))
    drafts = p.propose([[1], [2], [3], [4]])
    sizes = [len(d) for d in drafts]
    assert max(sizes) <= len(p.static_shape) and min(sizes) < len(p.static_shape)
    for req in "abcd":
        tree = p.proposed_trees.get(req)
        if tree is not None:  # a valid breadth-first tree (TreeShape checks it)
            assert len(tree.shape) == len(tree.tokens)


def test_trees_shrink_past_the_batch_backoff(make_proposer):
    p, _, model = make_proposer(max_drafts=8, tree="consensus", max_tree_nodes=8)  # backoff from 4 requests
    assert [p.draft_size.tree_budget_for_batch(n) for n in (1, 4, 5, 8, 9, 16, 64)] == [8, 8, 4, 4, 2, 2, 1]
    p.capture_step(torch.randn(9, model.config.hidden_size), None, [str(i) for i in range(9)])
    drafts = p.propose([[1]] * 9)
    assert all(len(d) <= 2 for d in drafts) and any(drafts)


def test_prompt_lookup_replaces_the_heads_guess_where_the_context_repeats(make_proposer):
    import numpy as np

    from vllm_mtpspec.tree import chain_tree

    p, heads, model = make_proposer(max_drafts=8, tree="consensus", max_tree_nodes=8, num_speculative_tokens=3,
                                    prompt_lookup_max=3)
    token_ids = np.zeros((2, 32), dtype=np.int64)
    token_ids[0, :9] = [4, 5, 6, 7, 8, 9, 4, 5, 6]  # "4 5 6" occurred before: 7 8 9 followed
    token_ids[1, :5] = [10, 11, 12, 13, 14]          # nothing repeats: the heads draft a tree
    hidden = torch.randn(2, model.config.hidden_size)
    p.capture_step(hidden, None, ["a", "b"])
    drafts = p.propose([[6], [14]], np.array([9, 5]), token_ids)
    assert drafts[0] == [7, 8, 9]
    assert p.proposed_trees["a"].shape == chain_tree(3) and p.proposed_trees["a"].tokens == (7, 8, 9)
    logits = heads(hidden[1], token_embeds=model.get_input_embeddings()(torch.tensor(14)),
                   lm_head=model.get_output_embeddings())
    assert drafts[1] == p.static_shape.node_tokens(logits.topk(5, dim=-1).indices).tolist()
    assert p.proposed_trees["b"].shape == p.static_shape


class SharedBroadcast:
    """Two tensor-parallel ranks in one process, stepping in turn: rank 0's broadcast
    reaches rank 1 (vLLM's GroupCoordinator.broadcast_object, src=0)."""

    def __init__(self):
        self.sent = []

    def rank(self, rank_in_group):
        shared = self

        class Group:
            world_size = 2

            def broadcast_object(self, obj=None, src=0):
                assert src == 0
                if rank_in_group == 0:
                    shared.sent.append(obj)
                    return obj
                return shared.sent.pop(0)

        group = Group()
        group.rank_in_group = rank_in_group
        return group


def test_without_a_distributed_group_the_proposer_decides_alone():
    from vllm_mtpspec.vllm.parallel import RankZeroDecision, tensor_parallel_group

    assert tensor_parallel_group() is None  # no vLLM worker in this process
    decision = RankZeroDecision(None)
    assert decision.decides_here and decision(lambda: 3) == 3


def test_the_planners_lengths_cut_each_requests_chain(make_proposer):
    p, heads, model = make_proposer(draft_size="planned", batch_backoff_start=1)
    assert p.planner is not None
    hidden = torch.randn(3, model.config.hidden_size)
    offered = []

    def plan(req_ids, candidates, *, sampled, drafting_seconds=0.0):
        offered.append((list(req_ids), candidates, sampled))
        return [1, 0, 3]

    p.planner.plan = plan
    p.capture_step(hidden, None, ["a", "b", "c"], decode_only=True, sampled=[False, True, False].__getitem__)
    drafts = p.propose([[1], [2], [3]])
    assert drafts[0] == expected_chain(heads, model, hidden[0])[:1]
    assert drafts[1] == []
    assert drafts[2] == expected_chain(heads, model, hidden[2])
    req_ids, candidates, sampled = offered[0]
    assert req_ids == ["a", "b", "c"] and sampled
    assert [c.source for c in candidates] == ["heads"] * 3 and [c.sampled for c in candidates] == [False, True, False]
    # Each offered draft carries the heads' path probability, which only falls.
    for c in candidates:
        assert len(c.path_probs) == c.length == 3 and list(c.path_probs) == sorted(c.path_probs, reverse=True)


def test_while_the_planner_rests_the_heads_only_lookup_drafts_are_offered(make_proposer):
    import numpy as np

    p, heads, model = make_proposer(draft_size="planned", batch_backoff_start=1, prompt_lookup_max=3)
    p.planner.heads_would_run = lambda batch_size, sampled: False
    calls = []
    original_hidden = p.heads.hidden
    p.heads.hidden = lambda *a, **k: calls.append(1) or original_hidden(*a, **k)
    token_ids = np.zeros((2, 16), dtype=np.int64)
    token_ids[0, :9] = [4, 5, 6, 7, 8, 9, 4, 5, 6]  # "4 5 6" occurred before: 7 8 9 followed
    token_ids[1, :5] = [10, 11, 12, 13, 14]
    p.capture_step(torch.randn(2, model.config.hidden_size), None, ["a", "b"], decode_only=True)
    drafts = p.propose([[6], [14]], num_tokens_no_spec=np.array([9, 5]), token_ids_cpu=token_ids)
    assert drafts == [[7, 8, 9], []] and not calls


def test_while_proposing_does_not_pay_no_context_is_searched_and_nothing_is_drafted(make_proposer, monkeypatch):
    import numpy as np

    import vllm_mtpspec.vllm.proposer as proposer_module

    p, heads, model = make_proposer(draft_size="planned", batch_backoff_start=1, prompt_lookup_max=3)
    searched = []
    monkeypatch.setattr(proposer_module, "lookup_draft", lambda *a, **k: searched.append(1) or [7, 8, 9])
    token_ids = np.zeros((2, 16), dtype=np.int64)
    proposing = [False]
    p.planner.wants_proposal = lambda batch_size, sampled: proposing[0]
    timed = []
    p.planner.proposal_took = timed.append
    p.capture_step(torch.randn(2, model.config.hidden_size), None, ["a", "b"], decode_only=True)
    assert p.propose([[6], [14]], num_tokens_no_spec=np.array([9, 5]), token_ids_cpu=token_ids) == [[], []]
    assert not searched and not timed
    proposing[0] = True
    p.capture_step(torch.randn(2, model.config.hidden_size), None, ["a", "b"], decode_only=True)
    assert p.propose([[6], [14]], num_tokens_no_spec=np.array([9, 5]), token_ids_cpu=token_ids) == [[7, 8, 9]] * 2
    assert len(searched) == 2 and len(timed) == 1 and timed[0] > 0


def test_the_planner_learns_from_what_each_step_verified_and_how_long_it_took(make_proposer):
    p, _, model = make_proposer(draft_size="planned", batch_backoff_start=1)
    now = [0.0]
    p.planner.clock = lambda: now[0]
    p.capture_step(torch.randn(2, model.config.hidden_size), None, ["a", "b"], decode_only=True)
    assert [len(d) for d in p.propose([[1], [2]])] == [3, 3]  # nothing measured yet: everything
    now[0] += 0.5
    # "a" kept 2 of its 3 drafts, "b" none.
    p.capture_step(torch.randn(8, model.config.hidden_size), SimpleNamespace(num_draft_tokens=[3, 3]), ["a", "b"],
                   decode_only=True)
    p.propose([[5, 6, 7], [8]])
    assert p.planner.costs.curve(2, False).seconds(8) == 0.5


def draft_lengths_on_two_planning_ranks(make_proposer, share: bool, steps=120):
    from vllm_mtpspec.vllm.parallel import RankZeroDecision

    ranks = [make_proposer(draft_size="planned", batch_backoff_start=1)[0] for _ in range(2)]
    broadcast = SharedBroadcast()
    # Every draft is kept. Rank 0's clock says verification is free, rank 1's that every
    # query token costs more than a step without drafts.
    costs = (lambda q: 0.05, lambda q: 0.01 * q ** 1.5)
    clocks = [[0.0], [0.0]]
    for rank, p in enumerate(ranks):
        p.planner.clock = lambda now=clocks[rank]: now[0]
        if share:
            p.__dict__["_rank_zero"] = RankZeroDecision(broadcast.rank(rank))
    lengths = [[], []]
    hidden = torch.randn(2 + 2 * 3, ranks[0].heads_config.hidden_size, generator=torch.Generator().manual_seed(0))
    sent = [None, None]
    for _ in range(steps):
        for rank, p in enumerate(ranks):
            meta = None if sent[rank] is None else SimpleNamespace(num_draft_tokens=sent[rank])
            rows = hidden[:2 + (0 if meta is None else sum(sent[rank]))]
            p.capture_step(rows, meta, ["a", "b"], decode_only=True)
            drafts = p.propose([[1] * (1 + n) for n in (sent[rank] or [0, 0])])
            sent[rank] = [len(d) for d in drafts]
            clocks[rank][0] += costs[rank](2 + sum(sent[rank]))
            lengths[rank].append(sent[rank])
    return lengths


def test_every_tensor_parallel_rank_sends_the_plan_rank_zero_made(make_proposer):
    alone = draft_lengths_on_two_planning_ranks(make_proposer, share=False)
    assert alone[0][-20:] != alone[1][-20:], "the two clocks must lead to different plans for this test to mean anything"
    shared = draft_lengths_on_two_planning_ranks(make_proposer, share=True)
    assert shared[0] == shared[1] and shared[0] == alone[0]


def test_below_the_backoff_start_the_planner_leaves_whole_chains_and_plans_from_it(make_proposer):
    p, heads, model = make_proposer(draft_size="planned", batch_backoff_start=3)
    planned = []
    plan = p.planner.plan
    p.planner.plan = lambda req_ids, *a, **k: planned.append(len(req_ids)) or [0] * len(req_ids)
    hidden = torch.randn(3, model.config.hidden_size)
    p.capture_step(hidden[:2], None, ["a", "b"], decode_only=True)
    drafts = p.propose([[1], [2]])
    assert drafts == [expected_chain(heads, model, hidden[i]) for i in range(2)] and not planned
    assert not p.planner.held_requests()  # nothing it sent is waiting to be matched
    p.capture_step(hidden, None, ["a", "b", "c"], decode_only=True)
    assert p.propose([[1], [2], [3]]) == [[], [], []] and planned == [3]
    p.planner.plan = plan
    p.capture_step(hidden[:2], None, ["a", "b"], decode_only=True)
    p.propose([[1], [2]])
    assert not p.planner.held_requests()


def test_the_planner_is_the_default_on_a_cpu_for_chains_only(make_proposer):
    p, _, _ = make_proposer(draft_size=None)
    assert p.draft_size_rule == "planned" and p.planner is not None
    p, _, _ = make_proposer(max_drafts=8, tree="consensus", max_tree_nodes=8, draft_size=None)
    assert p.draft_size_rule == "fixed" and p.planner is None


def test_a_batch_that_started_together_offers_the_planner_only_the_requests_behind(make_proposer):
    offered = []

    def offered_in(p, sampled):
        hidden = torch.randn(3, model.config.hidden_size)
        p.planner.plan = lambda req_ids, candidates, **k: offered.append(candidates) or [3] * len(req_ids)
        p.capture_step(hidden, None, ["a", "b", "c"], decode_only=True, sampled=sampled.__getitem__,
                       budget=[(64, 24), (64, 20), (64, 21)].__getitem__)
        drafts = p.propose([[1], [2], [3]])
        return [c is not None for c in offered[-1]], drafts

    p, _, model = make_proposer(draft_size="planned", batch_backoff_start=1)
    # By default a batch with a sampled request is paced: "a" is ahead and waits.
    assert p.pacing == "default"
    mask, drafts = offered_in(p, [False, True, False])
    assert mask == [False, True, True]
    assert drafts[0] == [] and len(drafts[1]) == 3 and p.paced_steps == 1
    # A greedy batch below GREEDY_PACED_FROM requests is not, unless pacing is asked always
    # (or sampled: a greedy batch never); and never is never.
    assert offered_in(make_proposer(draft_size="planned", batch_backoff_start=1)[0], [False] * 3)[0] == [True] * 3
    sampled_only = make_proposer(draft_size="planned", batch_backoff_start=1, pace_cohorts="sampled")[0]
    assert offered_in(sampled_only, [False] * 3)[0] == [True] * 3 and sampled_only.paced_steps == 0
    always = make_proposer(draft_size="planned", batch_backoff_start=1, pace_cohorts="always")[0]
    assert offered_in(always, [False] * 3)[0] == [False, True, True]
    never = make_proposer(draft_size="planned", batch_backoff_start=1, pace_cohorts="never")[0]
    assert offered_in(never, [True] * 3)[0] == [True] * 3 and never.paced_steps == 0


def test_by_default_a_greedy_batch_of_16_that_started_together_is_paced(make_proposer):
    p, _, model = make_proposer(draft_size="planned", batch_backoff_start=1)
    offered = []
    p.planner.plan = lambda req_ids, candidates, **k: offered.append(candidates) or [3] * len(req_ids)

    def step(n: int):
        # Every request but the first is 4 tokens behind it, more than a chain of 3.
        budget = [(64, 24)] + [(64, 20)] * (n - 1)
        req_ids = [f"r{i}" for i in range(n)]
        p.capture_step(torch.randn(n, model.config.hidden_size), None, req_ids, decode_only=True,
                       sampled=lambda i: False, budget=budget.__getitem__)
        p.propose([[i + 1] for i in range(n)])
        return [c is not None for c in offered[-1]]
    assert step(15) == [True] * 15 and p.paced_steps == 0             # 15 greedy requests: below the size
    assert step(16) == [False] + [True] * 15 and p.paced_steps == 1   # 16: paced, the one ahead waits


def test_pacing_asked_of_an_engine_that_does_not_plan_is_refused_at_start_up(make_proposer):
    from vllm_mtpspec.config import ConfigError

    # Trees take the fixed back-off by default: the planner plans chains only.
    with pytest.raises(ConfigError, match="pace_cohorts='sampled'.*'fixed'"):
        make_proposer(draft_size=None, tree="consensus", pace_cohorts="sampled")
    assert make_proposer(draft_size="fixed")[0].pacer is None


@pytest.mark.parametrize("draft_size", ["fixed", "planned"])
def test_no_request_is_sent_drafts_past_its_max_tokens(make_proposer, draft_size):
    p, _, model = make_proposer(draft_size=draft_size, batch_backoff_start=4, pace_cohorts="never")
    # Made 60, 62, 63 and 10 of 64: the next step emits one token anyway, so at most 3, 1,
    # 0 and 3 drafts can be kept.
    budget = [(64, 60), (64, 62), (64, 63), (64, 10)]
    p.capture_step(torch.randn(4, model.config.hidden_size), None, ["a", "b", "c", "d"], decode_only=True,
                   sampled=lambda i: False, budget=budget.__getitem__)
    if p.planner is not None:
        p.planner.plan = lambda req_ids, candidates, **k: [c.length if c is not None else 0 for c in candidates]
    drafts = p.propose([[1], [2], [3], [4]])
    assert [len(d) for d in drafts] == [3, 1, 0, 3]


def test_a_block_reading_target_layers_asks_the_model_for_them_or_is_refused_naming_the_field():
    """At the end of load_model: a model with vLLM's EAGLE-3 interface is told which layers'
    input states to return; one without it refuses the heads at start-up."""
    from vllm.model_executor.models.interfaces import SupportsEagle3
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_mtpspec.vllm.hooks import install_layer_states_hook

    install_layer_states_hook()

    class Eagle3Model(SupportsEagle3):
        def set_aux_hidden_state_layers(self, layers):
            self.layers = layers

    def runner(model, feature_layers):
        return SimpleNamespace(drafter=SimpleNamespace(feature_layers=feature_layers), model=model,
                               get_model=lambda: model, use_aux_hidden_state_outputs=False)

    able = runner(Eagle3Model(), [2, 15])
    GPUModelRunner._setup_eagle3_aux_hidden_state_outputs(able)
    assert able.use_aux_hidden_state_outputs and able.model.layers == (2, 15)
    with pytest.raises(RuntimeError, match=r"target layers \[2, 15\] \(block.feature_layers in the heads' "
                                           r"config.json\), and object cannot return them"):
        GPUModelRunner._setup_eagle3_aux_hidden_state_outputs(runner(object(), [2, 15]))


def test_a_context_store_asked_of_heads_that_keep_no_context_is_refused_at_start_up(make_proposer):
    from vllm_mtpspec.config import ConfigError

    with pytest.raises(ConfigError, match="context_store_mb=8 keeps a draft block's entries.*leave context_store_mb out"):
        make_proposer(context_store_mb=8)
    assert make_proposer()[0].block_contexts is None


def test_the_draft_size_rules_long_rest_reaches_the_draft_blocks_context(make_proposer):
    """A block lets its context lapse only where the rule says the heads rest long: the
    proposer hands that word on to the block's contexts every step, drafted or not."""
    import numpy as np

    from vllm_mtpspec.draft_size import Allowance

    p, _, model = make_proposer()
    told = []
    p.block_contexts = SimpleNamespace(update=lambda *args, long_rest: told.append(long_rest))
    token_ids = np.zeros((2, 16), dtype=np.int64)
    for long_rest in (True, False, True):
        p.draft_size.before_drafting = lambda view, long_rest=long_rest: Allowance(0, 0, long_rest=long_rest)
        p.capture_step(torch.randn(2, model.config.hidden_size), None, ["a", "b"], decode_only=True,
                       scheduled=object())
        assert p.propose([[6], [14]], num_tokens_no_spec=np.array([9, 5]), token_ids_cpu=token_ids) == [[], []]
    assert told == [True, False, True]
