"""Which requests the tree path cannot serve exactly, and why.

vLLM applies penalties, bad words, logit bias, allowed tokens, min_tokens and grammars to
its draft positions assuming a chain (each draft's context is the drafts before it), and
reports logprobs per chain position. A tree node's context is its ancestors instead, so
such requests get a chain: vLLM verifies it with its own rejection sampler, exactly.
"""
from __future__ import annotations

from vllm_mtpspec.vllm.logs import logger

_logged: set[str] = set()


def tree_blocker(sampling_params) -> str | None:
    """The first reason this request must be verified as a chain, or None."""
    if sampling_params is None:
        return "no sampling parameters"
    p = sampling_params
    checks = (
        ("logprobs", getattr(p, "logprobs", None) is not None),
        ("penalties", getattr(p, "presence_penalty", 0.0) != 0.0 or getattr(p, "frequency_penalty", 0.0) != 0.0
         or getattr(p, "repetition_penalty", 1.0) != 1.0),
        ("bad_words", bool(getattr(p, "bad_words", None))),
        ("logit_bias", bool(getattr(p, "logit_bias", None))),
        ("allowed_token_ids", bool(getattr(p, "allowed_token_ids", None))),
        ("min_tokens", getattr(p, "min_tokens", 0) > 0),
        ("min_p", getattr(p, "min_p", 0.0) > 0.0),
        ("structured output", getattr(p, "structured_outputs", None) is not None),
        ("logits processors", bool(getattr(p, "logits_processors", None))),
    )
    return next((reason for reason, applies in checks if applies), None)


def log_fallback_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        logger.info("mtpspec: requests with %s are verified as a chain, not a tree", reason)

