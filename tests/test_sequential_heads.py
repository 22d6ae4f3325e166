"""Sequential heads: each depth reads the depth before it and the token drafted from it.
What training computes (the answer's tokens fed in) is what drafting computes along its
own top-1 chain, every place that drafts reads the chain, and the output stays the model's."""
from types import SimpleNamespace

import pytest
import torch

from tests.proposers import cpu_proposer
from tests.stats import TRIALS, assert_follows
from vllm_mtpspec.checkpoint import HeadsError, load_heads, save_heads
from vllm_mtpspec.config import ConfigError, HeadsConfig, SpecOptions
from vllm_mtpspec.drafter import HeadsDrafter
from vllm_mtpspec.heads import MTPHeads
from vllm_mtpspec.heads_init import init_heads
from vllm_mtpspec.heads_quant import head_linears, input_statistics
from vllm_mtpspec.reference import ReferenceDecoder, plain_greedy
from vllm_mtpspec.sequential_heads import SequentialHeads, chain_tokens, example_chain_tokens
from vllm_mtpspec.tree import chain_tree
from vllm_mtpspec.tree_builder import DraftTreeBuilder
from vllm_mtpspec.verify import verify_sampled
from vllm_mtpspec_train.losses import mtp_losses
from vllm_mtpspec_train.modules import PosthocModule

D, VOCAB = 16, 40


def make_heads(*, mlp_size: int = 32, k: int = 3, seed: int = 0, kind: str = "sequential") -> MTPHeads:
    config = HeadsConfig(num_heads=k, hidden_size=D, vocab_size=VOCAB, head_kind=kind, head_input="hidden+token",
                         mlp_size=mlp_size, embed_scale=0.7)
    torch.manual_seed(seed)
    heads = (SequentialHeads if kind == "sequential" else MTPHeads)(config).double()
    with torch.no_grad():  # the zero-initialised last layers would hide every depth's own weights
        for last in heads.last_layers():
            last.weight.normal_(0.0, 0.3)
    return heads


@pytest.fixture
def tensors():
    gen = torch.Generator().manual_seed(1)
    return SimpleNamespace(h=torch.randn(5, D, generator=gen, dtype=torch.float64),
                           embed=torch.randn(VOCAB, D, generator=gen, dtype=torch.float64),
                           lm_head=torch.randn(VOCAB, D, generator=gen, dtype=torch.float64),
                           root=torch.randint(0, VOCAB, (5,), generator=gen))


def test_drafting_is_the_training_pass_fed_its_own_top1_chain(tensors):
    heads = make_heads()
    project = heads.lm_head_for(tensors.lm_head)
    drafted = heads.draft_logits(tensors.h, tensors.embed[tensors.root], 3, project, tensors.embed.__getitem__)
    chain = torch.cat([tensors.root[:, None], drafted[:, :2].argmax(-1)], 1)          # y_1, then depths 1-2's top-1
    forced = heads(tensors.h, token_embeds=tensors.embed[chain], lm_head=project)
    torch.testing.assert_close(drafted, forced)
    # A depth reads the token before it: another token there changes what follows.
    other = chain.clone()
    other[:, 1] = (other[:, 1] + 1) % VOCAB
    changed = heads(tensors.h, token_embeds=tensors.embed[other], lm_head=project)
    torch.testing.assert_close(changed[:, 0], forced[:, 0])
    assert not torch.allclose(changed[:, 1], forced[:, 1])


def test_head_one_of_seeded_sequential_heads_is_the_parallel_head_one(tensors):
    parallel = make_heads(kind="parallel")
    sequential = SequentialHeads.from_parallel(parallel)
    assert sequential.config.head_kind == "sequential" and sequential.config.rank_accuracy is None
    project = parallel.lm_head_for(tensors.lm_head)
    e = tensors.embed[tensors.root]
    first = parallel.draft_logits(tensors.h, e, 1, project)
    torch.testing.assert_close(sequential.draft_logits(tensors.h, e, 3, project, tensors.embed.__getitem__)[:, :1],
                               first)
    # Every depth starts as head 1 applied to the state before it.
    state = tensors.h
    for i in range(3):
        torch.testing.assert_close(sequential.step(i, state, e), sequential.step(0, state, e))
    with pytest.raises(ValueError, match="full-precision, tied parallel heads"):
        SequentialHeads.from_parallel(sequential)


