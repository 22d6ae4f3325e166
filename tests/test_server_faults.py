"""`mtpspec serve` when things break: the engine process dies, the heads directory changes
under a running server, a restart finds it damaged."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest
import requests

from vllm_mtpspec.bench.servers import ServerError, running_server, start_server

pytestmark = pytest.mark.slow

SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "64M",
               "--max-num-seqs", "8", "--enforce-eager", "--num-speculative-tokens", "3"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colours:", "Once upon a time"]


@pytest.fixture(scope="module")
def model():
    from vllm_mtpspec.models import fetch_model

    return str(fetch_model("smollm2-135m-instruct", dtype="fp32"))


@pytest.fixture
def heads_copy(tmp_path):
    from vllm_mtpspec.shipped import shipped_heads_dir

    return shutil.copytree(shipped_heads_dir(), tmp_path / "heads")


def greedy_answers(base: str, model: str) -> list[str]:
    out = []
    for prompt in PROMPTS:
        reply = requests.post(f"{base}/v1/completions", timeout=300, json={
            "model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0})
        assert reply.status_code == 200, reply.text[:300]
        out.append(reply.json()["choices"][0]["text"])
    return out


def engine_core(server_pid: int):
    import psutil

    children = psutil.Process(server_pid).children(recursive=True)
    named = [c for c in children if "EngineCore" in " ".join([c.name(), *c.cmdline()])]
    assert named or len(children) == 1, [c.cmdline() for c in children]
    return (named or children)[0]


def test_a_dead_engine_fails_requests_clearly_turns_health_bad_and_a_restart_serves(model, heads_copy, tmp_path):
    # VLLM_KEEP_ALIVE_ON_ENGINE_DEATH keeps the front end up so that what it reports can be
    # read (without it vLLM's front end shuts itself down within seconds).
    env = {"VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"}
    with running_server("mtpspec", model, str(heads_copy), tmp_path / "first.log", SERVER_ARGS, env=env) as server:
        expected = greedy_answers(server.base_url, model)
        stream = requests.post(f"{server.base_url}/v1/completions", stream=True, timeout=120, json={
            "model": model, "prompt": "Write a long story about a lighthouse.", "max_tokens": 400, "temperature": 0,
            "stream": True})
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith(b"data: "))  # mid-answer
        os.kill(engine_core(server.process.pid).pid, signal.SIGKILL)
        rest = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
        # vLLM ends the stream (with or without an error chunk); no choice claims to be done.
        finished = [c["finish_reason"] for chunk in rest for c in chunk.get("choices", []) if c.get("finish_reason")]
        assert not finished or any("error" in chunk for chunk in rest), rest[-3:]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and server.healthy():
            time.sleep(1)
        assert requests.get(f"{server.base_url}/health", timeout=10).status_code == 503
        failed = requests.post(f"{server.base_url}/v1/completions", timeout=60, json={
            "model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert failed.status_code >= 500, failed.text[:300]
        assert "EngineCore encountered an issue" in failed.text or "EngineDeadError" in failed.text, failed.text[:300]
    with running_server("mtpspec", model, str(heads_copy), tmp_path / "again.log", SERVER_ARGS, env=env) as server:
        assert greedy_answers(server.base_url, model) == expected


def test_heads_are_read_once_at_start_up_and_a_damaged_directory_stops_a_restart(model, heads_copy, tmp_path):
    with running_server("mtpspec", model, str(heads_copy), tmp_path / "first.log", SERVER_ARGS) as server:
        expected = greedy_answers(server.base_url, model)
        shutil.rmtree(heads_copy)
        assert greedy_answers(server.base_url, model) == expected
        heads_copy.mkdir()
        (heads_copy / "config.json").write_text("{ not json")
        assert greedy_answers(server.base_url, model) == expected
        assert server.healthy()
    with pytest.raises(ServerError) as failure:
        start_server("mtpspec", model, str(heads_copy), tmp_path / "restart.log", SERVER_ARGS, ready_timeout=300)
    assert f"{heads_copy}/config.json is not valid JSON" in str(failure.value)
