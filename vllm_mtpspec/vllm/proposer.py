"""MTPSpecProposer: the proposer vLLM builds for `method="custom_class"`.

vLLM calls load_model(target) once and propose(...) after every step. The hidden states
that produced each request's last sampled token arrive through capture_step, called by
the patched runner just before propose (hooks.py). Drafts are chains: the top-1 token of
each head, cut where the heads' own confidence falls below `min_path_prob` (adaptive
depth per request) and shortened for large batches, where verifying extra tokens stops
being free (adaptive depth per batch). vLLM's rejection sampler verifies them.
"""
from __future__ import annotations

import logging
import math

import torch

from vllm_mtpspec.checkpoint import load_heads
from vllm_mtpspec.vllm.options import check_against_model, options_from_additional_config
from vllm_mtpspec.vllm.rows import last_sampled_rows
from vllm_mtpspec.vllm.version import require_supported_vllm

logger = logging.getLogger("vllm_mtpspec")


class MTPSpecProposer:
    def __init__(self, vllm_config) -> None:
        require_supported_vllm()
        self.options = options_from_additional_config(vllm_config.additional_config)
        model_config = vllm_config.model_config
        self.num_speculative_tokens = vllm_config.speculative_config.num_speculative_tokens
        hf_config = model_config.hf_text_config
        self.heads_config = check_against_model(
            self.options,
            num_speculative_tokens=self.num_speculative_tokens,
            model_path=model_config.model,
            hidden_size=hf_config.hidden_size,
            vocab_size=hf_config.vocab_size,
        )
        self.dtype = model_config.dtype
        self.device = torch.device(vllm_config.device_config.device)
        self.heads = None  # loaded with the target, in load_model
        # Set by the runner hook each step, consumed by propose.
        self._sample_hidden_states: torch.Tensor | None = None
        self._num_draft_tokens: list[int] | None = None

    def load_model(self, target_model) -> None:
        self.heads = load_heads(self.options.heads, device=self.device, dtype=self.dtype)
        self._temperatures = self.heads.temperatures.to(self.device)
        # Through the target's modules, never its weights: on the CPU they are repacked.
        self._lm_head = target_model.compute_logits
        self._embed = getattr(target_model, "embed_input_ids", None) or target_model.get_input_embeddings
        logger.info("mtpspec: loaded %s heads (%s, %s) from %s", self.heads.num_heads,
                    "tied" if self.heads.config.tied else "untied",
                    "int2" if self.heads.is_quantized else str(self.dtype), self.options.heads)

    def capture_step(self, sample_hidden_states: torch.Tensor, spec_decode_metadata, req_ids=None) -> None:
        self._sample_hidden_states = sample_hidden_states
        self._num_draft_tokens = None if spec_decode_metadata is None else list(spec_decode_metadata.num_draft_tokens)

    def depth_for_batch(self, num_requests: int) -> int:
        """One draft token fewer per doubling of the batch past batch_backoff_start."""
        depth = self.num_speculative_tokens
        start = self.options.batch_backoff_start
        if num_requests > start:
            depth -= math.ceil(math.log2(num_requests / start))
        return max(depth, 0)

    @torch.inference_mode()
    def propose(self, sampled_token_ids, num_tokens_no_spec=None, token_ids_cpu=None, slot_mappings=None, **_) -> list[list[int]]:
        hidden_all = self._sample_hidden_states
        self._sample_hidden_states = None
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        depth = self.depth_for_batch(len(sampled_token_ids))
        if hidden_all is None or depth == 0:
            return drafts
        pairs = last_sampled_rows(sampled_token_ids, self._num_draft_tokens, hidden_all.shape[0])
        owners = [i for i, _ in pairs]
        rows = [row for _, row in pairs]
        last_tokens = [sampled_token_ids[i][-1] for i in owners]
        if not rows:
            return drafts
        hidden = hidden_all[torch.tensor(rows, device=hidden_all.device)]
        token_ids = torch.tensor(last_tokens, device=hidden.device)
        embeds = self._embed(token_ids) if self.heads.config.token_conditioned else None
        head_hidden = self.heads.hidden(hidden, embeds)[:, :depth]          # [B, depth, d]
        logits = self.heads.project(head_hidden, self._lm_head).float()     # [B, depth, V]
        probs = torch.softmax(logits / self._temperatures[:depth, None], dim=-1)
        top_p, top_ids = probs.max(dim=-1)                                   # [B, depth]
        path_p = torch.cumprod(top_p, dim=-1)
        keep = (path_p >= self.options.min_path_prob).sum(dim=-1).tolist()   # a prefix stays
        top_ids = top_ids.tolist()
        for j, i in enumerate(owners):
            drafts[i] = top_ids[j][: keep[j]]
        return drafts
