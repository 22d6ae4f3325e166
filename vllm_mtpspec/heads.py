"""MTPHeads: k small heads that read the target's final hidden state h_t.

Head i (0-based) guesses token x_{t+i+2}: the target's own LM head on h_t gives x_{t+1},
so head 0 looks one token further. Each head is a residual block

    z_i = h + SiLU(W_i u + b_i)            (mlp_size=0: Medusa's single layer)
    z_i = h + D_i SiLU(W_i u + b_i)        (mlp_size=m: a hidden layer of width m)

    u = h            (head_input="hidden", Medusa)
    u = [h; s * e]   (head_input="hidden+token")

where e is the target's input embedding of x_{t+1} (known when drafting) and s puts it on
h's scale. All heads read the same u, so every W_i is one row block of a single
[k * m, in] matrix: all heads run in one matmul (then each D_i [d, m] on its own slice).
z_i then goes through a vocab projection: the target's own LM head
(tied: one call over all k heads) or the head's own d x |V| matrix (untied, initialised
from the LM head as Medusa does).

The last matrix of each head (W without a hidden layer, D with one) starts at zero, so an
untrained head starts as the target's LM head on h.

With a draft vocabulary (draft_vocab.py) tied heads project onto the LM head's rows of
its N tokens only; their logits are over those N entries, in the order of
`draft_token_ids`, until `target_vocab_logits` or the proposer maps them back.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mtpspec.config import HeadsConfig
from vllm_mtpspec.draft_vocab import SlicedLMHead, to_target_vocab
from vllm_mtpspec.quant import Int2Linear, empty_int2_linear

LMHead = Callable[[torch.Tensor], torch.Tensor]  # [n, d] -> [n, V]


class DraftModule(nn.Module):
    """What every head kind shares: its config, per-depth temperatures and the optional
    draft vocabulary (the target ids of the N tokens it drafts among)."""

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("temperatures", torch.tensor(config.temperatures, dtype=torch.float32), persistent=False)
        if config.draft_vocab_size:
            self.register_buffer("draft_token_ids", torch.zeros(config.draft_vocab_size, dtype=torch.int64))

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def feature_layers(self) -> list[int]:
        """HeadsConfig.feature_layers."""
        return self.config.feature_layers

    @property
    def draft_vocab(self) -> torch.Tensor | None:
        """The target ids of the draft vocabulary's entries (None: the whole vocabulary)."""
        return getattr(self, "draft_token_ids", None)

    def lm_head_for(self, lm_head_weight: torch.Tensor) -> LMHead:
        """The projection tied heads use, from the target's [V, d] LM-head weight: all of
        it, or the draft vocabulary's rows."""
        if self.draft_vocab is None:
            return lambda x: x @ lm_head_weight.T
        return SlicedLMHead(lm_head_weight[self.draft_vocab.to(lm_head_weight.device)])

    def target_vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., k, N] logits over the heads' vocabulary -> [..., k, V] over the target's."""
        return to_target_vocab(logits, self.draft_vocab, self.config.vocab_size)

    def with_draft_vocab(self, draft_token_ids: torch.Tensor | None) -> "DraftModule":
        """A copy of these (tied) heads that drafts among draft_token_ids only (None: over the
        whole vocabulary; a draft vocabulary selects LM-head rows and changes no weight)."""
        size = 0 if draft_token_ids is None else len(draft_token_ids)
        config = HeadsConfig.from_dict({**self.config.to_dict(), "draft_vocab_size": size})
        out = type(self)(config)
        state = {k: v for k, v in self.state_dict().items() if k != "draft_token_ids"}
        if draft_token_ids is not None:
            state["draft_token_ids"] = draft_token_ids.to(torch.int64)
        # assign: the copy keeps these heads' tensors and their dtypes (fp16 storage, INT2 codes).
        out.load_state_dict(state, assign=True)
        out.temperatures = self.temperatures  # not in the state dict: keep it on these heads' device
        return out.train(self.training)

    def _new_linear(self, n_in: int, n_out: int, *, bias: bool) -> nn.Module:
        """A matrix of these heads: full precision, or (config.quantization) an empty
        Int2Linear of the right shapes for load_state_dict or `quantized` to fill."""
        quant = self.config.quantization
        if quant is None:
            return nn.Linear(n_in, n_out, bias=bias)
        return empty_int2_linear(n_in, n_out, group_size=quant.group_size, bias=bias)

    @property
    def is_quantized(self) -> bool:
        return self.config.quantization is not None

    def quantized(self, *, group_size: int = 64, int2=None, method: str = "rtn",
                  calibration: str | None = None) -> "DraftModule":
        """A 2-bit copy of these heads: every matrix (biases, norms and the draft
        vocabulary stay as they are). int2: how each nn.Linear becomes an Int2Weight
        (default round-to-nearest; heads_quant.py has the calibrated methods), recorded in
        the config as `method` and `calibration`."""
        if self.is_quantized:
            raise ValueError("these heads are already quantized")
        from vllm_mtpspec.config import QuantConfig

        config = HeadsConfig.from_dict({**self.config.to_dict(), "quantization": None})
        config.quantization = QuantConfig(bits=2, group_size=group_size, method=method, calibration=calibration)
        out = type(self)(config)  # every matrix an empty Int2Linear, filled below

        def quantize(linear: nn.Linear) -> Int2Linear:
            if int2 is None:
                return Int2Linear.from_linear(linear.float(), group_size=group_size)
            bias = None if linear.bias is None else linear.bias.detach().float().clone()
            return Int2Linear(int2(linear), bias)

        linears = {name: m for name, m in self.named_modules() if isinstance(m, nn.Linear)}
        for name, linear in linears.items():
            parent, _, attribute = name.rpartition(".")
            setattr(out.get_submodule(parent), attribute, quantize(linear))
        # Everything else (a draft block's norms, the draft vocabulary) is copied as it is;
        # a matrix's own tensors (a parametrized one's too) went into its Int2Linear.
        rest = {key: t for key, t in self.state_dict().items()
                if not any(key.startswith(f"{name}.") for name in linears)}
        unexpected = out.load_state_dict(rest, strict=False).unexpected_keys
        assert not unexpected, unexpected
        out.temperatures = self.temperatures.clone()
        return out.train(self.training)

    def num_parameters(self) -> int:
        return sum(t.numel() for t in self.state_dict().values())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_dict().values())


class MTPHeads(DraftModule):
    def __init__(self, config: HeadsConfig) -> None:
        super().__init__(config)
        k, d, vocab = config.num_heads, config.hidden_size, config.vocab_size
        in_dim = 2 * d if config.token_conditioned else d
        width = config.mlp_size or d
        linear = self._new_linear
        self._build_input_layers(linear, in_dim, width)
        # With a hidden layer the down-projections start at zero (W keeps its random init,
        # or nothing would reach D's gradient); without one, W itself does.
        self.down: nn.ModuleList | None = None
        if config.mlp_size:
            self.down = nn.ModuleList(linear(width, d, bias=False) for _ in range(k))
        if not self.is_quantized:
            for last in self.last_layers():
                nn.init.zeros_(last.weight)
                if last.bias is not None:
                    nn.init.zeros_(last.bias)
        self.proj: nn.ModuleList | None = None
        if not config.tied:
            self.proj = nn.ModuleList(linear(d, vocab, bias=False) for _ in range(k))

    def _build_input_layers(self, linear, in_dim: int, width: int) -> None:
        """The matrices that read u: one [k * width, in] block, all heads in one matmul."""
        self.block = linear(in_dim, self.config.num_heads * width, bias=True)

    def input_layers(self) -> list[nn.Module]:
        """The matrices that read the heads' inputs."""
        return [self.block]

    def last_layers(self) -> list[nn.Module]:
        """The matrices whose output is each head's change to its input state: zero makes
        the head the LM head (the input layers without a hidden layer, the
        down-projections with one)."""
        return self.input_layers() if self.down is None else list(self.down)

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
        k, d = self.config.num_heads, self.config.hidden_size
        pre = self.block(u.to(self._param_dtype()))
        if self.down is None:
            delta = F.silu(pre.to(h.dtype))
        else:
            act = F.silu(pre).view(-1, k, self.config.mlp_size)
            delta = _per_head_linear(act, self.down).to(h.dtype)
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
        logits = _per_head_linear(flat, self.proj[:k])
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

    def draft_logits(self, h: torch.Tensor, root_embeds: torch.Tensor | None, depth: int, lm_head: LMHead,
                     embed: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     draft_ids: torch.Tensor | None = None) -> torch.Tensor:
        """What drafting reads: logits [B, depth, N] of the first `depth` heads from h [B, d]
        and the embeddings of the tokens h produced. Parallel heads ignore their own
        guesses, so `embed` and `draft_ids` (what sequential heads use to read them) are
        not needed here."""
        return self.project(self.hidden(h, root_embeds)[:, :depth], lm_head)

    def _param_dtype(self) -> torch.dtype:
        first = self.input_layers()[0]
        return first.bias.dtype if self.is_quantized else first.weight.dtype


def _per_head_linear(x: torch.Tensor, linears: nn.ModuleList) -> torch.Tensor:
    """x [n, k, in] -> [n, k, out]: head i's slice through linears[i].

    One call per head rather than one batched matmul: batching would first stack the k
    weight matrices, a copy of every weight on every draft step (450 MB for untied heads).
    """
    return torch.stack([linear(x[:, i]) for i, linear in enumerate(linears)], dim=1)
