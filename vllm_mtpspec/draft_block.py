"""An attention draft block: one transformer layer that sees the context (EAGLE,
DeepSeek-V3's MTP module), applied recursively for deeper drafts.

Notation: f_p is the target's final hidden state at position p, which produced token
s_{p+1}. The block's input at p fuses the two, u_p = W [norm(f_p); norm(emb(s_{p+1}))],
and one Llama decoder layer over u_0..u_p (causal attention, RoPE, SwiGLU) gives
g_p ~ f_{p+1}, whose LM-head logits guess s_{p+2}: the depth-1 draft.

Depth j > 1 feeds the block its own output and the token drafted from it:
u^j_p = W [norm(g^{j-1}_p); norm(emb(s_{p+j}))] at position p + j - 1. Its query sees the
context's entries u_0..u_p (all from the target's real states) and the entries of
depths 2..j of the same chain, never a draft of another chain. Training applies exactly
this mask to every position at once (`unrolled`, with the answer's own tokens as the
drafts of a chain that is still right); drafting caches the context's keys and values
per request (`BlockCache`): entries of accepted tokens only, so a rejected draft leaves
nothing behind (a chain's own entries are appended while it is drafted, then cut off).
A dynamic tree (`tree_step`) is grown the same way: each node's query sees the context's
entries and its own path's, which travel with the node's state instead of entering the
cache.

With block.feature_layers (EAGLE-3), the entries of the context also read the states
entering those target layers: u_p += W_l [norm_1(a1_p); ...; norm_n(an_p)]. The chain's
own entries (depth > 1) have no target states and take g's term alone; W_l starts at
zero, so a block given extra layers starts as the block it grew from.

The block's output goes through a final RMSNorm (initialised from the target's) so that
g lives on the scale of f: the target's LM head reads it and the next depth takes it as
a feature.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mtpspec import copy_bias
from vllm_mtpspec.config import BlockConfig, HeadsConfig
from vllm_mtpspec.heads import DraftModule
from vllm_mtpspec.quant import Int2Linear, dequantize_int2
from vllm_mtpspec.quant.int2 import stack_rows
from vllm_mtpspec.quant.int8_dynamic import Int8Linear


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """What norms, softmaxes and rotary angles compute in: fp32, or the input's dtype where
    it is wider. (A float64 block computing them in fp32 would carry fp32's error, and fp32
    exp, rsqrt and cos of one value can differ in the last bit between a vectorised and a
    scalar path, so training's and drafting's differently shaped passes would disagree.)"""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _softmax(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.softmax(scores.to(_at_least_fp32(scores.dtype)), -1).to(dtype)


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] over its root mean square, computed in at least fp32, in x's dtype. (The
    dtype checks keep a draft step's many small calls from converting to what they are.)"""
    wide_dtype = _at_least_fp32(x.dtype)
    wide = x if x.dtype == wide_dtype else x.to(wide_dtype)
    out = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _normalized(x, self.eps) * _in_dtype(self.weight, x.dtype)


_INVERSE_FREQUENCIES: dict[tuple, torch.Tensor] = {}


