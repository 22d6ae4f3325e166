"""Model profiles: what differs between architectures, read from a folder's config.json, and
a drafter that reads the same inputs in training as when it serves on each of them."""
from __future__ import annotations

import math

import pytest
import torch


def tiny_gemma3(out, *, vocab_size: int = 512, num_layers: int = 6, seed: int = 0):
    """A random Gemma 3 text model (sliding layers 5 of 6, scaled embedding, 1 + w norms)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=64, sliding_window=16, max_position_embeddings=1024,
                              query_pre_attn_scalar=64, tie_word_embeddings=True)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # trained Gemma norms are far from their zero initialisation
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)
    model.save_pretrained(out)
    return model


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-gemma3")
    tiny_gemma3(out)
    return out


def test_a_gemma3_profile_says_what_differs_from_llama(gemma3_dir, tiny_model_dir):
    from vllm_mtpspec.model_profile import model_profile

    gemma = model_profile(gemma3_dir)
    assert gemma.model_type == "gemma3_text" and gemma.architecture == "Gemma3ForCausalLM"
    assert gemma.embed_scale == pytest.approx(math.sqrt(64))
    assert gemma.norm_gain_offset == 1.0 and gemma.needs_bos
    assert gemma.layer_windows == (16, 16, 16, 16, 16, None)
    assert gemma.default_feature_layers == [2, 3]

    llama = model_profile(tiny_model_dir)
    assert (llama.embed_scale, llama.norm_gain_offset, llama.needs_bos) == (1.0, 0.0, False)
    assert llama.layer_windows == (None, None)
    assert llama.tied_embeddings and llama.num_layers == 2


def test_a_folder_without_the_sizes_a_drafter_needs_is_refused_by_name(tmp_path):
    from vllm_mtpspec.model_profile import ModelProfileError, model_profile

    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    with pytest.raises(ModelProfileError, match=r"config.json: no num_hidden_layers, vocab_size"):
        model_profile(tmp_path)
    with pytest.raises(ModelProfileError, match="no config.json"):
        model_profile(tmp_path / "missing")


def test_training_reads_the_token_embedding_gemma3_feeds_its_first_layer(gemma3_dir):
    """The rows a drafter is trained on (weights.embedding_and_lm_head) are the rows it is
    served (the model's own embedding module, as vLLM's embed_input_ids: Gemma scales them
    by sqrt(d)), and the LM-head rows drafted through are the unscaled ones."""
    from transformers import AutoModelForCausalLM

    from vllm_mtpspec.model_profile import model_profile
    from vllm_mtpspec.vllm.proposer import draft_vocab_lm_head_rows
    from vllm_mtpspec.weights import embedding_and_lm_head

    model = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32).eval()
    ids = torch.tensor([2, 7, 300, 511])
    embed, lm_head = embedding_and_lm_head(gemma3_dir)
    with torch.no_grad():
        served = model.get_input_embeddings()(ids)
        # What the first layer reads: the state entering layer 0 as the model records it.
        entering = model(ids[None], output_hidden_states=True).hidden_states[0][0]
    torch.testing.assert_close(embed[ids], served)
    torch.testing.assert_close(embed[ids], entering)
    torch.testing.assert_close(lm_head, model.get_output_embeddings().weight.detach())
    rows = draft_vocab_lm_head_rows(ids, embed=model.get_input_embeddings(), tied_target=True,
                                    embed_scale=model_profile(gemma3_dir).embed_scale, model="unused",
                                    heads_dir="h")
    torch.testing.assert_close(rows, lm_head[ids])


def test_fresh_heads_on_gemma3_weigh_the_scaled_embedding_against_the_final_state(gemma3_dir):
    """Token-conditioned heads scale the embedding to the final state's size: for Gemma the
    embedding the heads read is sqrt(d) times the raw rows, and the final norm's gain is 1 + w."""
    from transformers import AutoModelForCausalLM

    from vllm_mtpspec.heads_init import embedding_scale

    model = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.arange(512)[None]
        out = model(ids, output_hidden_states=True)
        final = model.model.norm(out.hidden_states[-1])[0]  # transformers keeps pre-norm states
        served_embed = model.get_input_embeddings()(ids)[0]
    ratio = final.norm(dim=-1).mean() / served_embed.norm(dim=-1).mean()
    # The heuristic's |gain| / |embedding row| is the final state's size for a unit-RMS input.
    assert embedding_scale(model) == pytest.approx(float(ratio), rel=0.35)


def test_prompt_ids_give_gemma_its_bos_and_keep_it_when_a_prompt_is_cut():
    from vllm_mtpspec.prompts import prompt_ids

    class PlainTokenizer:  # a base model's tokenizer that adds BOS, as Gemma's does
        chat_template = None
        bos_token_id = 2

        def encode(self, text, add_special_tokens):
            return ([2] if add_special_tokens else []) + [10 + len(w) for w in text.split()]

    tok = PlainTokenizer()
    assert prompt_ids(tok, "a bb ccc") == [2, 11, 12, 13]
    assert prompt_ids(tok, "a bb ccc dddd", max_prompt_tokens=3) == [2, 13, 14]
    # Earlier turns go first: a base model reads them one after another.
    assert prompt_ids(tok, "ccc", (("user", "a"), ("assistant", "bb")), max_prompt_tokens=2) == [2, 13]


@torch.no_grad()
def test_a_fresh_block_passes_a_gemma3_final_state_through_exactly(gemma3_dir):
    """Gemma 3 270M's final norm gains run from 0.19 to 301: a fresh block that only put h's
    RMS back at its output turned the LM head's ranking over (a cross-entropy of 92 on its
    own greedy answers). Dividing the gain out at the feature norm and putting it back at the
    output norm passes h through as it is."""
    from transformers import AutoModelForCausalLM

    from vllm_mtpspec.heads_init import init_draft_block

    model = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32).eval()
    block = init_draft_block(model, gemma3_dir, num_heads=2).eval()
    ids = torch.tensor([[2, 14, 15, 92, 65, 35]])
    h = model.model(input_ids=ids).last_hidden_state[0]
    out = block.extend(block.empty_cache(), h, model.get_input_embeddings()(ids[0]))
    torch.testing.assert_close(out, h, rtol=1e-4, atol=1e-4)