def test_a_draft_vocabulary_guess_is_embedded_by_its_target_id(tensors):
    heads = make_heads().with_draft_vocab(torch.tensor([3, 7, 11, 19, 23, 31, 37, 2]))
    project = heads.lm_head_for(tensors.lm_head)
    seen = []

    def embed(ids):
        seen.append(ids.clone())
        return tensors.embed[ids]

    logits = heads.draft_logits(tensors.h, tensors.embed[tensors.root], 3, project, embed, heads.draft_vocab)
    assert logits.shape == (5, 3, 8)
    assert [ids.tolist() for ids in seen] == [heads.draft_vocab[logits[:, i].argmax(-1)].tolist() for i in range(2)]


def test_teacher_forced_tokens_are_the_answers_next_tokens_and_never_past_its_end():
    assert chain_tokens(torch.tensor([5, 6, 7, 8]), 3).tolist() == [[5, 6, 7], [6, 7, 8], [7, 8, 8], [8, 8, 8]]
    targets = torch.tensor([[6, 7, 8], [7, 8, -1], [8, -1, -1]])
    assert example_chain_tokens(torch.tensor([5, 6, 7]), targets, 3).tolist() == [[5, 6, 7], [6, 7, 8], [7, 8, 8]]


def test_the_training_loss_reads_each_depths_answer_token(tensors):
    heads = make_heads().float()
    module = PosthocModule(heads, lm_head=tensors.lm_head.float(), embed=tensors.embed.float(), num_negatives=0,
                           kl_weight=0.0)
    targets = torch.tensor([[4, 9, 1], [9, 1, -1], [1, -1, -1]])
    batch = {"hidden": tensors.h[:3].float(), "token": torch.tensor([2, 4, 9]), "targets": targets,
             "teacher_ids": torch.full((3, 3, 1), -1), "teacher_logprobs": torch.zeros(3, 3, 1)}
    loss, _ = module(batch)
    chain = torch.tensor([[2, 4, 9], [4, 9, 1], [9, 1, 1]])
    states = heads.hidden(tensors.h[:3].float(), tensors.embed.float()[chain])
    expected = mtp_losses(states, tensors.lm_head.float(), targets, batch["teacher_ids"], batch["teacher_logprobs"],
                          num_negatives=0, kl_weight=0.0).total
    torch.testing.assert_close(loss, expected)


