import pytest

from tests.oracle import OracleDrafter
from vllm_mtpspec.config import SpecOptions
from vllm_mtpspec.drafter import HeadsDrafter
from vllm_mtpspec.heads_init import init_heads
from vllm_mtpspec.reference import ReferenceDecoder, plain_greedy

PROMPTS = [[1, 17, 42, 5], [3, 99, 100, 101, 7, 8, 200, 13], [250]]


@pytest.fixture(scope="module")
def random_heads(tiny_model, tiny_model_dir):
    return init_heads(tiny_model, tiny_model_dir, num_heads=3, init_std=0.3, seed=1)


@pytest.mark.parametrize("tree", ["chain", "consensus", "static", "dynamic"])
def test_greedy_output_equals_the_model_alone(tiny_model, random_heads, tree):
    decoder = ReferenceDecoder(tiny_model, HeadsDrafter(random_heads, tiny_model),
                               SpecOptions(tree=tree, min_path_prob=0.0, prompt_lookup_max=0))
    for prompt in PROMPTS:
        expected = plain_greedy(tiny_model, prompt, max_new_tokens=40, eos_token_ids=set())
        result = decoder.decode(prompt, max_new_tokens=40)
        assert result.tokens == expected
        assert sum(s.accepted_len for s in result.steps) + 1 >= len(result.tokens)


@pytest.mark.parametrize("tree", ["chain", "consensus"])
def test_oracle_heads_are_always_accepted(tiny_model, tree):
    k = 3
    prompt = PROMPTS[1]
    expected = plain_greedy(tiny_model, prompt, max_new_tokens=41, eos_token_ids=set())
    oracle = OracleDrafter(tiny_model, prompt, expected, num_heads=k, vocab_size=tiny_model.config.vocab_size)
    result = ReferenceDecoder(tiny_model, oracle, SpecOptions(tree=tree, prompt_lookup_max=0)).decode(
        prompt, max_new_tokens=41)
    assert result.tokens == expected
    assert [s.accepted_len for s in result.steps] == [k + 1] * 10
    assert result.head_hits == result.head_tries == [10] * k


def test_eos_stops_decoding_inside_an_accepted_run(tiny_model):
    prompt = PROMPTS[0]
    free = plain_greedy(tiny_model, prompt, max_new_tokens=30, eos_token_ids=set())
    eos = free[9]
    expected = plain_greedy(tiny_model, prompt, max_new_tokens=30, eos_token_ids={eos})
    oracle = OracleDrafter(tiny_model, prompt, free, num_heads=3, vocab_size=tiny_model.config.vocab_size)
    result = ReferenceDecoder(tiny_model, oracle, SpecOptions(prompt_lookup_max=0)).decode(
        prompt, max_new_tokens=30, eos_token_ids={eos})
    assert result.tokens == expected and result.tokens[-1] == eos


def test_sampled_decoding_is_seeded_and_reaches_the_length(tiny_model, random_heads):
    decoder = ReferenceDecoder(tiny_model, HeadsDrafter(random_heads, tiny_model), SpecOptions(tree="consensus"))
    a = decoder.decode(PROMPTS[0], max_new_tokens=25, temperature=0.8, seed=3)
    b = decoder.decode(PROMPTS[0], max_new_tokens=25, temperature=0.8, seed=3)
    assert a.tokens == b.tokens and len(a.tokens) == 25


def test_token_conditioned_and_quantized_heads_stay_lossless(tiny_model, tiny_model_dir):
    heads = init_heads(tiny_model, tiny_model_dir, num_heads=2, head_input="hidden+token", init_std=0.3)
    assert heads.config.embed_scale > 0
    for h in (heads, heads.quantized(group_size=32)):
        decoder = ReferenceDecoder(tiny_model, HeadsDrafter(h, tiny_model), SpecOptions(tree="consensus"))
        expected = plain_greedy(tiny_model, PROMPTS[1], max_new_tokens=20, eos_token_ids=set())
        assert decoder.decode(PROMPTS[1], max_new_tokens=20).tokens == expected


def test_prompt_lookup_drafts_stay_lossless(tiny_model, random_heads):
    decoder = ReferenceDecoder(tiny_model, HeadsDrafter(random_heads, tiny_model),
                               SpecOptions(min_path_prob=0.0, prompt_lookup_max=3, prompt_lookup_min=1))
    looked_up = []
    lookup = decoder._lookup
    decoder._lookup = lambda context: looked_up.append(found := lookup(context)) or found
    for prompt in PROMPTS:
        expected = plain_greedy(tiny_model, prompt, max_new_tokens=40, eos_token_ids=set())
        assert decoder.decode(prompt, max_new_tokens=40).tokens == expected
    assert any(found is not None for found in looked_up)


@pytest.fixture(scope="module")
def tiny_gemma3_model(tmp_path_factory):
    """A random Gemma 3 whose sliding layers (window 16) see far less than the answers."""
    from tests.test_model_profile import tiny_gemma3

    out = tmp_path_factory.mktemp("tiny-gemma3-reference")
    return tiny_gemma3(out), out


@pytest.mark.parametrize("tree", ["chain", "consensus"])
def test_the_oracle_is_lossless_past_a_sliding_window(tiny_gemma3_model, tree):
    """Gemma 3's sliding layers see 16 keys; prompt and answer run to 100 tokens, every
    draft accepted (so accepted rows are kept in place across the window's edge), and the
    decoder's output is transformers' own generate()'s."""
    (model, _), k = tiny_gemma3_model, 3
    prompt = [2] + [(7 * i) % 500 + 3 for i in range(39)]
    expected = plain_greedy(model, prompt, max_new_tokens=61, eos_token_ids=set())
    oracle = OracleDrafter(model, prompt, expected, num_heads=k, vocab_size=model.config.vocab_size)
    result = ReferenceDecoder(model, oracle, SpecOptions(tree=tree, prompt_lookup_max=0)).decode(
        prompt, max_new_tokens=61)
    assert result.tokens == expected
    assert [s.accepted_len for s in result.steps] == [k + 1] * 15


def test_random_heads_stay_lossless_past_a_sliding_window(tiny_gemma3_model):
    model, model_dir = tiny_gemma3_model
    heads = init_heads(model, model_dir, num_heads=3, init_std=0.3, seed=1)
    decoder = ReferenceDecoder(model, HeadsDrafter(heads, model), SpecOptions(tree="static", min_path_prob=0.0))
    prompt = [2] + [(11 * i) % 500 + 3 for i in range(29)]
    assert decoder.decode(prompt, max_new_tokens=50).tokens == plain_greedy(model, prompt, max_new_tokens=50,
                                                                           eos_token_ids=set())
