"""Drafter kinds behind one table (vllm_mtpspec/kinds/): nothing outside the folder tests a
kind's name, the table refuses what it cannot build, and a kind registered from outside
the package (here, from this test module) loads, checks and serves through vLLM."""
import os
import re
from pathlib import Path

import pytest
import torch

from vllm_mtpspec.config import ConfigError, HeadsConfig
from vllm_mtpspec.heads import MTPHeads
from vllm_mtpspec.kinds import (
    ATTENTION,
    PARALLEL,
    SEQUENTIAL,
    DrafterKind,
    kind_named,
    kind_names,
    kind_of,
    register_kind,
    unregister_kind,
)

ROOT = Path(__file__).resolve().parents[1]
NAME_TESTS = re.compile(r"head_kind ==|head_kind in|head_kind !=")


def test_no_module_outside_the_kinds_folder_tests_a_kinds_name():
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for folder in ("vllm_mtpspec", "vllm_mtpspec_train") for path in sorted((ROOT / folder).rglob("*.py"))
             if not path.is_relative_to(ROOT / "vllm_mtpspec" / "kinds")
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if NAME_TESTS.search(line)]
    assert not found, "ask the kind what it can do (vllm_mtpspec/kinds/) instead:\n" + "\n".join(found)


def test_the_built_in_kinds_declare_what_they_draft():
    assert kind_names()[:3] == ("parallel", "sequential", "attention")
    assert (PARALLEL.chains_only, PARALLEL.grows_trees, PARALLEL.default_tree) == (False, False, "consensus")
    assert (SEQUENTIAL.chains_only, SEQUENTIAL.grows_trees, SEQUENTIAL.default_tree) == (True, True, "dynamic")
    assert SEQUENTIAL.reads_drafted_tokens and not SEQUENTIAL.keeps_context
    assert ATTENTION.keeps_context and ATTENTION.takes_copy_bias and ATTENTION.reads_layers
    assert not PARALLEL.takes_copy_bias and not SEQUENTIAL.reads_layers
    assert PARALLEL.tree_refusal("consensus") is None
    assert "drafts chains and dynamic trees only" in SEQUENTIAL.tree_refusal("static")
    assert SEQUENTIAL.tree_refusal("dynamic") is None


def test_a_config_of_an_unknown_kind_is_refused_with_the_kinds_there_are():
    with pytest.raises(ConfigError, match=r"head_kind='nested': choose one of \('parallel', 'sequential', "):
        HeadsConfig(num_heads=2, hidden_size=8, vocab_size=32, head_kind="nested")
    with pytest.raises(KeyError, match="head_kind='nested'"):
        kind_named("nested")


def test_a_second_kind_of_one_name_is_refused():
    twin = DrafterKind(name="parallel", label="twin", module=MTPHeads)
    with pytest.raises(ValueError, match="a drafter kind named 'parallel' is already registered"):
        register_kind(twin)
    assert kind_named("parallel") is PARALLEL


# -- a kind from outside the package ------------------------------------------------------

class RepeatHeads(MTPHeads):
    """A trivial drafter: every depth guesses the token the target just chose, again (the
    target's LM head on h_t). It keeps MTPHeads' weights so that it saves and loads as heads
    do, and counts its drafting calls so that a test can tell it ran."""

    draft_calls = 0

    def draft_logits(self, h, root_embeds, depth, lm_head, embed=None, draft_ids=None):
        type(self).draft_calls += 1
        return lm_head(h)[:, None, :].expand(-1, depth, -1)


REPEAT = DrafterKind(name="repeat-last", label="repeat-last heads", module=RepeatHeads)


@pytest.fixture
def repeat_kind():
    register_kind(REPEAT)
    yield REPEAT
    unregister_kind(REPEAT.name)


def test_a_registered_kind_saves_loads_and_is_refused_once_gone(repeat_kind, tiny_model, tiny_model_dir, tmp_path):
    from vllm_mtpspec.checkpoint import HeadsError, load_heads, save_heads

    model = tiny_model
    heads = repeat_kind.initial_heads(model, tiny_model_dir, num_heads=2, seed=0)
    assert type(heads) is RepeatHeads and kind_of(heads.config) is repeat_kind
    saved = save_heads(heads, tmp_path / "repeat")
    loaded = load_heads(saved)
    assert type(loaded) is RepeatHeads
    hidden = torch.randn(3, model.config.hidden_size)
    logits = loaded.draft_logits(hidden, None, 2, lambda x: x @ model.get_output_embeddings().weight.T)
    torch.testing.assert_close(logits[:, 0], logits[:, 1])
    unregister_kind(repeat_kind.name)
    with pytest.raises(HeadsError, match=r"config.json: head_kind='repeat-last': choose one of"):
        load_heads(saved)


@pytest.mark.slow
def test_a_kind_registered_from_a_test_module_serves_through_vllm_losslessly(repeat_kind, tmp_path):
    """SmolLM2-135M-Instruct in fp32, in-process vLLM engine (the registration made here is
    seen by its worker): greedy output with the new kind's drafts equals vLLM alone's."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from tests.test_vllm_integration import build, close, greedy, spec_metrics
    from vllm_mtpspec.checkpoint import save_heads
    from vllm_mtpspec.models import fetch_model
    from vllm_mtpspec.target import load_target

    model_dir = fetch_model("smollm2-135m-instruct", dtype="fp32")
    target = load_target(str(model_dir), dtype="fp32")
    heads_dir = save_heads(repeat_kind.initial_heads(target.model, model_dir, num_heads=3, seed=0), tmp_path / "repeat")
    del target

    def served(**kwargs):
        # One engine at a time: an engine still referenced while the next one starts tears
        # down the parallel state that the next one uses when it is collected.
        llm = build(model_dir, **kwargs)
        outputs, metrics = greedy(llm), spec_metrics(llm)
        close(llm)
        return outputs, metrics

    alone, _ = served()
    RepeatHeads.draft_calls = 0
    # The heads draft every step: no prompt lookup, and a back-off no batch here reaches.
    speculated, metrics = served(speculative_config={
        "method": "mtpspec", "model": str(heads_dir), "num_speculative_tokens": 3, "draft_size": "fixed",
        "batch_backoff_start": 64, "prompt_lookup_max": 0})
    assert RepeatHeads.draft_calls > 0
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    assert speculated == alone
