"""A speculative decoder over a Hugging Face causal LM: the oracle for losslessness and
the CPU baseline for acceptance measurements.

One step, for a context of L tokens whose last sampled token (the root) is not yet in
the KV cache:
  1. the heads read the hidden state that produced the root and propose candidates;
  2. a tree of candidates is built; root + nodes go through the target in one forward,
     node i at position L + depth(i), attending to the cached prefix, the root and its
     own ancestors only (a 4-D mask; a sliding layer, Gemma's, only to the keys within
     its window of each node's position, so its cache keeps every row as full layers do);
  3. verification keeps the longest agreeing path and adds the target's bonus token;
  4. the KV cache keeps the root's and accepted nodes' entries and drops the rest.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from vllm_mtpspec.config import ConfigError, SpecOptions
from vllm_mtpspec.drafter import Drafter
from vllm_mtpspec.layer_states import recording_layer_inputs, with_layer_states
from vllm_mtpspec.lookup import lookup_draft
from vllm_mtpspec.model_profile import profile_of_hf_config
from vllm_mtpspec.tree import TreeShape, chain_tree
from vllm_mtpspec.tree_builder import DraftTreeBuilder
from vllm_mtpspec.verify import verify_greedy, verify_sampled


@dataclass
class StepRecord:
    num_nodes: int          # tree size verified this step
    accepted_len: int       # tokens emitted this step (accepted drafts + bonus)


@dataclass
class DecodeResult:
    tokens: list[int]
    steps: list[StepRecord] = field(default_factory=list)
    head_hits: list[int] = field(default_factory=list)    # per head: its candidate was accepted
    head_tries: list[int] = field(default_factory=list)   # per head: steps where it could be

    @property
    def mean_accepted_len(self) -> float:
        return sum(s.accepted_len for s in self.steps) / max(len(self.steps), 1)


class ReferenceDecoder:
    def __init__(self, model, drafter: Drafter, options: SpecOptions, *, depth: int | None = None,
                 rank_accuracy=None) -> None:
        self.model = model
        self.drafter = drafter
        self.options = options
        self.depth = depth or options.num_speculative_tokens or drafter.num_heads
        if self.depth > drafter.num_heads:
            raise ValueError(f"depth {self.depth} > {drafter.num_heads} heads")
        heads_config = getattr(drafter, "config", None)  # the heads' own (a test's stand-in may have none)
        if heads_config is not None and (refusal := heads_config.kind.tree_refusal(options.tree)) is not None:
            raise ConfigError(f"tree={options.tree!r}: {refusal}; use tree='chain'"
                              + (" or tree='dynamic'" if heads_config.kind.grows_trees else ""))
        self.trees = DraftTreeBuilder(options.tree, self.depth, max_nodes=options.max_tree_nodes,
                                      min_path_prob=options.min_path_prob, dynamic_top_k=options.dynamic_top_k,
                                      rank_accuracy=options.head_rank_accuracy or rank_accuracy)
        # Heads whose deeper drafts read their own guesses grow their dynamic trees.
        self.grows_trees = options.tree == "dynamic" and getattr(drafter, "grows_trees", False)
        # Target layers whose input states the drafter reads beside the final one.
        self.feature_layers = list(getattr(drafter, "feature_layers", None) or [])
        self.layer_windows = profile_of_hf_config(model.config).layer_windows

    @property
    def static_shape(self) -> TreeShape | None:
        return self.trees.static_shape

    @property
    def _lm_head(self):
        return self.model.get_output_embeddings()

    def _forward(self, input_ids, positions, cache, mask=None):
        """(drafter rows [q, (1 + n) d]: the final states, with the states entering the
        drafter's feature layers where it reads any; logits [q, V]; the cache)."""
        with recording_layer_inputs(self.model.model, self.feature_layers) as entering:
            out = self.model.model(
                input_ids=input_ids.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                attention_mask=mask,
                past_key_values=cache,
                use_cache=True,
            )
        hidden = out.last_hidden_state[0]  # [q, d], after the final norm
        rows = with_layer_states(hidden, [entering[layer] for layer in self.feature_layers])
        return rows, self._lm_head(hidden).float(), out.past_key_values

    def _pick(self, logits: torch.Tensor, temperature: float, generator) -> int:
        if temperature <= 0:
            return int(logits.argmax())
        probs = torch.softmax(logits / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))

    def _tree(self, head_logits: torch.Tensor):
        """head_logits [k, V] -> (shape, node tokens) for this step."""
        head_logits = head_logits[: self.depth].float()
        temps = self.drafter.temperatures[: self.depth].unsqueeze(-1).to(head_logits.device)
        [(shape, tokens)] = self.trees.build(torch.softmax(head_logits / temps, dim=-1).unsqueeze(0))
        return shape, torch.tensor(tokens, dtype=torch.long, device=head_logits.device)

    def _grown_tree(self, root_hidden: torch.Tensor, root: int):
        """(shape, node tokens) of the tree grown from the root's state (grown_tree.py)."""
        [(shape, tokens)] = self.trees.grow(self.drafter.draft_step(), root_hidden.unsqueeze(0),
                                            torch.tensor([root], device=root_hidden.device), depth=self.depth,
                                            token_ids=self.drafter.draft_ids)
        return shape, torch.tensor(tokens, dtype=torch.long)

    def _lookup(self, context: list[int]):
        """(chain, tokens) copied from the context (lookup.py), or None: as vLLM's proposer does."""
        if not self.options.prompt_lookup_max:
            return None
        draft = lookup_draft(np.asarray(context), min_n=self.options.prompt_lookup_min,
                             max_n=self.options.prompt_lookup_max, k=self.depth)
        return (chain_tree(len(draft)), torch.tensor(draft)) if draft else None

    @torch.no_grad()
    def decode(
        self,
        prompt_ids: list[int],
        *,
        max_new_tokens: int,
        eos_token_ids: set[int] = frozenset(),
        temperature: float = 0.0,
        seed: int | None = None,
    ) -> DecodeResult:
        device = self.model.device
        generator = None
        if seed is not None:
            generator = torch.Generator(device="cpu").manual_seed(seed)
        prompt = torch.tensor(prompt_ids, device=device)
        # Every layer keeps every row (a sliding layer's window is in its mask): a cache that
        # drops rows as the window slides could not keep the accepted ones in place.
        cache = DynamicCache()
        hidden, logits, cache = self._forward(prompt, torch.arange(len(prompt_ids), device=device), cache)
        context_len = len(prompt_ids)
        root = self._pick(logits[-1], temperature, generator)
        root_hidden = hidden[-1]
        observe = getattr(self.drafter, "observe", None)  # drafters that read the context
        if observe is not None:
            self.drafter.start()
            observe(hidden[:-1], prompt[1:])  # prompt position p produced prompt token p + 1
        result = DecodeResult([root], head_hits=[0] * self.depth, head_tries=[0] * self.depth)
        dtype = hidden.dtype
        while len(result.tokens) < max_new_tokens and root not in eos_token_ids:
            if self.grows_trees:
                shape, node_tokens = self._lookup(prompt_ids + result.tokens) or self._grown_tree(root_hidden, root)
            else:
                head_logits = self.drafter.head_logits(root_hidden.unsqueeze(0), torch.tensor([root], device=device))[0]
                shape, node_tokens = self._lookup(prompt_ids + result.tokens) or self._tree(head_logits)
            n = len(shape)
            input_ids = torch.cat([torch.tensor([root], device=device), node_tokens.to(device)])
            positions = context_len + torch.tensor((0,) + shape.depths, device=device)
            masks = tree_masks(shape, positions, context_len, self.layer_windows, dtype=dtype, device=device)
            hidden, logits, cache = self._forward(input_ids, positions, cache, masks)
            if temperature <= 0:
                verdict = verify_greedy(shape, node_tokens, logits)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                verdict = verify_sampled(shape, node_tokens, probs, generator=generator)
            keep_rows = [0] + [node + 1 for node in verdict.accepted_nodes]
            _keep_cache_rows(cache, context_len, keep_rows)
            context_len += len(keep_rows)
            root_hidden = hidden[keep_rows[-1]]
            emitted = verdict.emitted
            if observe is not None:  # the kept rows but the new root, which the next draft reads
                observe(hidden[keep_rows[:-1]], torch.tensor(emitted[:-1], dtype=torch.long, device=device))
            result.steps.append(StepRecord(n, len(emitted)))
            for d in range(min(shape.max_depth, self.depth)):
                result.head_tries[d] += 1
                result.head_hits[d] += int(len(verdict.accepted_nodes) > d)
            for token in emitted:
                result.tokens.append(token)
                if token in eos_token_ids or len(result.tokens) >= max_new_tokens:
                    break
            root = result.tokens[-1]
        return result


