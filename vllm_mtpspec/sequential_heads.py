"""SequentialHeads: MTP heads where each depth reads the depth before it and its guess.

Parallel heads (heads.py) all read h_t and x_{t+1}, so head 3 must guess x_{t+4} blind
to what heads 1 and 2 guessed for x_{t+2} and x_{t+3}. A sequential head i reads the
state of depth i - 1 and the token drafted from it (Hydra; the recurrence of EAGLE and
DeepSeek-V3's MTP module):

    z_0 = h
    z_i = z_{i-1} + D_i SiLU(W_i [z_{i-1}; s * e(y_i)] + b_i)     (without a hidden layer:
                                                                  z_{i-1} + SiLU(W_i u_i + b_i))

where y_1 = x_{t+1} (the token sampled from h) and y_i (i > 1) is depth i - 1's top-1
draft; z_i's LM-head logits guess x_{t+i+1}. Head 1 is exactly a parallel head 1. Each
depth has its own W_i (`blocks`), since the depths' inputs differ; the weights have the
parallel heads' shapes otherwise, so parallel heads can seed them (`from_parallel`).

Training feeds the answer's own tokens as the y_i (a chain that is still right, which is
the only case where depth i's draft is kept), so a depth learns on the states the depth
before it really produces. Drafting runs depth by depth: one LM-head projection per depth,
each top-1 read back through the target's embedding. A tree's other candidates each need
their own deeper states: dynamic trees are grown depth by depth from `draft_step`
(grown_tree.py), fixed-shape trees do not apply.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mtpspec.grown_tree import DraftStep
from vllm_mtpspec.heads import LMHead, MTPHeads

Embed = Callable[[torch.Tensor], torch.Tensor]  # token ids [n] -> embeddings [n, d]


class SequentialHeads(MTPHeads):
    def _build_input_layers(self, linear, in_dim: int, width: int) -> None:
        self.blocks = nn.ModuleList(linear(in_dim, width, bias=True) for _ in range(self.config.num_heads))

    def input_layers(self) -> list[nn.Module]:
        return list(self.blocks)

    def step(self, depth: int, state: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """Depth `depth` (0-based): the state [..., d] of the depth before and the embeddings
        [..., d] of the token drafted from it -> this depth's state [..., d]."""
        u = torch.cat([state, token_embeds.to(state.dtype) * self.config.embed_scale], dim=-1)
        pre = self.blocks[depth](u.to(self._param_dtype()))
        if self.down is None:
            return state + F.silu(pre.to(state.dtype))
        return state + self.down[depth](F.silu(pre)).to(state.dtype)

    def hidden(self, h: torch.Tensor, token_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced states [..., j, d] of the first j depths: h [..., d] and the
        embeddings [..., j, d] of y_1..y_j (the sampled token, then each depth's token
        along a chain that is right)."""
        if token_embeds is None or token_embeds.dim() != h.dim() + 1:
            raise ValueError("sequential heads read the token before each depth: pass token_embeds [..., depths, d] "
                             "(the sampled token, then the chain's tokens), or draft with draft_logits")
        states, state = [], h
        for depth in range(token_embeds.shape[-2]):
            state = self.step(depth, state, token_embeds[..., depth, :])
            states.append(state)
        return torch.stack(states, dim=-2)

    def draft_logits(self, h: torch.Tensor, root_embeds: torch.Tensor | None, depth: int, lm_head: LMHead,
                     embed: Embed | None = None, draft_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, depth, N] along each row's own top-1 chain: depth i reads depth i - 1's
        state and the embedding of its top-1 token (draft_ids maps a draft-vocabulary
        entry back to the target's id before it is embedded)."""
        if root_embeds is None or embed is None:
            raise ValueError("sequential heads draft from the sampled token's embedding and embed each draft: "
                             "pass root_embeds and embed")
        logits, state, token_embeds = [], h, root_embeds
        for i in range(depth):
            state = self.step(i, state, token_embeds)
            logits.append(self.project(state.unsqueeze(-2), lm_head)[..., 0, :])
            if i + 1 < depth:
                top1 = logits[-1].argmax(-1)
                token_embeds = embed(top1 if draft_ids is None else draft_ids[top1])
        return torch.stack(logits, dim=1)

    def draft_step(self, lm_head: LMHead, embed: Embed, temperatures: torch.Tensor) -> "DraftStep":
        """The step a grown tree takes per depth (grown_tree.py): the states [n, d] of nodes
        at depth i and their tokens [n] (target ids) -> depth i's states and the
        temperature-scaled probabilities [n, N] of the token after each node."""
        def step(i: int, states: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            states = self.step(i, states, embed(tokens))
            logits = self.project(states.unsqueeze(-2), lm_head)[..., 0, :]
            return states, torch.softmax(logits.float() / temperatures[i], dim=-1)

        return step

    @classmethod
    def from_parallel(cls, parallel: MTPHeads) -> "SequentialHeads":
        """Sequential heads seeded with every depth a copy of a parallel head 1: head 1 maps
        (the state that guessed y, y) to the state that guesses the token after, which is
        each depth's job here. Training then specialises the depths."""
        from vllm_mtpspec.config import HeadsConfig

        if type(parallel) is not MTPHeads or parallel.is_quantized or parallel.proj is not None:
            raise ValueError("seed sequential heads from full-precision, tied parallel heads")
        first_temperature = float(parallel.temperatures[0])
        config = HeadsConfig.from_dict({**parallel.config.to_dict(), "head_kind": "sequential", "rank_accuracy": None,
                                        "temperatures": [first_temperature] * parallel.num_heads})
        out = cls(config)
        width = config.mlp_size or config.hidden_size
        first_weight, first_bias = parallel.block.weight[:width], parallel.block.bias[:width]
        with torch.no_grad():
            for i, block in enumerate(out.blocks):
                block.weight.copy_(first_weight)
                block.bias.copy_(first_bias)
                if out.down is not None:
                    out.down[i].weight.copy_(parallel.down[0].weight)
            if parallel.draft_vocab is not None:
                out.draft_token_ids.copy_(parallel.draft_vocab)
        return out.to(parallel.block.weight.dtype)


def chain_tokens(tokens: torch.Tensor, depth: int) -> torch.Tensor:
    """tokens [n] along one answer -> [n, depth]: row r's y_1..y_depth, the answer's tokens
    r..r + depth - 1 (the chain that is right); past the end the last token stands in, at
    rows whose deeper targets are past the end too, so no score or loss reads them."""
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    index = (rows[:, None] + torch.arange(depth, device=tokens.device)).clamp_max(tokens.shape[0] - 1)
    return tokens[index]


def example_chain_tokens(token: torch.Tensor, targets: torch.Tensor, depth: int) -> torch.Tensor:
    """Training rows' y_1..y_depth [n, depth]: the row's token, then its targets (the
    answer's next tokens); a target past the answer's end (-1) repeats the token before it,
    where every deeper target is past the end too."""
    columns = [token.long()]
    for i in range(depth - 1):
        target = targets[:, i].long()
        columns.append(torch.where(target >= 0, target, columns[-1]))
    return torch.stack(columns, dim=1)
