"""HiddenStateRecorder: a vLLM `custom_class` proposer that drafts nothing and keeps the
final hidden state behind every sampled token, so that generating self-distillation data
also yields the heads' inputs without a second forward pass over the data."""
from __future__ import annotations

from collections import defaultdict

import torch

from vllm_mtpspec.vllm.rows import last_sampled_rows

RECORDER_PATH = "training.recorder.HiddenStateRecorder"


class HiddenStateRecorder:
    def __init__(self, vllm_config) -> None:
        self.records: dict[str, list[torch.Tensor]] = defaultdict(list)
        self._step = None

    def load_model(self, target_model) -> None:
        pass

    def capture_step(self, sample_hidden_states, spec_decode_metadata, req_ids=None, **_) -> None:
        num_drafts = None if spec_decode_metadata is None else list(spec_decode_metadata.num_draft_tokens)
        self._step = (sample_hidden_states, num_drafts, req_ids)

    def propose(self, sampled_token_ids, *args, **kwargs) -> list[list[int]]:
        hidden, num_drafts, req_ids = self._step
        self._step = None
        for i, row in last_sampled_rows(sampled_token_ids, num_drafts, hidden.shape[0]):
            self.records[req_ids[i]].append(hidden[row].to(torch.float16).cpu())
        return [[] for _ in sampled_token_ids]

    def pop(self, request_ids: list[str]) -> dict[str, torch.Tensor]:
        """[num_tokens, d] per request (by the id LLM.generate reports), in generation
        order, forgotten afterwards. The engine's own ids carry a random suffix."""
        wanted = set(request_ids)
        out = {}
        for internal in list(self.records):
            external = internal.rsplit("-", 1)[0]
            if external in wanted:
                out[external] = torch.stack(self.records.pop(internal))
        return out


def pop_recorded(worker, req_ids):
    """For LLM.collective_rpc: runs in the worker that owns the recorder."""
    return worker.model_runner.drafter.pop(req_ids)
