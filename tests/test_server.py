"""`mtpspec serve`: vLLM's OpenAI server with the shipped heads, on 127.0.0.1."""
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from vllm_mtpspec.bench.servers import running_server, server_metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from vllm_mtpspec.models import fetch_model
    from vllm_mtpspec.shipped import shipped_heads_dir

    model = str(fetch_model("smollm2-135m-instruct", dtype="fp32"))
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--num-speculative-tokens", "3", "--dtype", "float32", "--max-model-len", "1024",
            "--kv-cache-memory-bytes", "128M", "--max-num-seqs", "16", "--enforce-eager"]
    with running_server("mtpspec", model, str(shipped_heads_dir()), log, args,
                        env={"VLLM_LOG_STATS_INTERVAL": "1"}, ready_timeout=300) as started:
        yield started.base_url, model


def test_chat_stream_concurrency_and_metrics(server):
    base, model = server
    before = server_metrics(base)
    chat = requests.post(f"{base}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 24, "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"].strip()

    streamed = requests.post(f"{base}/v1/completions", timeout=120, stream=True, json={
        "model": model, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0, "stream": True})
    chunks = [line for line in streamed.iter_lines() if line.startswith(b"data: ")]
    assert chunks[-1] == b"data: [DONE]" and len(chunks) > 2
    text = "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks[:-1])
    assert text.strip()

    def one(i):
        r = requests.post(f"{base}/v1/completions", timeout=300, json={
            "model": model, "prompt": f"Question {i}: what is {i} plus {i}? Answer:", "max_tokens": 16, "temperature": 0})
        return r.status_code, r.json()["usage"]["completion_tokens"] if r.status_code == 200 else r.text

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert all(code == 200 for code, _ in results), results
    assert all(tokens >= 1 for _, tokens in results)

    time.sleep(2)  # metrics are logged every second
    after = server_metrics(base)
    assert after["vllm:spec_decode_num_drafts_total"] > before.get("vllm:spec_decode_num_drafts_total", 0)
    assert after["vllm:spec_decode_num_accepted_tokens_total"] > before.get("vllm:spec_decode_num_accepted_tokens_total", 0)


# Each bad request, what vLLM's validation answers it with, and a phrase of the answer.
BAD_REQUESTS = [
    ("negative max_tokens", {"max_tokens": -1}, 400, "max_tokens must be at least 1"),
    ("max_tokens past max_model_len", {"max_tokens": 10 ** 9}, 400, "cannot be greater than max_model_len"),
    ("temperature below 0", {"temperature": -0.5}, 400, "temperature must be non-negative"),
    ("top_p above 1", {"top_p": 1.5}, 400, "top_p must be in (0, 1]"),
    ("n = 0", {"n": 0}, 400, "n must be at least 1"),
    ("unknown logit_bias token", {"logit_bias": {"10000000": 5}}, 400, "out-of-vocab token ids"),
    ("unknown model", {"model": "no-such-model"}, 404, "does not exist"),
    ("prompt longer than max_model_len", {"prompt": "word " * 3000}, 400, "maximum context length is 1024"),
]


def test_bad_requests_get_a_clear_4xx_and_the_server_keeps_serving(server):
    base, model = server
    seen = {}
    for name, change, status, phrase in BAD_REQUESTS:
        body = {"model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 0, **change}
        reply = requests.post(f"{base}/v1/completions", json=body, timeout=60)
        seen[name] = reply.status_code
        assert reply.status_code == status, (name, reply.status_code, reply.text[:300])
        assert phrase in reply.json()["error"]["message"], (name, reply.text[:300])
    malformed = requests.post(f"{base}/v1/completions", data="{not json", timeout=60,
                              headers={"Content-Type": "application/json"})
    assert 400 <= malformed.status_code < 500, malformed.text[:300]
    assert requests.get(f"{base}/health", timeout=10).status_code == 200
    good = requests.post(f"{base}/v1/completions", timeout=120, json={
        "model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1, seen