def _inverse_frequencies(half: int, theta: float, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    key = (half, theta, device, dtype)
    if key not in _INVERSE_FREQUENCIES:
        _INVERSE_FREQUENCIES[key] = 1.0 / theta ** (torch.arange(0, half, device=device, dtype=dtype) / half)
    return _INVERSE_FREQUENCIES[key]


def rotary(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos and sin [..., T, hd] of positions [..., T] (Llama's rotate-half form), computed
    once for the queries and keys of a pass."""
    precision = _at_least_fp32(dtype)
    angles = _in_dtype(positions, precision).unsqueeze(-1) * _inverse_frequencies(
        head_dim // 2, theta, positions.device, precision)                           # [..., T, hd/2]
    angles = torch.cat([angles, angles], -1)
    return _in_dtype(torch.cos(angles), dtype), _in_dtype(torch.sin(angles), dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


@dataclass
class BlockCache:
    """One request's context entries at positions start .. start + size - 1.

    keys and values are buffers [kv_heads, capacity, head_dim] whose slots offset ..
    offset + size - 1 hold the entries: appending writes in place (the buffer doubles when
    full), cutting entries off the end or the front only moves the bounds, so a draft that
    appends its chain and truncates it again copies nothing of the context."""
    keys: torch.Tensor
    values: torch.Tensor
    start: int = 0
    size: int = 0
    offset: int = 0

    @property
    def length(self) -> int:
        """The position the next entry takes."""
        return self.start + self.size

    def held(self, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the entries from the first-th held one on: keys, values [kv_heads, n, head_dim]."""
        lo, hi = self.offset + first, self.offset + self.size
        return self.keys[:, lo:hi], self.values[:, lo:hi]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        n = keys.shape[1]
        if self.offset + self.size + n > self.keys.shape[1]:
            held_keys, held_values = self.held()
            capacity = max(2 * (self.size + n), 16)
            self.keys = keys.new_empty(keys.shape[0], capacity, keys.shape[2])
            self.values = values.new_empty(values.shape[0], capacity, values.shape[2])
            self.keys[:, :self.size], self.values[:, :self.size] = held_keys, held_values
            self.offset = 0
        end = self.offset + self.size
        self.keys[:, end:end + n], self.values[:, end:end + n] = keys, values
        self.size += n

    def clone(self) -> "BlockCache":
        keys, values = self.held()
        return BlockCache(keys.clone(), values.clone(), self.start, self.size)


class DraftBlock(DraftModule):
    def __init__(self, config: HeadsConfig) -> None:
        super().__init__(config)
        block: BlockConfig = config.block
        d, eps = config.hidden_size, block.rms_norm_eps
        self.block_config = block
        self.feature_norm = RMSNorm(d, eps)
        self.token_norm = RMSNorm(d, eps)
        linear = lambda n_in, n_out: self._new_linear(n_in, n_out, bias=False)  # noqa: E731
        self.fuse = linear(2 * d, d)
        if block.feature_layers:
            self.layer_norms = nn.ModuleList(RMSNorm(d, eps) for _ in block.feature_layers)
            self.layer_fuse = linear(len(block.feature_layers) * d, d)
        self.attention_norm = RMSNorm(d, eps)
        self.q_proj = linear(d, block.attention_heads * block.head_dim)
        self.k_proj = linear(d, block.kv_heads * block.head_dim)
        self.v_proj = linear(d, block.kv_heads * block.head_dim)
        self.o_proj = linear(block.attention_heads * block.head_dim, d)
        self.mlp_norm = RMSNorm(d, eps)
        self.gate_proj = linear(d, block.mlp_size)
        self.up_proj = linear(d, block.mlp_size)
        self.down_proj = linear(block.mlp_size, d)
        self.output_norm = RMSNorm(d, eps)
        if self.is_quantized:  # INT2 codes come from `quantized` or a heads directory
            return
        for matrix in (self.fuse, self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj,
                       self.up_proj, self.down_proj):
            nn.init.normal_(matrix.weight, std=0.02)
        if block.feature_layers:
            nn.init.zeros_(self.layer_fuse.weight)

    @property
    def final_norm(self) -> RMSNorm:
        """The norm on the block's output."""
        return self.output_norm

    @property
    def dtype(self) -> torch.dtype:
        """What the block computes in: its norms' dtype (its matrices' too, unless they are
        INT2 codes or INT8 copies, which take and give this dtype)."""
        return self.final_norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.final_norm.weight.device

    # ------------------------------------------------------------------ pieces
    def fused_inputs(self, features: torch.Tensor, token_embeds: torch.Tensor,
                     layer_features: torch.Tensor | None = None) -> torch.Tensor:
        """[..., d] features and [..., d] embeddings of the tokens they produced -> [..., d].
        layer_features [..., n, d]: the states entering the block's feature_layers, for
        entries of the target's own positions (None for a chain's drafted ones)."""
        dtype = self.dtype
        reads_layers = layer_features is not None and bool(self.feature_layers)
        inputs = torch.stack([_in_dtype(features, dtype), _in_dtype(token_embeds, dtype)], -2)    # [..., 2, d]
        norms = [self.feature_norm, self.token_norm]
        if reads_layers:
            inputs = torch.cat([inputs, _in_dtype(layer_features, dtype)], -2)                  # [..., 2 + n, d]
            norms += list(self.layer_norms)
        # Every input normalized in one pass, then each by its own norm's weight.
        normed = _normalized(inputs, self.block_config.rms_norm_eps) * torch.stack(
            [_in_dtype(norm.weight, dtype) for norm in norms])
        flat = normed.flatten(-2)
        if not reads_layers:
            return self.fuse(flat)
        d = features.shape[-1]
        return self.fuse(flat[..., :2 * d]) + self.layer_fuse(flat[..., 2 * d:])

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor, qkv=None):
        """x [B, T, d] at positions [B, T] -> q [B, H, T, hd], k and v [B, KV, T, hd].
        qkv: q_proj, k_proj and v_proj as one product (drafting's fused projections)."""
        cfg = self.block_config
        h = self.attention_input(x)
        if qkv is None:
            q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        else:
            q, k, v = qkv(h).split([cfg.attention_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim,
                                     cfg.kv_heads * cfg.head_dim], -1)
        b, t, _ = q.shape
        q = q.reshape(b, t, cfg.attention_heads, cfg.head_dim).transpose(1, 2)
        k = k.reshape(b, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        v = v.reshape(b, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        cos, sin = rotary(positions.unsqueeze(1), cfg.head_dim, cfg.rope_theta, q.dtype)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def attention_input(self, x: torch.Tensor) -> torch.Tensor:
        """What q, k and v are computed from: the residual stream x, normalized."""
        return self.attention_norm(x)

    def projection_input(self, g: torch.Tensor) -> torch.Tensor:
        """What an LM head reads of an output g: g as it is (it ends in the block's norm)."""
        return g

    def logits(self, g: torch.Tensor, project) -> torch.Tensor:
        """The draft logits of an output g, through the target's LM head (project)."""
        return project(self.projection_input(g))

    def _expand_kv(self, kv: torch.Tensor) -> torch.Tensor:
        """[B, KV, ..., hd] -> [B, H, ..., hd]: each key/value head serves its query group."""
        group = self.block_config.attention_heads // self.block_config.kv_heads
        return kv if group == 1 else kv.repeat_interleave(group, dim=1)

    def _finish(self, x: torch.Tensor, attended: torch.Tensor, gate_up: nn.Module | None = None) -> torch.Tensor:
        """The layer's residual stream after attention ([B, H, T, hd]) and the MLP -> g [B, T, d].
        gate_up: gate_proj and up_proj as one product (drafting's fused projections)."""
        b, _, t, _ = attended.shape
        x = x + self.o_proj(attended.transpose(1, 2).reshape(b, t, -1))
        x = x + self._mlp(self.mlp_norm(x), gate_up)
        return self.output_norm(x)

    def _mlp(self, h: torch.Tensor, gate_up: nn.Module | None = None) -> torch.Tensor:
        """SwiGLU on the normalized stream h (gate_up: drafting's fused gate and up products)."""
        if gate_up is None:
            gate, up = self.gate_proj(h), self.up_proj(h)
        else:
            gate, up = gate_up(h).split(self.block_config.mlp_size, -1)
        return self.down_proj(F.silu(gate) * up)

    # ------------------------------------------------------------------ training / replay
    def unrolled(self, features: torch.Tensor, token_embeds: list[torch.Tensor], positions: torch.Tensor,
                 valid: torch.Tensor, layer_features: torch.Tensor | None = None,
                 query_rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Every position's chain at once, as drafting would run it with right drafts.

        features [B, T, d]; token_embeds[j - 1] [B, T, d]: the embedding of s_{p+j} at p
        (depth j's token); positions [B, T]; valid [B, T]: real entries (padding is False);
        layer_features [B, T, n, d] for a block with feature_layers.
        Returns g^1 .. g^k, each [B, T, d], g^j_p guessing s_{p+j+1}'s state.

        query_rows [B, Q] (indices into T): the chains of those rows only, each g [B, Q, d].
        Every row still gives its context entry, but only those rows' chains are computed:
        training wants the answer's rows, a fifth of a long conversation's."""
        scale = 1.0 / math.sqrt(self.block_config.head_dim)
        self._require_layer_features(layer_features)
        x = self.fused_inputs(features, token_embeds[0], layer_features)
        q, k, v = self._qkv(x, positions)
        context_k, context_v = self._expand_kv(k), self._expand_kv(v)         # [B, H, T, hd]
        t = features.shape[1]
        index = torch.arange(t, device=features.device)
        if query_rows is not None:
            def pick(rows_first: torch.Tensor) -> torch.Tensor:               # [B, T, ...] -> [B, Q, ...]
                return rows_first[torch.arange(rows_first.shape[0], device=rows_first.device)[:, None], query_rows]

            x, positions = pick(x), pick(positions)
            q = pick(q.transpose(1, 2)).transpose(1, 2)
            token_embeds = [pick(e) for e in token_embeds]
        rows = index.expand(features.shape[0], t) if query_rows is None else query_rows
        mask = ((index <= rows[:, :, None]) & valid[:, None, :])[:, None]      # [B, 1, Q, T]: causal, real keys
        scores = (q @ context_k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        g = self._finish(x, _softmax(scores, q.dtype) @ context_v)
        outputs = [g]
        chain_k, chain_v = [], []   # the entries of depths 2.. of each position's own chain
        for depth in range(2, len(token_embeds) + 1):
            x = self.fused_inputs(g, token_embeds[depth - 1])
            q, k, v = self._qkv(x, positions + depth - 1)
            chain_k.append(self._expand_kv(k))
            chain_v.append(self._expand_kv(v))
            context_scores = (q @ context_k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
            own_scores = torch.stack([(q * ck).sum(-1) for ck in chain_k], -1) * scale  # [B, H, T, depth-1]
            weights = _softmax(torch.cat([context_scores, own_scores], -1), q.dtype)
            attended = weights[..., :t] @ context_v + (weights[..., t:, None] * torch.stack(chain_v, -2)).sum(-2)
            g = self._finish(x, attended)
            outputs.append(g)
        return outputs

    # ------------------------------------------------------------------ drafting
    def empty_cache(self, device=None, dtype=None) -> BlockCache:
        """A cache with no entries, on the block's device and in its dtype unless told."""
        cfg = self.block_config
        device, dtype = device or self.device, dtype or self.dtype
        empty = torch.zeros(cfg.kv_heads, 0, cfg.head_dim, device=device, dtype=dtype)
        return BlockCache(keys=empty, values=empty.clone())

    def _require_layer_features(self, layer_features) -> None:
        if self.feature_layers and layer_features is None:
            raise ValueError(f"this draft block reads the states entering target layers {self.feature_layers} "
                             "(block.feature_layers) and none were given")

    def extend(self, cache: BlockCache, features: torch.Tensor, token_embeds: torch.Tensor,
               layer_features: torch.Tensor | None = None) -> torch.Tensor:
        """extend_many for one request."""
        return self.extend_many([cache], [features], [token_embeds],
                                None if layer_features is None else [layer_features])[0]

    def prepare_drafting(self, drafted_token_embeds: torch.Tensor | None = None) -> None:
        """Drafting in fewer, larger operations. At the handful of rows a draft step has, an
        operation costs mostly its fixed overhead and reading its weights again:
        - q/k/v run as one product, gate/up as another;
        - with drafted_token_embeds [N, d], the embeddings of the draft vocabulary's tokens
          in its order, a drafted token's half of the fused input is a row of a table
          (fuse's token columns applied to each normalized embedding, once, here), looked
          up by the token's draft-vocabulary index: no embedding, norm or product for it
          at each depth. draft_chains must then be given that vocabulary's draft_ids.
        Built from the weights as they are now (INT8 where int8_linears made them so, INT2
        codes where the block is quantized), on their device: call it after moving the
        block and before drafting, never before training it further. Held outside the
        registered children, so the block saves and trains as before; `unrolled` and the
        context's entries read the separate weights."""
        d = self.config.hidden_size
        token_inputs = feature_fuse = None
        if drafted_token_embeds is not None:
            with torch.no_grad():
                token_inputs = F.linear(self.token_norm(_in_dtype(drafted_token_embeds, self.dtype)),
                                        _dense_weight(self.fuse, self.dtype)[:, d:])
            feature_fuse = _side_by_side([self.fuse], self.dtype, columns=slice(0, d))
        self._drafting = _DraftingForm(
            qkv=_side_by_side([self.q_proj, self.k_proj, self.v_proj], self.dtype),
            gate_up=_side_by_side([self.gate_proj, self.up_proj], self.dtype),
            feature_fuse=feature_fuse, token_inputs=token_inputs)

    _drafting: "_DraftingForm | None" = None

    def extend_many(self, caches: list[BlockCache], features: list[torch.Tensor],
                    token_embeds: list[torch.Tensor],
                    layer_features: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Appends each request's next positions (features [n_b, d] and the embeddings of
        the tokens they produced; layer_features [n_b, n, d] where the positions are the
        target's own and the block reads feature_layers) to its cache and returns their
        outputs g [n_b, d], all requests in one pass. A draft is the same call on its
        chain's entries (no layer features), undone with `truncate` once the chain is
        drafted; `trim` drops what fell out of the window."""
        lengths = [f.shape[0] for f in features]
        x = self.fused_inputs(torch.cat(features), torch.cat(token_embeds),
                              None if layer_features is None else torch.cat(layer_features))
        return list(self._extend(caches, x, lengths).split(lengths))

    def _extend(self, caches: list[BlockCache], x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """extend_many from the fused inputs x [R, d]: each request's rows in turn, lengths[b]
        of them for request b -> g [R, d]. The rows stay packed through every product and
        norm: a step that prefills one long prompt beside many one-token decodes computes
        its rows, not every request padded to the longest. Positions are built on x's
        device from the caches' host-side lengths: no copy from the host, no sync."""
        cfg = self.block_config
        device = x.device
        positions = torch.cat([torch.arange(c.length, c.length + n, device=device)
                               for c, n in zip(caches, lengths)])                               # [R]
        drafting = self._drafting
        q, k, v = self._qkv(x[None], positions[None], None if drafting is None else drafting.qkv)  # [1, heads, R, hd]
        # Each request's visible keys: its entries less than a window before its first new
        # row, then its new ones. A query at p sees keys in (p - window, p].
        keys, values, key_positions, rows = [], [], [], []
        offset = 0
        for cache, n in zip(caches, lengths):
            first = max(0, cache.size - cfg.window + 1)
            key_positions.append((cache.start + first, cache.length + n))
            cache.append(k[0, :, offset:offset + n], v[0, :, offset:offset + n])
            held_keys, held_values = cache.held(first)
            keys.append(held_keys)
            values.append(held_values)
            rows.append((offset, n))
            offset += n
        if len(caches) == 1 or device.type == "cpu":
            attended = self._attend_each(q, keys, values, key_positions, positions, rows)
        else:
            attended = self._attend_padded(q, keys, values, key_positions, positions, rows)
        return self._finish(x[None], attended, None if drafting is None else drafting.gate_up)[0]

    def _visible(self, key_positions: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
        """[..., L] key and [..., n] query positions -> [..., n, L]: the keys each query
        sees (at or before it, within the window; a padded key's position is -1)."""
        keys, queries = key_positions[..., None, :], query_positions[..., :, None]
        return (keys >= 0) & (keys <= queries) & (keys > queries - self.block_config.window)

    def _attend_each(self, q, keys, values, key_positions, positions, rows) -> torch.Tensor:
        """Attention one request at a time over the cache's own views: nothing copied. On a
        CPU the padded batch's copy of every request's keys cost more than the separate
        calls (up to a window of entries per request, at every depth of every draft).
        q [1, H, R, hd] packed, rows: each request's (first row, number of rows) in it."""
        attended = []
        for b, ((lo, hi), (first, n_b)) in enumerate(zip(key_positions, rows)):
            seen = None
            if n_b > 1:  # one new row sees every key it is given
                seen = self._visible(torch.arange(lo, hi, device=q.device), positions[first:first + n_b])
            attended.append(F.scaled_dot_product_attention(q[:, :, first:first + n_b], keys[b][None],
                                                           values[b][None], attn_mask=seen, enable_gqa=True))
        return attended[0] if len(attended) == 1 else torch.cat(attended, 2)

    def _attend_padded(self, q, keys, values, key_positions, positions, rows) -> torch.Tensor:
        """Attention for every request in one call, each one's rows and keys padded to the
        longest: one kernel for the batch where a launch costs more than the copy (a GPU)."""
        width = max(hi - lo for lo, hi in key_positions)
        n = max(n_b for _, n_b in rows)
        padded = lambda t, size: F.pad(t, (0, 0, 0, size - t.shape[-2]))  # noqa: E731
        keys = torch.stack([padded(t, width) for t in keys])
        values = torch.stack([padded(t, width) for t in values])
        key_pos = torch.stack([F.pad(torch.arange(lo, hi, device=q.device), (0, width - (hi - lo)), value=-1)
                               for lo, hi in key_positions])                                      # [B, L]
        queries = torch.stack([padded(q[0, :, first:first + n_b], n) for first, n_b in rows])     # [B, H, n, hd]
        # A padded query takes the positions after its request's last row: it sees keys (its
        # row of weights is never empty) and is dropped below.
        query_pos = torch.stack([torch.arange(hi - n_b, hi - n_b + n, device=q.device)
                                 for (_, hi), (_, n_b) in zip(key_positions, rows)])              # [B, n]
        seen = self._visible(key_pos[:, None], query_pos[:, None])                               # [B, 1, n, L]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=seen, enable_gqa=True)
        return torch.cat([out[b, :, :n_b] for b, (_, n_b) in enumerate(rows)], 1)[None]         # [1, H, R, hd]

    @staticmethod
    def truncate(cache: BlockCache, length: int) -> None:
        """Forgets the entries from position `length` on (a drafted chain's, or recomputed ones)."""
        cache.size = min(cache.size, max(0, length - cache.start))

    def trim(self, cache: BlockCache) -> None:
        """Drops the entries no future query can see (older than the window)."""
        drop = max(0, cache.size - self.block_config.window)
        if drop:
            cache.offset, cache.size, cache.start = cache.offset + drop, cache.size - drop, cache.start + drop

    def _token_table(self, draft_ids: torch.Tensor | None, caller: str) -> torch.Tensor | None:
        """The drafting form's token table (None where prepare_drafting built none), refused
        with a draft vocabulary other than the one it was built for."""
        token_inputs = None if self._drafting is None else self._drafting.token_inputs
        if token_inputs is not None and (draft_ids is None or draft_ids.shape[0] != token_inputs.shape[0]):
            raise ValueError(f"prepare_drafting was given the embeddings of {token_inputs.shape[0]} draft tokens, and "
                             f"{caller} {'no draft vocabulary' if draft_ids is None else draft_ids.shape[0]}")
        return token_inputs

    def _table_input(self, g: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The fused input of a drafted token's depth from the token table: fuse's feature
        half of g, plus the token's row (its index in the draft vocabulary)."""
        table = self._drafting.token_inputs
        return self._drafting.feature_fuse(self.feature_norm(_in_dtype(g, table.dtype))) + table[rows]

    def draft_chains(self, caches: list[BlockCache], newest: torch.Tensor, depth: int, project, embed,
                     draft_ids: torch.Tensor | None = None,
                     copy: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [B, depth, N] along each request's own top-1 chain: newest [B, d] is the
        output at its newest accepted position (depth 1); depth j reads depth j - 1's
        output and the token drafted from it. copy: (tokens [B, depth], biases [B]) from
        copy_bias.copy_drafts, which lean each depth's logits toward the context's repeat
        while the chain follows it. The caches end as they began."""
        token_inputs = self._token_table(draft_ids, "draft_chains")
        ends = [c.length for c in caches]
        one_each = [1] * len(caches)  # each request's chain adds one row per depth
        g, logits = newest, []
        following = None if copy is None else torch.ones(len(caches), dtype=torch.bool, device=newest.device)
        for j in range(depth):
            logits.append(self.logits(g, project))
            if copy is not None:
                logits[-1] = copy_bias.lean(logits[-1], copy[0][:, j], copy[1], following, draft_ids)
            if j + 1 == depth:
                break
            index = logits[-1].argmax(-1)
            if copy is not None:
                following = copy_bias.following_after(following, index, copy[0][:, j], draft_ids)
            if token_inputs is not None:
                x = self._table_input(g, index)
            else:
                token = index if draft_ids is None else draft_ids[index]
                x = self.fused_inputs(g, embed(token))
            g = self._extend(caches, x, one_each)
        for cache, end in zip(caches, ends):
            self.truncate(cache, end)
        return torch.stack(logits, 1)

    def tree_step(self, caches: list[BlockCache], project, embed, temperatures: torch.Tensor,
                  draft_ids: torch.Tensor | None = None):
        """The step a grown tree takes per depth (grown_tree.py) for the requests of these
        caches, each drafted from its newest accepted position: step 0 is given the block's
        outputs there (`newest` [B, d]); step i > 0 the states of depth i's nodes (F per
        request) and their tokens (target ids). A node at depth i enters the block at
        position p + i, as a chain's depth-i token does, and its query sees the context's
        entries and its own path's, never a sibling's: what `draft_chains` computes for
        the chain through it. Its state is its output g followed by its path's keys and
        values ([g | keys | values], one row), so the frontier's gather carries each
        node's path along. The caches are only read."""
        cfg = self.block_config
        d, entry = self.config.hidden_size, cfg.kv_heads * cfg.head_dim
        drafting = self._drafting
        token_inputs = self._token_table(draft_ids, "tree_step")
        draft_index = None
        if token_inputs is not None:  # target id -> its row of the token table
            # Sized by the config, not by the ids' largest (reading that would wait for the device).
            draft_index = torch.zeros(self.config.vocab_size, dtype=torch.long, device=draft_ids.device)
            draft_index[draft_ids] = torch.arange(draft_ids.shape[0], device=draft_ids.device)
        batch = len(caches)

        def probs(i: int, g: torch.Tensor) -> torch.Tensor:
            return torch.softmax(self.logits(g, project).float() / temperatures[i], dim=-1)

        def step(i: int, states: torch.Tensor, tokens: torch.Tensor):
            if i == 0:
                return states, probs(0, states)
            nodes = states.shape[0] // batch                                              # F per request
            g = states[:, :d]
            if token_inputs is not None:
                x = self._table_input(g, draft_index[tokens])
            else:
                x = self.fused_inputs(g, embed(tokens))
            positions = torch.tensor([c.length + i - 1 for c in caches], device=x.device)[:, None].expand(batch, nodes)
            q, k, v = self._qkv(x.view(batch, nodes, -1), positions, None if drafting is None else drafting.qkv)
            # Each node's path entries [B, F, i, KV, hd]: its ancestors' (from its state), then its own.
            own_k, own_v = (t.transpose(1, 2)[:, :, None] for t in (k, v))                 # [B, F, 1, KV, hd]
            path_shape = (batch, nodes, i - 1, cfg.kv_heads, cfg.head_dim)
            path_k = torch.cat([states[:, d:d + (i - 1) * entry].reshape(path_shape), own_k], 2)
            path_v = torch.cat([states[:, d + (i - 1) * entry:].reshape(path_shape), own_v], 2)
            attended = self._attend_paths(q, caches, path_k, path_v, i)
            g = self._finish(x.view(batch, nodes, -1), attended, None if drafting is None else drafting.gate_up)
            g = g.reshape(batch * nodes, d)
            carried = torch.cat([g, path_k.reshape(batch * nodes, -1), path_v.reshape(batch * nodes, -1)], -1)
            return carried, probs(i, g)

        return step

    def _attend_paths(self, q: torch.Tensor, caches: list[BlockCache], path_k: torch.Tensor, path_v: torch.Tensor,
                      i: int) -> torch.Tensor:
        """q [B, H, F, hd] of F nodes per request at depth i, whose queries sit at position
        p + i; path_k, path_v [B, F, i, KV, hd]: each node's path entries -> [B, H, F, hd].
        One call per request over its context's visible entries and every node's path
        entries, each node masked to its own path's."""
        cfg = self.block_config
        batch, _, nodes, _ = q.shape
        own = torch.eye(nodes, dtype=torch.bool, device=q.device).repeat_interleave(i, dim=1)  # [F, F * i]
        attended = []
        for b, cache in enumerate(caches):
            # The query at p + i sees keys after p + i - window; p + 1 .. p + i are its path's.
            first = max(0, cache.size + i - cfg.window)
            context_k, context_v = cache.held(first)                                       # [KV, L, hd]
            keys = torch.cat([context_k, path_k[b].reshape(nodes * i, cfg.kv_heads, -1).transpose(0, 1)], 1)
            values = torch.cat([context_v, path_v[b].reshape(nodes * i, cfg.kv_heads, -1).transpose(0, 1)], 1)
            seen = torch.cat([own.new_ones(nodes, context_k.shape[1]), own], 1)
            attended.append(F.scaled_dot_product_attention(q[b:b + 1], keys[None], values[None], attn_mask=seen,
                                                           enable_gqa=True))
        return torch.cat(attended)


@dataclass
class _DraftingForm:
    """What prepare_drafting builds (see there)."""
    qkv: object                          # h -> [q | k | v]
    gate_up: object                      # h -> [gate | up]
    feature_fuse: object | None          # fuse's feature columns: norm(g) -> its half of the input
    token_inputs: torch.Tensor | None    # [N, d]: each draft token's half of the input


def _side_by_side(linears: list[nn.Module], dtype: torch.dtype, columns: slice = slice(None)):
    """One product whose output is the linears' outputs side by side (over the given input
    columns of their weights): INT8 where they are; INT2 where they are and every column
    is read (a column slice of INT2 weights is held as the values its codes stand for)."""
    if columns == slice(None) and all(isinstance(linear, Int2Linear) for linear in linears):
        return Int2Linear(stack_rows([linear.qweight for linear in linears]))
    weight = torch.cat([_dense_weight(linear, dtype)[:, columns] for linear in linears]).contiguous()
    if all(isinstance(linear, Int8Linear) for linear in linears):
        return Int8Linear.from_weight(weight)
    return lambda h: F.linear(h, _in_dtype(weight, h.dtype))


def _dense_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A matrix's weight [out, in] as values (what an INT2 or INT8 matrix's codes stand for)."""
    if isinstance(linear, Int2Linear):
        return dequantize_int2(linear.qweight, dtype=dtype)
    if isinstance(linear, Int8Linear):
        return linear.dense_weight(dtype)
    return _in_dtype(linear.weight.detach(), dtype)


def _rope_theta(model_config) -> float:
    """The target's RoPE base: newer transformers keep it in rope_parameters, per layer type
    where layers differ (Gemma 3: full and sliding); the block attends over its whole
    window as a full-attention layer does, so it takes that base."""
    parameters = getattr(model_config, "rope_parameters", None) or {}
    parameters = parameters.get("full_attention", parameters)
    return float(parameters.get("rope_theta") or getattr(model_config, "rope_theta", None) or 10000.0)


def block_config_for(model_config, *, window: int = 1024, feature_layers=(), mlp_size: int = 0) -> BlockConfig:
    """A block shaped like one of the target's own decoder layers (its MLP mlp_size wide
    where that is set)."""
    heads = model_config.num_attention_heads
    return BlockConfig(
        attention_heads=heads,
        kv_heads=getattr(model_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(model_config, "head_dim", None) or model_config.hidden_size // heads,
        mlp_size=mlp_size or model_config.intermediate_size,
        rope_theta=_rope_theta(model_config),
        rms_norm_eps=float(getattr(model_config, "rms_norm_eps", 1e-5)),
        window=window,
        feature_layers=list(feature_layers),
    )