def test_each_depths_matrix_is_calibrated_on_its_own_inputs(tensors):
    heads = make_heads().float()
    assert list(head_linears(heads)) == ["blocks.0", "blocks.1", "blocks.2", "down.0", "down.1", "down.2"]
    chain = chain_tokens(torch.arange(12) % VOCAB, 3)
    h = torch.randn(12, D)
    stats = input_statistics(heads, [(h, tensors.embed.float()[chain])])
    second_inputs = torch.cat([heads.hidden(h, tensors.embed.float()[chain])[:, 0],
                               tensors.embed.float()[chain[:, 1]] * heads.config.embed_scale], -1)
    torch.testing.assert_close(stats["blocks.1"].hessian, input_statistics_of(second_inputs), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(stats["blocks.0"].hessian, stats["blocks.1"].hessian)


def input_statistics_of(x):
    from vllm_mtpspec.quant.calibrated import InputStatistics

    stats = InputStatistics(x.shape[1])
    stats.add(x)
    return stats.hessian


def test_sequential_heads_save_load_quantize_and_cast(tensors, tmp_path):
    heads = make_heads().float()
    loaded = load_heads(save_heads(heads, tmp_path / "seq"))
    assert isinstance(loaded, SequentialHeads)
    project = heads.lm_head_for(tensors.lm_head.float())
    args = (tensors.h.float(), tensors.embed.float()[tensors.root], 3, project, tensors.embed.float().__getitem__)
    torch.testing.assert_close(loaded.draft_logits(*args), heads.draft_logits(*args))
    int2 = load_heads(save_heads(heads.quantized(group_size=16), tmp_path / "int2"))
    assert isinstance(int2, SequentialHeads) and int2.is_quantized
    assert int2.draft_logits(*args).shape == (5, 3, VOCAB)
    half = load_heads(save_heads(heads.half(), tmp_path / "fp16"), dtype=torch.float32)
    torch.testing.assert_close(half.draft_logits(*args), heads.draft_logits(*args), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind", ["parallel", "sequential"])
def test_the_storage_dtype_is_read_for_every_head_kind(kind, tmp_path):
    """What `heads draft-vocab` keeps its copy in: an fp16 directory must stay fp16."""
    from vllm_mtpspec.checkpoint import stored_dtype

    heads = make_heads(kind=kind)
    assert stored_dtype(save_heads(heads.float(), tmp_path / "fp32")) == torch.float32
    assert stored_dtype(save_heads(heads.half(), tmp_path / "fp16")) == torch.float16
    assert stored_dtype(save_heads(heads.float().quantized(group_size=16), tmp_path / "int2")) is None


@pytest.mark.parametrize("saved, claimed", [("sequential", "parallel"), ("parallel", "sequential")])
def test_a_directory_whose_kind_disagrees_with_its_weights_is_refused(saved, claimed, tmp_path):
    import json

    out = save_heads(make_heads(kind=saved).float(), tmp_path / saved)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "head_kind": claimed}))
    with pytest.raises(HeadsError, match=rf"{saved}/heads.safetensors.*head_kind"):
        load_heads(out)


def test_sequential_heads_need_the_token_and_the_tied_lm_head():
    with pytest.raises(ConfigError, match="head_kind='sequential' with head_input='hidden'.*hidden\\+token"):
        HeadsConfig(num_heads=2, hidden_size=D, vocab_size=VOCAB, head_kind="sequential")
    with pytest.raises(ConfigError, match="head_kind='sequential' with tied=false"):
        HeadsConfig(num_heads=2, hidden_size=D, vocab_size=VOCAB, head_kind="sequential", head_input="hidden+token",
                    tied=False)


PROMPTS = [[1, 17, 42, 5], [3, 99, 100, 101, 7, 8, 200, 13], [250]]


@pytest.fixture(scope="module")
def random_sequential(tiny_model, tiny_model_dir):
    heads = init_heads(tiny_model, tiny_model_dir, num_heads=3, head_input="hidden+token", init_std=0.3, seed=1,
                       head_kind="sequential")
    assert isinstance(heads, SequentialHeads)
    return heads


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_greedy_output_with_sequential_drafts_equals_the_model_alone(tiny_model, random_sequential, draft_vocab):
    heads = random_sequential.with_draft_vocab(torch.arange(0, 256, 2)) if draft_vocab else random_sequential
    decoder = ReferenceDecoder(tiny_model, HeadsDrafter(heads, tiny_model),
                               SpecOptions(tree="chain", min_path_prob=0.0, prompt_lookup_max=0))
    for prompt in PROMPTS:
        expected = plain_greedy(tiny_model, prompt, max_new_tokens=40, eos_token_ids=set())
        assert decoder.decode(prompt, max_new_tokens=40).tokens == expected


