"""What the platform vLLM runs on changes about drafting."""
from __future__ import annotations


def platform_blocker() -> str | None:
    """Why this platform cannot verify trees at all (None when it can)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return ("tree attention is built for vLLM's CPU backend only so far: on this platform every "
                "request is verified as a chain")
    return None


def default_backoff_start() -> int:
    """Batch size past which drafts shrink: verification is costly on CPUs from the start."""
    from vllm.platforms import current_platform

    return 4 if current_platform.is_cpu() else 16
