"""`mtpspec serve` under load, side by side with vLLM alone on the same model.

The same 160 requests go to both servers, up to 64 in flight: chat and completions, greedy
and sampled, streamed and not, prompts from a few tokens to the edge of max_model_len,
max_tokens from 1 to 256, stop strings, n = 2, and requests that take the fallback path
(penalties, logprobs, structured output), and logit bias, which vLLM refuses with any
speculative method (a 400 that says so). Every request must be answered, every
greedy answer must be the plain server's token for token, usage must count what was sent,
and the spec-decode counters must agree with what was generated. Then clients that go away
(streams cut mid-answer, requests dropped before their first token) must leave no request
running and no KV block in use."""
from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from vllm_mtpspec.bench.servers import running_server

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 768
NUM_REQUESTS = 160
IN_FLIGHT = 64
SPEC_TOKENS = 3
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", "320M",
               "--max-num-seqs", "16", "--enforce-eager", "--seed", "0"]
# A tie at the first difference means both answers are the model's: fp32 sums in another
# order (a batch of another shape) can swap two tokens this close, with or without drafts;
# any other difference fails.
TIE_LOGPROB_GAP = 1e-4
MAX_TIES = 2


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from vllm_mtpspec.models import fetch_model

    return AutoTokenizer.from_pretrained(str(fetch_model("smollm2-135m-instruct", dtype="fp32")))


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from vllm_mtpspec.models import fetch_model
    from vllm_mtpspec.shipped import shipped_heads_dir

    model = str(fetch_model("smollm2-135m-instruct", dtype="fp32"))
    logs = tmp_path_factory.mktemp("servers")
    args = [*SERVER_ARGS, "--num-speculative-tokens", str(SPEC_TOKENS)]
    with running_server("plain", model, None, logs / "plain.log", SERVER_ARGS) as plain, \
            running_server("mtpspec", model, str(shipped_heads_dir()), logs / "mtpspec.log", args) as spec:
        yield model, plain, spec


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Held-out ShareGPT prompts: the heads never saw them."""
    from vllm_mtpspec.bench.prompts import sharegpt_held_out_prompts

    return [p.text for p in sharegpt_held_out_prompts()]


def request_mix(texts: list[str], tokenizer, rng: random.Random) -> list[dict]:
    """NUM_REQUESTS request descriptions."""
    long_ids = tokenizer.encode("\n\n".join(texts[:60]), add_special_tokens=False)
    blank = tokenizer.encode(" the", add_special_tokens=False)[0]
    mix = []
    for i in range(NUM_REQUESTS):
        endpoint = "chat" if i % 2 else "completions"
        max_tokens = rng.choice([1, 2, 4, 8, 16, 16, 32, 32, 48, 64, 128, 256])
        body: dict = {"max_tokens": max_tokens, "return_token_ids": True,
                      "temperature": 0.0 if rng.random() < 0.6 else 0.8}
        size = rng.choice(["few", "one", "one", "one", "long", "edge"])
        text = rng.choice(texts)
        if size == "few":
            text = " ".join(text.split()[:3])
        elif size == "long":
            start = rng.randrange(len(long_ids) - 500)
            text = tokenizer.decode(long_ids[start:start + 400])
        if size == "edge" and endpoint == "completions":
            # Token ids, so the prompt ends right where max_model_len leaves max_tokens.
            length = MAX_MODEL_LEN - max_tokens - rng.randrange(0, 4)
            start = rng.randrange(len(long_ids) - length)
            body["prompt"] = long_ids[start:start + length]
        elif endpoint == "completions":
            body["prompt"] = text
        else:
            body["messages"] = [{"role": "user", "content": text if size != "edge" else tokenizer.decode(
                long_ids[:MAX_MODEL_LEN - max_tokens - 64])}]
        roll = rng.random()
        if roll < 0.1:
            body["stop"] = rng.choice([["\n\n"], [".", "!"], ["the"]])
        elif roll < 0.18 and endpoint == "completions" and body["temperature"]:
            body["n"] = 2  # vLLM refuses n > 1 for greedy requests
        elif roll < 0.36:
            fallback = rng.choice(["penalty", "logprobs", "logit_bias", "structured"])
            if fallback == "penalty":
                body["presence_penalty"] = 0.6
            elif fallback == "logprobs":
                body.update({"logprobs": 2} if endpoint == "completions" else {"logprobs": True, "top_logprobs": 2})
            elif fallback == "logit_bias":
                body["logit_bias"] = {str(blank): -100}
            elif endpoint == "completions":
                body["structured_outputs"] = {"choice": ["yes", "no", "it depends"]}
            else:
                body["response_format"] = {"type": "json_object"}
        stream = rng.random() < 0.4 and body.get("n", 1) == 1
        if stream:
            body.update({"stream": True, "stream_options": {"include_usage": True}})
        mix.append({"endpoint": endpoint, "body": body})
    return mix


def send(base: str, model: str, request: dict) -> dict:
    """One request, read to its end: status, and per choice the token ids and text, usage."""
    path = "/v1/chat/completions" if request["endpoint"] == "chat" else "/v1/completions"
    body = {"model": model, **request["body"]}
    reply = requests.post(base + path, json=body, timeout=600, stream=bool(body.get("stream")))
    if reply.status_code != 200:
        return {"status": reply.status_code, "error": reply.text[:500]}
    if not body.get("stream"):
        data = reply.json()
        choices = [{"token_ids": c.get("token_ids") or [], "finish": c["finish_reason"],
                    "text": c["message"]["content"] if "message" in c else c["text"]}
                   for c in sorted(data["choices"], key=lambda c: c["index"])]
        return {"status": 200, "choices": choices, "usage": data["usage"],
                "prompt_token_ids": data.get("prompt_token_ids") or data["choices"][0].get("prompt_token_ids")}
    tokens, text, finish, usage, prompt_ids, done = [], [], None, None, None, False
    for line in reply.iter_lines():
        if not line.startswith(b"data: "):
            continue
        if line == b"data: [DONE]":
            done = True
            break
        chunk = json.loads(line[6:])
        if "error" in chunk:  # a request refused after its stream began (vLLM's validation)
            return {"status": chunk["error"].get("code") or 500, "error": json.dumps(chunk)[:500]}
        if chunk.get("usage"):
            usage = chunk["usage"]
        prompt_ids = prompt_ids or chunk.get("prompt_token_ids")
        for c in chunk.get("choices", []):
            prompt_ids = prompt_ids or c.get("prompt_token_ids")
            tokens.extend(c.get("token_ids") or [])
            text.append((c.get("delta") or {}).get("content") or c.get("text") or "")
            finish = c.get("finish_reason") or finish
    return {"status": 200 if done else "stream ended without [DONE]", "usage": usage, "prompt_token_ids": prompt_ids,
            "choices": [{"token_ids": tokens, "finish": finish, "text": "".join(text)}]}


def send_all(base: str, model: str, mix: list[dict]) -> list[dict]:
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        return list(pool.map(lambda r: send(base, model, r), mix))


def logprob_gap(base: str, model: str, prompt_ids: list[int], prefix: list[int], ours: int, theirs: int) -> float:
    """How far apart the plain model puts two next tokens after prefix (inf when either is
    not among its five likeliest)."""
    reply = requests.post(f"{base}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt_ids + prefix, "max_tokens": 1, "temperature": 0, "logprobs": 5,
        "return_tokens_as_token_ids": True})
    top = reply.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    a, b = top.get(f"token_id:{ours}"), top.get(f"token_id:{theirs}")
    return float("inf") if a is None or b is None else abs(a - b)


# Requests whose next-token distribution depends on more than the text so far (penalties
# count output tokens only, a grammar its own state, a bias is not in raw logprobs): a
# difference there cannot be checked for a tie.
NOT_TIE_CHECKABLE = ("presence_penalty", "logit_bias", "structured_outputs", "response_format")


@pytest.fixture(scope="module")
def answered(servers, texts, tokenizer):
    model, plain, spec = servers
    mix = request_mix(texts, tokenizer, random.Random(0))
    before = {s.label: s.metrics() for s in (plain, spec)}
    results = {s.label: send_all(s.base_url, model, mix) for s in (plain, spec)}
    time.sleep(2)
    after = {s.label: s.metrics() for s in (plain, spec)}
    return mix, results, before, after


# vLLM refuses these with any speculative method, with a 400 that says so (its own
# validation, before mtpspec sees the request); vLLM alone serves them.
REFUSED_WITH_SPECULATION = {"logit_bias": "not yet supported with speculative decoding"}


def refused_with_speculation(body: dict) -> str | None:
    return next((phrase for key, phrase in REFUSED_WITH_SPECULATION.items() if key in body), None)


def test_every_request_is_answered_and_counted(servers, answered):
    model, plain, spec = servers
    mix, results, _, _ = answered
    for label, replies in results.items():
        expected_refusals = [(i, refused_with_speculation(q["body"])) for i, q in enumerate(mix)
                             if label == "mtpspec" and refused_with_speculation(q["body"])]
        for i, phrase in expected_refusals:
            reply, body = replies[i], mix[i]["body"]
            # vLLM's chat stream generator reports the refusal inside the stream as an internal error.
            streamed_chat = mix[i]["endpoint"] == "chat" and body.get("stream")
            assert reply["status"] in (400, 500), (i, reply)
            assert phrase in reply["error"] or streamed_chat and "Internal server error" in reply["error"], (i, reply)
        refused = {i for i, _ in expected_refusals}
        failed = [(i, r["status"], r.get("error")) for i, r in enumerate(replies) if r["status"] != 200
                  and i not in refused]
        assert not failed, (label, failed[:5])
        for i, (request, reply) in enumerate(zip(mix, replies)):
            if i in refused:
                continue
            body = request["body"]
            assert reply["usage"] is not None, (label, body)
            assert len(reply["choices"]) == body.get("n", 1)
            generated = sum(len(c["token_ids"]) for c in reply["choices"])
            assert reply["usage"]["completion_tokens"] == generated, (label, body, reply["usage"])
            assert reply["usage"]["prompt_tokens"] == len(reply["prompt_token_ids"]), (label, body)
            for choice in reply["choices"]:
                assert 1 <= len(choice["token_ids"]) <= body["max_tokens"], (label, body)
        assert plain.healthy() and spec.healthy()


def test_greedy_answers_are_the_plain_servers_token_for_token(servers, answered):
    model, plain, _ = servers
    mix, results, _, _ = answered
    ties, greedy = [], 0
    for i, request in enumerate(mix):
        if request["body"]["temperature"] or refused_with_speculation(request["body"]):
            continue
        greedy += 1
        ours, theirs = results["mtpspec"][i], results["plain"][i]
        assert ours["prompt_token_ids"] == theirs["prompt_token_ids"], i
        for a, b in zip(ours["choices"], theirs["choices"]):
            if a["token_ids"] == b["token_ids"]:
                assert a["text"] == b["text"] and a["finish"] == b["finish"], (i, request["body"])
                continue
            first = next((k for k, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y), None)
            assert first is not None, (f"request {i}: one answer stops early", request["body"], a, b)
            assert not any(key in request["body"] for key in NOT_TIE_CHECKABLE), (i, first, request["body"])
            gap = logprob_gap(plain.base_url, model, theirs["prompt_token_ids"], b["token_ids"][:first],
                              a["token_ids"][first], b["token_ids"][first])
            assert gap < TIE_LOGPROB_GAP, (f"request {i} differs at token {first} where the model's choice is "
                                           f"clear (logprob gap {gap:.2e})", request["body"])
            ties.append((i, first, gap))
    assert greedy >= 60  # about half of the mix is greedy and not refused
    assert len(ties) <= MAX_TIES, ties


def test_spec_decode_counters_agree_with_what_was_generated(answered):
    mix, results, before, after = answered
    delta = {label: {k: after[label].get(k, 0.0) - before[label].get(k, 0.0) for k in after[label]}
             for label in after}
    for label, replies in results.items():
        sent = sum(r["usage"]["completion_tokens"] for r in replies if r["status"] == 200)
        generated = delta[label]["vllm:generation_tokens_total"]
        # Tokens past a stop string are generated, then cut; with drafts, a step may make
        # up to 1 + SPEC_TOKENS of them.
        stops = sum(len(r["choices"]) for r, q in zip(replies, mix) if "stop" in q["body"] and r["status"] == 200)
        slack = stops * (1 + SPEC_TOKENS if label == "mtpspec" else 1)
        assert sent <= generated <= sent + slack, (label, sent, generated)
    spec = delta["mtpspec"]
    drafts = spec["vllm:spec_decode_num_drafts_total"]
    drafted = spec["vllm:spec_decode_num_draft_tokens_total"]
    accepted = spec["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and 0 < accepted <= drafted <= SPEC_TOKENS * drafts
    assert spec["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == accepted
    # Every drafted step of a request emits its accepted drafts and one token of its own.
    assert accepted + drafts <= spec["vllm:generation_tokens_total"]
    assert not any(k.startswith("vllm:spec_decode") and v for k, v in delta["plain"].items())


def test_clients_that_go_away_leave_no_request_running_and_no_kv_in_use(servers, answered, texts, tokenizer):
    model, plain, spec = servers
    mix = request_mix(texts, tokenizer, random.Random(1))
    long_prompts = [r["body"]["prompt"] for r in mix if isinstance(r["body"].get("prompt"), list)][:8]

    def cut_stream(i):
        reply = requests.post(f"{spec.base_url}/v1/completions", stream=True, timeout=300, json={
            "model": model, "prompt": f"Tell me a long story about ship number {i}.", "max_tokens": 200,
            "temperature": 0, "stream": True})
        for n, _ in enumerate(reply.iter_lines()):
            if n >= 6:
                break
        reply.close()

    def drop_before_first_token(prompt):
        try:
            requests.post(f"{spec.base_url}/v1/completions", timeout=(10, 0.05), json={
                "model": model, "prompt": prompt, "max_tokens": 100, "temperature": 0})
        except requests.Timeout:
            pass

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(cut_stream, range(8)))
        list(pool.map(drop_before_first_token, long_prompts))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = spec.metrics()
        if now["vllm:num_requests_running"] == 0 and now["vllm:num_requests_waiting"] == 0 \
                and now["vllm:kv_cache_usage_perc"] == 0:
            break
        time.sleep(1)
    assert now["vllm:num_requests_running"] == 0 and now["vllm:num_requests_waiting"] == 0, now
    assert now["vllm:kv_cache_usage_perc"] == 0, now
    # And it serves as before: a later batch answers as the plain server does.
    later = [r for r in request_mix(texts, tokenizer, random.Random(2))
             if not r["body"]["temperature"] and not refused_with_speculation(r["body"])][:16]
    ours, theirs = send_all(spec.base_url, model, later), send_all(plain.base_url, model, later)
    assert [r["status"] for r in ours] == [200] * len(later)
    same = sum(a["choices"] == b["choices"] for a, b in zip(ours, theirs))
    assert same >= len(later) - MAX_TIES


def test_vllms_own_serving_benchmark_measures_both_servers(servers, answered, tmp_path):
    """`mtpspec bench-serve` against running servers: vLLM's client through the shim."""
    from argparse import Namespace

    from vllm_mtpspec.bench.serve_load import held_out_sharegpt_file, markdown_table, measure_all

    model, plain, spec = servers
    dataset = held_out_sharegpt_file(tmp_path / "held-out.json")
    args = Namespace(num_prompts=6, output_len=24, temperature=0.0)
    results = measure_all({"mtpspec": spec.base_url, "plain": plain.base_url}, args, model, dataset, [1, 4], tmp_path)
    assert [(r["server"], r["concurrency"]) for r in results] == [("plain", 1), ("mtpspec", 1), ("plain", 4),
                                                                   ("mtpspec", 4)]
    for r in results:
        assert r["completed"] == 6 and r["failed"] == 0, r
        assert r["output_throughput"] > 0 and r["mean_tpot_ms"] > 0 and r["p99_ttft_ms"] >= r["median_ttft_ms"]
    by_server = {(r["server"], r["concurrency"]): r for r in results}
    # Greedy and lossless: both servers generate the same number of tokens.
    assert by_server[("plain", 4)]["total_output_tokens"] == by_server[("mtpspec", 4)]["total_output_tokens"]
    assert by_server[("mtpspec", 1)]["spec_decode_acceptance_length"] > 1.0
    assert by_server[("plain", 1)].get("spec_decode_acceptance_length") is None
    table = markdown_table(results)
    assert table.count("| mtpspec |") == 2 and "x |" in table
