"""MTPHeads: k small heads that read the target's final hidden state h_t.

Head i (0-based) guesses token x_{t+i+2}: the target's own LM head on h_t gives x_{t+1},
so head 0 looks one token further. Each head is a residual block

    z_i = h + SiLU(W_i u + b_i),   u = h            (head_input="hidden", Medusa)
                                   u = [h; s * e]   (head_input="hidden+token")

where e is the target's input embedding of x_{t+1} (known when drafting) and s puts it on
h's scale. All heads read the same u, so every W_i is one row block of a single
[k * d, in] matrix: all heads run in one matmul. z_i then goes through a vocab
projection: the target's own LM head (tied: one call over all k heads) or the head's
own d x |V| matrix (untied, initialised from the LM head as Medusa does).

W is zero-initialised, so an untrained head starts as the target's LM head on h.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mtpspec.config import HeadsConfig
from vllm_mtpspec.quant import Int2Linear, empty_int2_linear

LMHead = Callable[[torch.Tensor], torch.Tensor]  # [n, d] -> [n, V]


class MTPHeads(nn.Module):
    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        self.config = config
        k, d, vocab = config.num_heads, config.hidden_size, config.vocab_size
        in_dim = 2 * d if config.token_conditioned else d
        quant = config.quantization
        if quant is None:
            self.block = nn.Linear(in_dim, k * d)
            nn.init.zeros_(self.block.weight)
            nn.init.zeros_(self.block.bias)
        else:
            self.block = empty_int2_linear(in_dim, k * d, group_size=quant.group_size, bias=True)
        self.proj: nn.ModuleList | None = None
        if not config.tied:
            if quant is None:
                self.proj = nn.ModuleList(nn.Linear(d, vocab, bias=False) for _ in range(k))
            else:
                self.proj = nn.ModuleList(
                    empty_int2_linear(d, vocab, group_size=quant.group_size, bias=False) for _ in range(k)
                )
        self.register_buffer("temperatures", torch.tensor(config.temperatures, dtype=torch.float32), persistent=False)

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def is_quantized(self) -> bool:
        return isinstance(self.block, Int2Linear)

    def init_projections_from(self, lm_head_weight: torch.Tensor) -> None:
        """Untied heads start as copies of the target's LM head (Medusa's initialisation)."""
        if self.proj is None:
            return
        with torch.no_grad():
            for proj in self.proj:
                proj.weight.copy_(lm_head_weight)

    def hidden(self, h: torch.Tensor, token_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """[..., d] (and [..., d] embeddings of x_{t+1}) -> the heads' states [..., k, d]."""
        if self.config.token_conditioned:
            if token_embeds is None:
                raise ValueError("these heads are token-conditioned: pass the embeddings of the sampled tokens")
            u = torch.cat([h, token_embeds.to(h.dtype) * self.config.embed_scale], dim=-1)
        else:
            u = h
        delta = F.silu(self.block(u.to(self._param_dtype())).to(h.dtype))
        k, d = self.config.num_heads, self.config.hidden_size
        return h.unsqueeze(-2) + delta.view(*h.shape[:-1], k, d)

    def project(self, head_hidden: torch.Tensor, lm_head: LMHead | None = None) -> torch.Tensor:
        """[..., k, d] -> logits [..., k, V]: one LM-head call for tied heads.

        k may be fewer than the heads loaded (a shallower draft): the first k heads project.
        """
        lead = head_hidden.shape[:-2]
        k, d = head_hidden.shape[-2:]
        if self.proj is None:
            if lm_head is None:
                raise ValueError("tied heads need the target's LM head (pass lm_head=...)")
            logits = lm_head(head_hidden.reshape(-1, d))
            return logits.view(*lead, k, logits.shape[-1])
        flat = head_hidden.reshape(-1, k, d).to(self._param_dtype())
        if self.is_quantized:
            per_head = [proj(flat[:, i]) for i, proj in enumerate(self.proj[:k])]
            logits = torch.stack(per_head, dim=1)
        else:  # one batched matmul over all heads
            weight = torch.stack([proj.weight for proj in self.proj[:k]])  # [k, V, d]
            logits = torch.einsum("nkd,kvd->nkv", flat, weight)
        return logits.view(*lead, k, logits.shape[-1])

    def forward(
        self,
        h: torch.Tensor,
        *,
        token_embeds: torch.Tensor | None = None,
        lm_head: LMHead | None = None,
    ) -> torch.Tensor:
        """Head logits [..., k, V] (raw: divide by `temperatures` for calibrated probabilities)."""
        return self.project(self.hidden(h, token_embeds), lm_head)

    def _param_dtype(self) -> torch.dtype:
        if self.is_quantized:
            return self.block.bias.dtype
        return self.block.weight.dtype

    def num_parameters(self) -> int:
        return sum(t.numel() for t in self.state_dict().values())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_dict().values())

    def quantized(self, *, group_size: int = 64) -> "MTPHeads":
        """A 2-bit copy of these heads (block and own projections; biases stay in fp32)."""
        if self.is_quantized:
            raise ValueError("these heads are already quantized")
        from vllm_mtpspec.config import QuantConfig

        config = HeadsConfig.from_dict({**self.config.to_dict(), "quantization": None})
        config.quantization = QuantConfig(bits=2, group_size=group_size)
        out = MTPHeads.__new__(MTPHeads)
        nn.Module.__init__(out)
        out.config = config
        out.block = Int2Linear.from_linear(self.block.float(), group_size=group_size)
        out.proj = None
        if self.proj is not None:
            out.proj = nn.ModuleList(Int2Linear.from_linear(p.float(), group_size=group_size) for p in self.proj)
        out.register_buffer("temperatures", self.temperatures.clone(), persistent=False)
        return out
