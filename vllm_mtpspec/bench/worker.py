"""One vLLM engine per method, in its own process, kept alive for the whole benchmark so
that methods can take turns on the same prompts (this machine is shared and noisy: runs
side by side, alternating, compare better than runs one after another).

The parent talks to a worker over a pipe: it sends prompts, the worker answers with the
tokens, the wall time of generating them (llm.generate's loop, counting the steps that
emitted tokens), and the deltas of vLLM's spec-decode counters and of the time spent
drafting. The worker's own output (vLLM's logs) goes to a log file.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass

from vllm_mtpspec.prompts import Prompt


@dataclass
class Batch:
    prompts: list[Prompt]  # the worker applies the chat template over each one's history
    temperature: float
    max_tokens: int
    ignore_eos: bool = True  # every method decodes the same number of tokens


def _counters(llm) -> dict:
    from vllm_mtpspec.vllm.hooks import draft_time

    found = {"draft_seconds": draft_time.seconds}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            found[metric.name.removeprefix("vllm:spec_decode_")] = getattr(metric, "values", None) or metric.value
    return found


def _delta(after: dict, before: dict) -> dict:
    out = {}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(value, list):
            old = old or [0] * len(value)
            out[key] = [a - b for a, b in zip(value, old)]
        else:
            out[key] = value - (old or 0)
    return out


def generate_counting_steps(llm, prompts: list, params) -> tuple[list[list[int]], int]:
    """llm.generate's loop (vLLM's _run_engine: add every request, step the engine until
    none is left) through the engine's public add_request and step, each request's output
    streamed: (every request's tokens, in prompt order; the steps that emitted any of
    them). Each such step emitted one token of the target's own and the rest were accepted
    drafts, so tokens - steps counts the drafts accepted up to each request's stop. vLLM's
    num_accepted_tokens also counts drafts accepted past a stop (end of sequence or
    max_tokens), which the output then drops; a method whose drafts run past the stop
    would gain from it."""
    from vllm.sampling_params import RequestOutputKind

    params = params.clone()
    params.output_kind = RequestOutputKind.DELTA
    engine = llm.llm_engine
    ids = [f"bench-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            new = output.outputs[0].token_ids if output.outputs else []
            if new:
                tokens[output.request_id].extend(new)
                steps += 1
    return [tokens[request_id] for request_id in ids], steps


class PausedBetweenTurns:
    """Stops a worker's whole process group while other engines are timed. An idle vLLM
    engine still spends about a fifth of a core (its threads keep polling); with seven
    engines on two cores that is more than a core taken from the engine being measured.
    A stopped process spends nothing, so a 7-engine run times what a 2-engine run does."""

    def __init__(self, pid: int) -> None:
        self.pid = pid  # the worker leads its own process group (_serve calls os.setpgrp)
        self.paused = False

    def pause(self) -> None:
        if not self.paused:
            os.killpg(self.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            os.killpg(self.pid, signal.SIGCONT)
            self.paused = False


def _serve(conn, model: str, engine: dict, speculative_config: dict | None, log_path: str) -> None:
    os.setpgrp()  # a group of its own, which the parent pauses whole between its turns
    log = open(log_path, "a", buffering=1)
    os.dup2(log.fileno(), sys.stdout.fileno())
    os.dup2(log.fileno(), sys.stderr.fileno())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        from vllm import LLM, SamplingParams

        from vllm_mtpspec.prompts import prompt_ids

        llm = LLM(model, **engine, **({"speculative_config": speculative_config} if speculative_config else {}))
        tokenizer = llm.get_tokenizer()
        conn.send({"ready": True})
    except Exception as err:  # reported to the parent, which names the method
        conn.send({"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()})
        return
    while True:
        batch = conn.recv()
        if batch is None:
            return
        try:
            texts = [{"prompt_token_ids": prompt_ids(tokenizer, p.text, p.history)} for p in batch.prompts]
            params = SamplingParams(temperature=batch.temperature, max_tokens=batch.max_tokens,
                                    ignore_eos=batch.ignore_eos)
            before = _counters(llm)
            started = time.perf_counter()
            token_ids, emitting_steps = generate_counting_steps(llm, texts, params)
            seconds = time.perf_counter() - started
            counters = _delta(_counters(llm), before)
            counters["emitting_steps"] = emitting_steps
            conn.send({"token_ids": token_ids, "seconds": seconds, "counters": counters})
        except Exception as err:
            conn.send({"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()})


class EngineWorker:
    def __init__(self, name: str, model: str, engine: dict, speculative_config: dict | None, log_path: str) -> None:
        self.name = name
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, model, engine, speculative_config, log_path),
                                        daemon=True)
        self._process.start()
        self._turns = PausedBetweenTurns(self._process.pid)
        self.log_path = log_path

    def wait_ready(self) -> str | None:
        """None when the engine is up (and paused until its first batch), else the error
        that stopped it."""
        reply = self._receive()
        if reply.get("ready"):
            self._turns.pause()
            return None
        return reply["error"]

    def generate(self, batch: Batch) -> dict:
        self._turns.resume()
        try:
            self._conn.send(batch)
            reply = self._receive()
        finally:
            if self._process.is_alive():
                self._turns.pause()
        if "error" in reply:
            raise RuntimeError(f"{self.name}: {reply['error']} (log: {self.log_path})")
        return reply

    def _receive(self) -> dict:
        while not self._conn.poll(5):
            if not self._process.is_alive():
                return {"error": f"the engine process exited (code {self._process.exitcode}); see {self.log_path}"}
        return self._conn.recv()

    def close(self) -> None:
        if self._process.is_alive():
            self._turns.resume()
        try:
            self._conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
