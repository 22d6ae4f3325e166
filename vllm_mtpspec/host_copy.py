"""Host tensors onto the drafting device without making the host wait."""
from __future__ import annotations

import torch


def to_device_without_waiting(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`. To a GPU through a pinned copy, which goes with the stream:
    the host does not wait for the device. On the CPU it is the tensor itself."""
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
