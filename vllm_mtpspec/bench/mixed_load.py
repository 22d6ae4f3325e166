"""A mixed serving load sent to two OpenAI-compatible servers, and their greedy answers
compared token for token.

The mix: chat and completions, greedy and sampled, streamed and not, prompts from a few
tokens to the edge of max_model_len, max_tokens from 1 to 256, stop strings, n = 2, and
requests that take mtpspec's fallback path (penalties, logprobs, structured output), and
logit bias, which vLLM refuses with any speculative method. tests/test_server_load.py
checks a server against it; benchmarks/serve_under_load.py writes what it found to a
result file.

A greedy answer that differs from the plain server's is a tie when, at the first token
where they part, the plain model puts the two tokens within `tie_gap` of each other in
logprob: fp32 sums taken in another order (a batch of another shape) can swap two tokens
that close, with drafts or without. Any other difference is one the drafts made.
"""
from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import requests

# vLLM refuses these with any speculative method, with a 400 that says so (its own
# validation, before mtpspec sees the request); vLLM alone serves them.
REFUSED_WITH_SPECULATION = {"logit_bias": "not yet supported with speculative decoding"}

# Requests whose next-token distribution depends on more than the text so far (penalties
# count output tokens only, a grammar its own state, a bias is not in raw logprobs): a
# difference there cannot be checked for a tie.
NOT_TIE_CHECKABLE = ("presence_penalty", "logit_bias", "structured_outputs", "response_format")

TIE_LOGPROB_GAP = 1e-4


def server_args(max_model_len: int) -> list[str]:
    """vllm serve arguments for both servers: fp32, at most 16 sequences at once (64 requests
    in flight wait their turn), 320 MB of KV cache, eager."""
    return ["--dtype", "float32", "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes", "320M",
            "--max-num-seqs", "16", "--enforce-eager", "--seed", "0"]


def refused_with_speculation(body: dict) -> str | None:
    return next((phrase for key, phrase in REFUSED_WITH_SPECULATION.items() if key in body), None)


def request_mix(texts: list[str], tokenizer, rng: random.Random, *, num_requests: int,
                max_model_len: int) -> list[dict]:
    """num_requests request descriptions ({"endpoint": "chat" | "completions", "body": ...})."""
    long_ids = tokenizer.encode("\n\n".join(texts[:60]), add_special_tokens=False)
    blank = tokenizer.encode(" the", add_special_tokens=False)[0]
    mix = []
    for i in range(num_requests):
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
            length = max_model_len - max_tokens - rng.randrange(0, 4)
            start = rng.randrange(len(long_ids) - length)
            body["prompt"] = long_ids[start:start + length]
        elif endpoint == "completions":
            body["prompt"] = text
        else:
            body["messages"] = [{"role": "user", "content": text if size != "edge" else tokenizer.decode(
                long_ids[:max_model_len - max_tokens - 64])}]
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


def send_all(base: str, model: str, mix: list[dict], in_flight: int) -> list[dict]:
    with ThreadPoolExecutor(in_flight) as pool:
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


def compare_greedy(mix: list[dict], ours: list[dict], theirs: list[dict], *, plain_url: str, model: str,
                   tie_gap: float = TIE_LOGPROB_GAP) -> dict:
    """Every greedy request that both servers answered, ours against the plain server's
    (theirs): {"greedy", "identical", "ties", "differences"}. A tie or a difference names
    the request, the first token where the answers part and the plain model's logprob gap
    there (None where it cannot be checked: see NOT_TIE_CHECKABLE); a difference also says
    why it is one."""
    greedy = identical = 0
    ties, differences = [], []
    for i, request in enumerate(mix):
        body = request["body"]
        if body["temperature"] or refused_with_speculation(body):
            continue
        greedy += 1
        a_reply, b_reply = ours[i], theirs[i]
        if a_reply.get("status") != 200 or b_reply.get("status") != 200:
            differences.append({"request": i, "token": None, "logprob_gap": None,
                                "why": f"answered with status {a_reply.get('status')} against {b_reply.get('status')}"})
            continue
        if a_reply["prompt_token_ids"] != b_reply["prompt_token_ids"]:
            differences.append({"request": i, "token": None, "logprob_gap": None, "why": "the prompts' tokens differ"})
            continue
        parted = None
        for a, b in zip(a_reply["choices"], b_reply["choices"]):
            if a["token_ids"] == b["token_ids"]:
                if a["text"] != b["text"] or a["finish"] != b["finish"]:
                    parted = {"token": None, "logprob_gap": None, "why": "same tokens, another text or finish"}
                continue
            first = next((k for k, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y), None)
            if first is None:
                parted = {"token": min(len(a["token_ids"]), len(b["token_ids"])), "logprob_gap": None,
                          "why": "one answer stops early"}
            elif any(key in body for key in NOT_TIE_CHECKABLE):
                parted = {"token": first, "logprob_gap": None, "why": "differs where a tie cannot be checked"}
            else:
                gap = logprob_gap(plain_url, model, b_reply["prompt_token_ids"], b["token_ids"][:first],
                                  a["token_ids"][first], b["token_ids"][first])
                parted = {"token": first, "logprob_gap": gap,
                          "why": None if gap < tie_gap else "differs where the model's choice is clear"}
            break
        if parted is None:
            identical += 1
        elif parted["why"] is None:
            ties.append({"request": i, "token": parted["token"], "logprob_gap": parted["logprob_gap"]})
        else:
            differences.append({"request": i, **parted})
    return {"greedy": greedy, "identical": identical, "ties": ties, "differences": differences}