@pytest.mark.parametrize("tree", ["consensus", "static"])
def test_the_reference_decoder_refuses_a_tree_sequential_heads_cannot_draft(tiny_model, random_sequential, tree):
    with pytest.raises(ConfigError, match=rf"tree={tree!r}: head_kind='sequential' drafts chains and dynamic trees "
                                          r"only.*use tree='chain' or tree='dynamic'"):
        ReferenceDecoder(tiny_model, HeadsDrafter(random_sequential, tiny_model), SpecOptions(tree=tree))


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_greedy_output_with_grown_trees_of_sequential_heads_equals_the_model_alone(tiny_model, random_sequential,
                                                                                   draft_vocab):
    heads = random_sequential.with_draft_vocab(torch.arange(0, 256, 2)) if draft_vocab else random_sequential
    decoder = ReferenceDecoder(tiny_model, HeadsDrafter(heads, tiny_model),
                               SpecOptions(tree="dynamic", max_tree_nodes=8, dynamic_top_k=3, min_path_prob=0.0,
                                           prompt_lookup_max=0))
    sizes = []
    for prompt in PROMPTS:
        expected = plain_greedy(tiny_model, prompt, max_new_tokens=40, eos_token_ids=set())
        result = decoder.decode(prompt, max_new_tokens=40)
        assert result.tokens == expected
        sizes += [step.num_nodes for step in result.steps]
    assert max(sizes) == 8  # trees, not chains of 3


@torch.no_grad()
def test_a_grown_trees_first_children_are_the_heads_own_top1_chain(tiny_model, random_sequential):
    drafter = HeadsDrafter(random_sequential, tiny_model)
    hidden, roots = torch.randn(2, 64, generator=torch.Generator().manual_seed(4)), torch.tensor([5, 77])
    builder = DraftTreeBuilder("dynamic", 3, max_nodes=64, min_path_prob=0.0, dynamic_top_k=3)
    trees = builder.grow(drafter.draft_step(), hidden, roots, depth=3)
    chains = drafter.head_logits(hidden, roots).argmax(-1)
    for (shape, tokens), chain in zip(trees, chains):
        assert len(shape) == 3 + 9 + 9  # the roots' 3 children, then the 3 likeliest nodes' 3 children, twice
        assert [tokens[shape.paths.index((0,) * d)] for d in (1, 2, 3)] == chain.tolist()


def test_fixed_shape_trees_of_sequential_heads_are_refused(tiny_model, random_sequential):
    from vllm_mtpspec.cli import decode_prompts

    target = SimpleNamespace(model=tiny_model)
    with pytest.raises(ConfigError, match="head_kind='sequential' drafts chains and dynamic trees only.*"
                                          "--tree chain or --tree dynamic"):
        decode_prompts(target, random_sequential, [], options=SpecOptions(tree="consensus"), max_new_tokens=4,
                       temperature=0.0, seed=0, check_lossless=False, progress=False)


def proposer_for(tiny_model, tiny_model_dir, heads_dir, max_drafts: int = 3, **options):
    return cpu_proposer(tiny_model, tiny_model_dir, {"heads": str(heads_dir), "min_path_prob": 0.0,
                                                     "prompt_lookup_max": 0, **options}, max_drafts=max_drafts)


def test_the_proposer_sends_each_requests_own_sequential_chain_in_target_ids(tiny_model, tiny_model_dir,
                                                                            random_sequential, tmp_path):
    ids = torch.randperm(256, generator=torch.Generator().manual_seed(1))[:96]
    heads = random_sequential.with_draft_vocab(ids)
    p = proposer_for(tiny_model, tiny_model_dir, save_heads(heads, tmp_path / "seq-dv"))
    embed = tiny_model.get_input_embeddings()
    hidden = torch.randn(2, 64)
    p.capture_step(hidden, None, ["a", "b"])
    drafts = p.propose([[1], [2]])
    weight = tiny_model.get_output_embeddings().weight.detach()
    with torch.no_grad():
        logits = heads.draft_logits(hidden, embed(torch.tensor([1, 2])), 3, heads.lm_head_for(weight), embed, ids)
    assert drafts == ids[logits.argmax(-1)].tolist()
    with pytest.raises(ConfigError, match="head_kind='sequential' drafts chains and dynamic trees only.*"
                                          "tree='consensus' was asked: use tree='chain' or tree='dynamic'"):
        proposer_for(tiny_model, tiny_model_dir, tmp_path / "seq-dv", tree="consensus")