def tree_masks(shape: TreeShape, positions: torch.Tensor, context_len: int, layer_windows: tuple[int | None, ...],
               *, dtype, device):
    """The additive [1, 1, 1 + n, context_len + 1 + n] mask of a step's root and n nodes
    (at `positions`): each row sees the prefix, the root and its own ancestors. Where layers
    slide, a sliding layer sees only keys less than its window behind the row's position, and the
    model gets one mask per layer type (transformers' mapping for mixed layers)."""
    def additive(allowed):
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)[
            None, None]

    n = len(shape)
    allowed = torch.ones(n + 1, context_len + n + 1, dtype=torch.bool, device=device)
    allowed[:, context_len:] = shape.ancestor_mask(include_root=True).to(device)
    windows = {w for w in layer_windows if w is not None}
    if not windows:
        return additive(allowed)
    if len(windows) > 1:
        raise ConfigError(f"the target's sliding layers have windows {sorted(windows)}: the reference decoder "
                          "supports one window size")
    [window] = windows
    key = torch.cat([torch.arange(context_len, device=device), positions])
    sliding = allowed & (positions[:, None] - key[None, :] < window)
    if all(w is not None for w in layer_windows):
        return additive(sliding)
    return {"full_attention": additive(allowed), "sliding_attention": additive(sliding)}


def _keep_cache_rows(cache, context_len: int, keep_rows: list[int]) -> None:
    """Keeps the prefix and the given rows of the last forward's entries in every layer."""
    index = torch.cat([
        torch.arange(context_len),
        torch.tensor(keep_rows, dtype=torch.long) + context_len,
    ])
    for layer in cache.layers:
        idx = index.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)


@torch.no_grad()
def plain_greedy(model, prompt_ids: list[int], *, max_new_tokens: int, eos_token_ids: set[int]) -> list[int]:
    """The target alone, through transformers' own generate(): the reference output."""
    input_ids = torch.tensor([prompt_ids], device=model.device)
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=sorted(eos_token_ids) or None,
        pad_token_id=sorted(eos_token_ids)[0] if eos_token_ids else None,
    )
    return out[0, len(prompt_ids):].tolist()
