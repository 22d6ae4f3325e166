"""An EAGLE-3 draft layer: what vLLM's `Eagle3LlamaForCausalLM` computes, behind the
draft block's cache, chains and dynamic trees (draft_block.py).

Notation as in draft_block.py: at position p the layer reads the target's states entering
its feature layers (a1_p .. an_p, vLLM's aux_hidden_states) and the token s_{p+1} they led
to. With e = input_layernorm(emb(s_{p+1})):

    h   = fc([a1_p; ...; an_p])                  (depth 1: the target's own positions)
    h   = the previous depth's output            (depth j > 1, before the final norm)
    r   = hidden_norm(h) if norm_before_residual else h
    r'  = r + o_proj(attention(q, k, v from [e; hidden_norm(h)]))
    g   = r' + mlp(post_attention_layernorm(r'))
    logits = lm_head(norm(g))

which is vLLM's llama_eagle3.py (0.32 and 0.33): the first layer's q/k/v read the token
embedding and the hidden state side by side (2d inputs), the residual stream carries the
hidden state alone, and the state fed back for the next depth is the pre-norm output
(`aux_output` with norm_output false). Unlike the mtpspec block it does not read the final
state, and its LM head is its own (over a draft vocabulary mapped to target ids by d2t),
unless it is tied to the target's rows.

The residual stream handed between the block's pieces (`fused_inputs` -> `_qkv` ->
`_finish`) is [r | e | hidden_norm(h)] ([..., 3d]): the residual, then what q/k/v read.
Everything else (the cache of context entries, the chain's own entries, the window, tree
paths) is the block's.
"""
from __future__ import annotations

import torch
from torch import nn

from vllm_mtpspec.config import HeadsConfig
from vllm_mtpspec.draft_block import DraftBlock, RMSNorm, _DraftingForm, _in_dtype, _side_by_side
from vllm_mtpspec.heads import DraftModule


class Eagle3Layer(DraftBlock):
    def __init__(self, config: HeadsConfig) -> None:
        DraftModule.__init__(self, config)
        block = config.block
        d, eps = config.hidden_size, block.rms_norm_eps
        self.block_config = block
        linear = lambda n_in, n_out: self._new_linear(n_in, n_out, bias=False)  # noqa: E731
        self.fc = linear(len(block.feature_layers) * d, d)
        self.input_layernorm = RMSNorm(d, eps)
        self.hidden_norm = RMSNorm(d, eps)
        self.q_proj = linear(2 * d, block.attention_heads * block.head_dim)
        self.k_proj = linear(2 * d, block.kv_heads * block.head_dim)
        self.v_proj = linear(2 * d, block.kv_heads * block.head_dim)
        self.o_proj = linear(block.attention_heads * block.head_dim, d)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.gate_proj = linear(d, block.mlp_size)
        self.up_proj = linear(d, block.mlp_size)
        self.down_proj = linear(block.mlp_size, d)
        self.norm = RMSNorm(d, eps)
        # Untied: its own LM head over its draft vocabulary's rows (the whole vocabulary without one).
        self.lm_head = None if config.tied else linear(d, config.draft_vocab_size or config.vocab_size)
        if self.is_quantized:
            return
        for matrix in (self.fc, self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj, self.up_proj,
                       self.down_proj):
            nn.init.normal_(matrix.weight, std=0.02)

    @property
    def final_norm(self) -> RMSNorm:
        return self.norm

    def fused_inputs(self, features: torch.Tensor, token_embeds: torch.Tensor,
                     layer_features: torch.Tensor | None = None) -> torch.Tensor:
        """[r | e | hidden_norm(h)] [..., 3d]: h from the target's layer states where given
        (layer_features [..., n, d]), else the previous depth's output (features [..., d])."""
        dtype = self.dtype
        if layer_features is not None:
            hidden = self.fc(_in_dtype(layer_features, dtype).flatten(-2))
        else:
            hidden = _in_dtype(features, dtype)
        normed = self.hidden_norm(hidden)
        residual = normed if self.block_config.norm_before_residual else hidden
        return torch.cat([residual, self.input_layernorm(_in_dtype(token_embeds, dtype)), normed], -1)

    def attention_input(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., self.config.hidden_size:]

    def _finish(self, x: torch.Tensor, attended: torch.Tensor, gate_up: nn.Module | None = None) -> torch.Tensor:
        """The pre-norm output g [B, T, d]: what the next depth reads, and what `logits` normalizes."""
        b, _, t, _ = attended.shape
        residual = x[..., :self.config.hidden_size] + self.o_proj(attended.transpose(1, 2).reshape(b, t, -1))
        return residual + self._mlp(self.post_attention_layernorm(residual), gate_up)

    def projection_input(self, g: torch.Tensor) -> torch.Tensor:
        """The pre-norm output g normalized: what an LM head reads (training and scoring
        project it through the target's, as a tied layer drafts)."""
        return self.norm(g)

    def logits(self, g: torch.Tensor, project) -> torch.Tensor:
        """Logits over the draft vocabulary (its own LM head), or through project (the
        target's rows) where tied."""
        normed = self.projection_input(g)
        return project(normed) if self.lm_head is None else self.lm_head(normed)

    def prepare_drafting(self, drafted_token_embeds: torch.Tensor | None = None) -> None:
        """q/k/v as one product and gate/up as another (see DraftBlock.prepare_drafting).
        No token table: a drafted token's embedding is normalized at each depth."""
        self._drafting = _DraftingForm(
            qkv=_side_by_side([self.q_proj, self.k_proj, self.v_proj], self.dtype),
            gate_up=_side_by_side([self.gate_proj, self.up_proj], self.dtype),
            feature_fuse=None, token_inputs=None)

    def with_draft_vocab(self, draft_token_ids: torch.Tensor | None) -> DraftModule:
        if self.lm_head is not None:
            raise ValueError("an EAGLE-3 layer with its own LM head drafts among that head's rows (its d2t): its "
                             "draft vocabulary cannot change")
        return super().with_draft_vocab(draft_token_ids)