def test_the_proposer_sends_grown_trees_of_sequential_heads_and_chains_where_trees_are_blocked(
        tiny_model, tiny_model_dir, random_sequential, tmp_path):
    ids = torch.randperm(256, generator=torch.Generator().manual_seed(2))[:96]
    heads = random_sequential.with_draft_vocab(ids)
    p = proposer_for(tiny_model, tiny_model_dir, save_heads(heads, tmp_path / "seq-tree"), max_drafts=6,
                     tree="dynamic", num_speculative_tokens=3, max_tree_nodes=6, dynamic_top_k=2)
    embed = tiny_model.get_input_embeddings()
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    p.capture_step(hidden, None, ["a", "b", "c"], tree_blocker=[None, "penalties", None].__getitem__)
    drafts = p.propose([[1], [2], [3]])
    weight = tiny_model.get_output_embeddings().weight.detach()
    lm_head = heads.lm_head_for(weight)
    expected = DraftTreeBuilder("dynamic", 3, max_nodes=6, min_path_prob=0.0, dynamic_top_k=2).grow(
        heads.draft_step(lm_head, embed, heads.temperatures), hidden[[0, 2]], torch.tensor([1, 3]), depth=3,
        token_ids=ids)
    for req, i, (shape, tokens) in zip("ac", (0, 2), expected):
        assert len(shape) == 6 and drafts[i] == tokens
        assert p.proposed_trees[req].shape == shape and p.proposed_trees[req].tokens == tuple(tokens)
    with torch.no_grad():
        chain = heads.draft_logits(hidden[1:2], embed(torch.tensor([2])), 3, lm_head, embed, ids).argmax(-1)
    assert drafts[1] == ids[chain[0]].tolist() and "b" not in p.proposed_trees


@torch.no_grad()
def test_sampled_verification_of_a_sequential_draft_vocabulary_chain_keeps_the_models_distribution(
        tiny_model, random_sequential):
    """One step at temperature 0.2: the chain the heads draft over a draft vocabulary (the
    model's likeliest next token and the seven tokens the heads rank just below it, so that
    the first draft is often kept) is checked against the model's own distributions after
    the root and after the first draft; what is emitted follows them."""
    prompt = torch.tensor([PROMPTS[1]])
    root = tiny_model(prompt).logits[0, -1].argmax()[None]
    out = tiny_model(torch.cat([prompt[0], root])[None], output_hidden_states=True)
    h = out.hidden_states[-1][0, -2:-1]                                          # the state that produced root
    likeliest = int(out.logits[0, -1].argmax())
    ranked = HeadsDrafter(random_sequential, tiny_model).head_logits(h, root)[0, 0].argsort(descending=True)
    below = ranked[(ranked == likeliest).nonzero()[0, 0] + 1:][:7]
    ids = torch.cat([torch.tensor([likeliest]), below])
    chain = HeadsDrafter(random_sequential.with_draft_vocab(ids), tiny_model).head_logits(h, root)[0, :2].argmax(-1)
    assert int(chain[0]) == likeliest and int(chain[1]) in ids.tolist()          # target ids, from the vocabulary
    logits = tiny_model(torch.cat([prompt[0], root, chain])[None]).logits[0, -3:]  # after root, draft 1, draft 2
    probs = torch.softmax(logits.double() / 0.2, -1)
    gen = torch.Generator().manual_seed(3)
    verdicts = [verify_sampled(chain_tree(2), chain, probs, generator=gen) for _ in range(TRIALS)]
    assert_follows([v.emitted[0] for v in verdicts], probs[0])
    kept = [v.emitted[1] for v in verdicts if v.accepted_nodes[:1] == [0]]
    assert len(kept) > 2000, "the first draft was rarely kept: the second token's check would say little"
    assert_follows(kept, probs[1])
