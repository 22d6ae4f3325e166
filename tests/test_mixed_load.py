"""How compare_greedy sorts two servers' greedy answers (vllm_mtpspec/bench/mixed_load.py):
identical, a tie the plain model cannot tell apart, or a difference and why. No server:
the replies are made here and the plain model's logprob gap is given."""
import pytest

from vllm_mtpspec.bench import mixed_load
from vllm_mtpspec.bench.mixed_load import compare_greedy


def request(temperature=0.0, **body):
    return {"endpoint": "completions", "body": {"prompt": "x", "max_tokens": 4, "temperature": temperature, **body}}


def reply(tokens, text=None, finish="length", prompt=(1, 2)):
    text = " ".join(map(str, tokens)) if text is None else text
    return {"status": 200, "prompt_token_ids": list(prompt),
            "choices": [{"token_ids": list(tokens), "text": text, "finish": finish}]}


@pytest.fixture
def gaps(monkeypatch):
    """The plain model's logprob gap, as each test sets it, and what it was asked."""
    asked = []

    def gap(base, model, prompt_ids, prefix, ours, theirs):
        asked.append((tuple(prefix), ours, theirs))
        return gap.value

    gap.value = 0.0
    monkeypatch.setattr(mixed_load, "logprob_gap", gap)
    return gap, asked


def test_identical_answers_and_sampled_or_refused_requests(gaps):
    mix = [request(), request(temperature=0.8), request(logit_bias={"5": -100})]
    ours = [reply([3, 4, 5]), reply([9]), {"status": 400, "error": "not yet supported with speculative decoding"}]
    theirs = [reply([3, 4, 5]), reply([7]), reply([3])]
    found = compare_greedy(mix, ours, theirs, plain_url="http://plain", model="m")
    assert found == {"greedy": 1, "identical": 1, "ties": [], "differences": []}
    assert gaps[1] == []


def test_a_part_at_a_near_tie_is_a_tie_and_a_clear_choice_a_difference(gaps):
    gap, asked = gaps
    mix = [request(), request()]
    ours, theirs = [reply([3, 4, 6]), reply([3, 8])], [reply([3, 4, 5]), reply([3, 9])]
    gap.value = 5e-5
    found = compare_greedy(mix[:1], ours[:1], theirs[:1], plain_url="http://plain", model="m")
    assert found["ties"] == [{"request": 0, "token": 2, "logprob_gap": 5e-5}] and not found["differences"]
    assert asked == [((3, 4), 6, 5)]  # asked after the shared prefix, ours then theirs
    gap.value = 0.3
    found = compare_greedy(mix, ours, theirs, plain_url="http://plain", model="m")
    assert found["identical"] == 0 and not found["ties"]
    assert [(d["request"], d["token"], d["why"]) for d in found["differences"]] == [
        (0, 2, "differs where the model's choice is clear"), (1, 1, "differs where the model's choice is clear")]


def test_what_cannot_be_a_tie_is_a_difference(gaps):
    mix = [request(presence_penalty=0.6), request(), request(), request(), request()]
    ours = [reply([3, 4]), reply([3]), reply([3, 4], finish="stop"), reply([3], prompt=(1,)),
            {"status": 500, "error": "boom"}]
    theirs = [reply([3, 5]), reply([3, 4]), reply([3, 4], finish="length"), reply([3]), reply([3])]
    found = compare_greedy(mix, ours, theirs, plain_url="http://plain", model="m")
    assert found["greedy"] == 5 and found["identical"] == 0 and not found["ties"]
    assert [(d["request"], d["why"]) for d in found["differences"]] == [
        (0, "differs where a tie cannot be checked"), (1, "one answer stops early"),
        (2, "same tokens, another text or finish"), (3, "the prompts' tokens differ"),
        (4, "answered with status 500 against 200")]
    assert gaps[1] == []
