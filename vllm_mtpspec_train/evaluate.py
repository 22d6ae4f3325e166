"""How well heads predict the target, measured along the target's own greedy answers.

Because the answers are the target's greedy output and the recorded hidden states are
the ones it had while writing them, greedy speculative decoding can be replayed exactly
from the data: at answer row r (root token r), a tree's node at depth d is right when
it equals answer token r + d and its parent was right; the step emits the accepted
nodes plus one token and continues at row r + accepted + 1.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from vllm_mtpspec.config import SpecOptions
from vllm_mtpspec.copy_bias import along_answer
from vllm_mtpspec.grown_tree import grow_trees
from vllm_mtpspec.heads import MTPHeads
from vllm_mtpspec.lookup import lookup_draft
from vllm_mtpspec.sequential_heads import chain_tokens
from vllm_mtpspec.shards import ShardsError, answer_sequence, has_context_rows, unroll_sequences
from vllm_mtpspec.tree import TreeShape, build_static_shape

# Context length (prompt tokens, the conversation so far for later turns) buckets reported apart.
CONTEXT_BUCKETS = (256, 512, 1024)


def context_bucket(prompt_tokens: int) -> str:
    """'<=256', '257-512', '513-1024', '>1024' prompt tokens."""
    low = 0
    for high in CONTEXT_BUCKETS:
        if prompt_tokens <= high:
            return f"<={high}" if low == 0 else f"{low + 1}-{high}"
        low = high
    return f">{CONTEXT_BUCKETS[-1]}"


TEMPERATURE_GRID = [0.25, 0.35, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0]
RANKS = 8


@torch.no_grad()
def answer_head_logits(heads: MTPHeads, hidden, tokens, lm_head, embed, chunk: int = 256):
    """Yields (row slice, logits [rows, k, V] over the target's vocabulary) for one
    answer's rows. lm_head: the target's [V, d] weight, or the heads' projection of it
    (MTPHeads.lm_head_for, made once by the caller)."""
    project = heads.lm_head_for(lm_head) if isinstance(lm_head, torch.Tensor) else lm_head
    # Sequential heads read every depth's token: the answer's own, along a chain still right.
    depth_tokens = chain_tokens(tokens.long(), heads.num_heads) if heads.config.kind.reads_drafted_tokens else tokens
    for start in range(0, hidden.shape[0], chunk):
        h = hidden[start:start + chunk].float()
        e = embed[depth_tokens[start:start + chunk].long()] if heads.config.token_conditioned else None
        yield slice(start, start + h.shape[0]), heads.target_vocab_logits(heads(h, token_embeds=e, lm_head=project))


@torch.no_grad()
def block_answer_logits(block, shard: dict, j: int, lm_head, embed, chunk: int = 256):
    """answer_head_logits for an attention draft block: the answer is read with the prompt
    rows before it, every depth as drafting runs it along a chain that is still right."""
    if not has_context_rows(shard):
        raise ShardsError("an attention draft block is scored with the prompt rows before each answer, and these "
                         "shards carry none (context_hidden): rebuild them with `python -m vllm_mtpspec_train.data "
                         "--context-rows 512`")
    project = block.lm_head_for(lm_head) if isinstance(lm_head, torch.Tensor) else lm_head
    k = block.num_heads
    seq = answer_sequence(shard, j, block.feature_layers)
    states = unroll_sequences(block, [seq], embed)[0, seq["first_answer_row"]:]  # [n, k, d]
    copy = _copy_along(block, shard, j, states.shape[0])
    for start in range(0, states.shape[0], chunk):
        g = states[start:start + chunk]
        logits = block.target_vocab_logits(block.logits(g.reshape(-1, g.shape[-1]), project).view(g.shape[0], k, -1))
        if copy is not None:  # as drafting leans each depth, where the chain follows the repeat
            tokens, bias = copy[0][start:start + chunk], copy[1][start:start + chunk]
            logits = logits.scatter_add(-1, tokens.clamp_min(0)[..., None], bias[..., None].to(logits.dtype))
        yield slice(start, start + g.shape[0]), logits


def _copy_along(block, shard: dict, j: int, rows: int):
    """The copy bias's (tokens [rows, k], biases [rows, k]) along answer j (copy_bias.py),
    or None for a block without one."""
    biases = block.config.copy_bias
    if not biases:
        return None
    start, end = int(shard["offsets"][j]), int(shard["offsets"][j + 1])
    prompt = list(shard["prompt_ids"][j])
    context = np.asarray(prompt + shard["tokens"][start:end].tolist())
    return along_answer(context, len(prompt), rows, block.num_heads, biases)


def draft_logits_along(heads, shard: dict, j: int, project, embed):
    """(row slice, logits [rows, k, V]) along answer j of a shard, for any head kind."""
    if heads.config.kind.keeps_context:
        return block_answer_logits(heads, shard, j, project, embed)
    start, end = int(shard["offsets"][j]), int(shard["offsets"][j + 1])
    return answer_head_logits(heads, shard["hidden"][start:end], shard["tokens"][start:end].long(), project, embed)


def conditional_hits(top1: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """chain_hits along one answer: top1 [n, k], each row's top-1 draft per depth; tokens
    [n]: the answer, whose token r + i + 1 is depth i's target at row r."""
    n, k = top1.shape
    ahead = torch.arange(n, device=tokens.device)[:, None] + torch.arange(1, k + 1, device=tokens.device)
    return chain_hits(top1, torch.where(ahead < n, tokens[ahead.clamp_max(n - 1)], -1))


def chain_hits(top1: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per depth i: (rows where depth i was right and depths 1..i-1 were, rows where depths
    1..i-1 were right and depth i has a target): the chain's conditional top-1.
    top1 [n, k]: each row's top-1 draft per depth; targets [n, k]: what depth i should
    draft at each row, -1 where the answer has ended. On top1's device."""
    n, k = top1.shape
    hits, asked = torch.zeros(k, device=top1.device), torch.zeros(k, device=top1.device)
    chain_ok = torch.ones(n, dtype=torch.bool, device=top1.device)
    for i in range(k):
        has = targets[:, i] >= 0
        right = has & (top1[:, i] == targets[:, i])
        asked[i] += (chain_ok & has).sum()
        hits[i] += (chain_ok & right).sum()
        chain_ok &= right
    return hits, asked


def replay_tree(shape: TreeShape, node_tokens_per_row: torch.Tensor, answer: torch.Tensor,
                lookup: Callable[[int], list[int]] | None = None) -> list[int]:
    """Accepted lengths (accepted + 1) of greedy decoding along one answer. lookup(r), when
    given, is a looked-up chain that replaces the tree at row r (as the proposer does)."""
    return replay_trees(lambda r: (shape.paths, node_tokens_per_row[r].tolist()), answer, lookup)


def replay_trees(tree_at: Callable[[int], tuple[tuple, list[int]]], answer: torch.Tensor,
                 lookup: Callable[[int], list[int]] | None = None) -> list[int]:
    """replay_tree where each row drafts its own tree: tree_at(r) -> (paths, node tokens)."""
    lengths, r, n = [], 0, answer.numel()
    answer_list = answer.tolist()
    while r < n - 1:
        chain = lookup(r) if lookup else None
        if chain:
            best = next((d for d, t in enumerate(chain) if r + d + 1 >= n or t != answer_list[r + d + 1]), len(chain))
            emitted = min(best + 1, n - 1 - r)
            lengths.append(emitted)
            r += emitted
            continue
        paths, tokens = tree_at(r)
        ok: dict[tuple, bool] = {}
        best = 0
        for node, path in enumerate(paths):
            d = len(path)
            if r + d >= n:
                continue
            good = tokens[node] == answer_list[r + d] and (d == 1 or ok.get(path[:-1], False))
            ok[path] = good
            if good:
                best = max(best, d)
        emitted = min(best + 1, n - 1 - r)
        lengths.append(emitted)
        r += emitted
    return lengths


@torch.no_grad()
def grown_trees_along(heads, hidden: torch.Tensor, tokens: torch.Tensor, project, embed: torch.Tensor, *,
                      max_nodes: int, top_k: int, min_path_prob: float, chunk: int = 256) -> list[tuple]:
    """(paths, node tokens) of the dynamic tree that heads growing their own trees
    (grown_tree.py) draft at every row of one answer, as serving grows them. project: the
    heads' LM-head projection (MTPHeads.lm_head_for); embed: the target's [V, d] embedding."""
    step = heads.draft_step(project, lambda ids: embed[ids], heads.temperatures)
    out = []
    for start in range(0, tokens.numel(), chunk):
        for tree in grow_trees(step, hidden[start:start + chunk].float(), tokens[start:start + chunk].long(),
                               depth=heads.num_heads, max_nodes=max_nodes, top_k=top_k, min_path_prob=min_path_prob,
                               token_ids=heads.draft_vocab):
            out.append((tree.shape.paths, tree.tokens.tolist()))
    return out


@torch.no_grad()
def block_grown_trees_along(block, shard: dict, j: int, project, embed: torch.Tensor, *, max_nodes: int, top_k: int,
                            min_path_prob: float, chunk: int = 256) -> list[tuple]:
    """grown_trees_along for an attention draft block: at every row of answer j, the tree
    it grows from a cache of the rows up to that one (the prompt rows kept before the
    answer, then the answer's), as serving grows it (DraftBlock.tree_step)."""
    from vllm_mtpspec.draft_block import BlockCache

    seq = answer_sequence(shard, j, block.feature_layers)
    cache = block.empty_cache(dtype=torch.float32)
    cache.start = int(seq["positions"][0])
    newest = block.extend(cache, seq["features"], embed[seq["tokens"]], seq.get("layer_features"))
    out = []
    for start in range(seq["first_answer_row"], newest.shape[0], chunk):
        rows = range(start, min(start + chunk, newest.shape[0]))
        # Row q's cache: the entries up to its own, views of the whole one.
        caches = [BlockCache(cache.keys, cache.values, cache.start, q + 1, cache.offset) for q in rows]
        step = block.tree_step(caches, project, lambda ids: embed[ids], block.temperatures, block.draft_vocab)
        for tree in grow_trees(step, newest[rows.start:rows.stop], torch.zeros(len(rows), dtype=torch.long),
                               depth=block.num_heads, max_nodes=max_nodes, top_k=top_k, min_path_prob=min_path_prob,
                               token_ids=block.draft_vocab):
            out.append((tree.shape.paths, tree.tokens.tolist()))
    return out


@torch.no_grad()
def evaluate_heads(heads, shard_files: list[Path], *, lm_head: torch.Tensor, embed: torch.Tensor,
                   trees: tuple[str, ...] = ("chain", "consensus"), max_tree_nodes: int = 16,
                   fit_temperatures: bool = False, temperature_rows: int = 8192,
                   prompt_lookup: tuple[int, int] | None = (2, 4)) -> dict:
    """prompt_lookup: (min_n, max_n) to also replay `chain+lookup` (lookup.py), or None.
    Heads that grow their own trees (sequential, attention) replay a grown dynamic tree of
    max_tree_nodes nodes (`dynamic`) where a fixed-shape tree is asked."""
    heads = heads.float().eval()
    project = heads.lm_head_for(lm_head)
    k = heads.num_heads
    grown = heads.config.kind.grows_trees and any(name != "chain" for name in trees)
    if heads.config.kind.chains_only:  # the logits are those along the answer's chain: no fixed shape can be replayed
        trees = tuple(name for name in trees if name == "chain")
    defaults = SpecOptions()
    shapes = {name: build_static_shape(name, k, max_nodes=max_tree_nodes, rank_accuracy=heads.config.rank_accuracy)
              for name in trees}
    max_rank = max([RANKS] + [s.max_rank for s in shapes.values()])
    hits = torch.zeros(k, max_rank)          # hits[i, r]: target is head i's r-th candidate
    rows = torch.zeros(k)
    per_cat = defaultdict(lambda: torch.zeros(3, k))  # [top1, top5, count]
    per_len = defaultdict(lambda: torch.zeros(3, k))  # the same by context-length bucket
    per_src = defaultdict(lambda: torch.zeros(3, k))  # and by source: the shards' folder
    nll = torch.zeros(k, len(TEMPERATURE_GRID))
    cond_hits, cond_asked = torch.zeros(k), torch.zeros(k)
    fitted_rows = [0] * k
    replays = list(trees) + (["chain+lookup"] if prompt_lookup and "chain" in shapes else []) + (
        ["dynamic"] if grown else [])
    accepted = {name: [] for name in replays}
    accepted_cat = {name: defaultdict(list) for name in replays}
    accepted_len = {name: defaultdict(list) for name in replays}
    accepted_src = {name: defaultdict(list) for name in replays}

    def record(name: str, lengths: list[int], category: str, bucket: str, source: str) -> None:
        """One replay's accepted lengths, overall and in its category, context and source groups."""
        accepted[name].extend(lengths)
        accepted_cat[name][category].extend(lengths)
        accepted_len[name][bucket].extend(lengths)
        accepted_src[name][source].extend(lengths)

    for file in shard_files:
        source = Path(file).parent.name
        shard = torch.load(file, weights_only=True)
        offsets = shard["offsets"].tolist()
        for j, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
            category = shard["categories"][j]
            prompts = shard.get("prompt_ids")
            bucket = "unknown" if prompts is None else context_bucket(len(prompts[j]))
            tokens = shard["tokens"][start:end].long()
            n = tokens.numel()
            topk_all = torch.empty(n, k, max_rank, dtype=torch.long)
            for rows_slice, logits in draft_logits_along(heads, shard, j, project, embed):
                topk_all[rows_slice] = logits.topk(max_rank, dim=-1).indices
                for i in range(k):
                    idx = torch.arange(rows_slice.start, rows_slice.stop)
                    valid = idx + i + 1 < n
                    if not valid.any():
                        continue
                    target = tokens[(idx + i + 1)[valid]]
                    cand = topk_all[idx[valid], i]
                    match = cand == target[:, None]
                    hits[i] += match.sum(0).float()
                    rows[i] += valid.sum()
                    for stats in (per_cat[category], per_len[bucket], per_src[source]):
                        stats[0, i] += match[:, 0].sum()
                        stats[1, i] += match[:, :5].any(-1).sum()
                        stats[2, i] += valid.sum()
                    if fit_temperatures and fitted_rows[i] < temperature_rows:  # a sample is enough for one scalar
                        fitted_rows[i] += int(valid.sum())
                        lg = logits[valid, i].float()
                        for t_idx, temp in enumerate(TEMPERATURE_GRID):
                            logp = torch.log_softmax(lg / temp, dim=-1).gather(-1, target[:, None])
                            # A draft vocabulary has no entry for some targets: fit on the rest.
                            nll[i, t_idx] -= logp[torch.isfinite(logp)].sum()
            hits_j, asked_j = conditional_hits(topk_all[:, :, 0], tokens)
            cond_hits += hits_j
            cond_asked += asked_j
            for name, shape in shapes.items():
                depth_idx = torch.tensor([d - 1 for d in shape.depths], dtype=torch.long)
                rank_idx = torch.tensor(shape.ranks, dtype=torch.long)
                node_tokens = topk_all[:, depth_idx, rank_idx]
                lengths = replay_tree(shape, node_tokens, tokens)
                record(name, lengths, category, bucket, source)
                if name == "chain" and "chain+lookup" in accepted:
                    context = np.asarray(list(shard["prompt_ids"][j]) + tokens.tolist())
                    first = len(shard["prompt_ids"][j])

                    def lookup(r, context=context, first=first):
                        return lookup_draft(context[:first + r + 1], min_n=prompt_lookup[0],
                                            max_n=prompt_lookup[1], k=len(shape))
                    lengths = replay_tree(shape, node_tokens, tokens, lookup)
                    record("chain+lookup", lengths, category, bucket, source)
            if grown:
                tree = dict(max_nodes=max_tree_nodes, top_k=defaults.dynamic_top_k,
                            min_path_prob=defaults.min_path_prob)
                grown_trees = (block_grown_trees_along(heads, shard, j, project, embed, **tree)
                               if heads.config.kind.keeps_context else
                               grown_trees_along(heads, shard["hidden"][start:end], tokens, project, embed, **tree))
                lengths = replay_trees(grown_trees.__getitem__, tokens)
                record("dynamic", lengths, category, bucket, source)
    rank_accuracy = (hits / rows.clamp_min(1)[:, None])
    summary = {
        "rows": int(rows[0].item()),
        "top1": [round(float(rank_accuracy[i, 0]), 4) for i in range(k)],
        "top5": [round(float(rank_accuracy[i, :5].sum()), 4) for i in range(k)],
        # The chance depth i is right when depths 1..i-1 were: what a chain multiplies.
        "conditional_top1": [round(float(cond_hits[i] / cond_asked[i].clamp_min(1)), 4) for i in range(k)],
        "rank_accuracy": [[round(float(v), 4) for v in rank_accuracy[i]] for i in range(k)],
        "mean_accepted_len": {name: round(sum(v) / max(len(v), 1), 4) for name, v in accepted.items()},
        "tree_nodes": {**{name: len(shape) for name, shape in shapes.items()},
                       **({"dynamic": max_tree_nodes} if grown else {})},
        "per_category": _per_group(per_cat, accepted_cat, k),
        "per_context_length": _per_group(per_len, accepted_len, k),
        "per_source": _per_group(per_src, accepted_src, k),
    }
    if fit_temperatures:
        summary["temperatures"] = [TEMPERATURE_GRID[int(nll[i].argmin())] for i in range(k)]
    return summary


def _per_group(stats_by_group: dict, accepted_by_group: dict, k: int) -> dict:
    return {
        group: {
            "rows": int(stats[2, 0]),
            "top1": [round(float(stats[0, i] / stats[2, i].clamp_min(1)), 4) for i in range(k)],
            "top5": [round(float(stats[1, i] / stats[2, i].clamp_min(1)), 4) for i in range(k)],
            "mean_accepted_len": {name: round(sum(v[group]) / max(len(v[group]), 1), 4)
                                  for name, v in accepted_by_group.items()},
        }
        for group, stats in sorted(stats_by_group.items())
    }
