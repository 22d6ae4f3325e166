"""MTPSpecProposer: the proposer vLLM builds for `method="custom_class"`.

vLLM calls load_model(target) once and propose(...) after every step. The hidden states
that produced each request's last sampled token arrive through capture_step, called by
the patched runner just before propose (hooks.py), together with which requests the
tree path may serve.

Drafts are the heads' candidates:
- chain: the top-1 token of each head, cut where the heads' own path probability falls
  below `min_path_prob`; vLLM's rejection sampler verifies it.
- consensus / static / dynamic trees: the tree's node tokens, breadth-first, with the
  same cut applied to every node's path probability. The shape is remembered per request
  (`proposed_trees`) so the runner can verify the tree next step (tree_step.py). A
  request the tree path cannot serve (fallback.py) gets the chain instead. Sequential
  heads grow their dynamic trees depth by depth from their own drafts (grown_tree.py).
- prompt lookup (lookup.py, when prompt_lookup_max is set): where the context's last
  tokens occurred before, what followed them is the request's draft, as a chain, and
  the heads are not run for it.
How much to draft is the draft-size rule's (draft_size.py): asked once before drafting,
told once after it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import cached_property
from typing import Any

import torch

from vllm_mtpspec.checkpoint import load_heads
from vllm_mtpspec.cohort import CohortPacer
from vllm_mtpspec.config import ConfigError
from vllm_mtpspec.copy_bias import copy_drafts
from vllm_mtpspec.draft_planner import Candidate, DraftPlanner
from vllm_mtpspec.draft_size import Allowance, Drafted, DraftSizeRule, StepView, draft_size_rule
from vllm_mtpspec.draft_vocab import SlicedLMHead
from vllm_mtpspec.lookup import lookup_draft
from vllm_mtpspec.model_profile import profile_of_hf_config
from vllm_mtpspec.quant.int8_dynamic import Int8Linear, int8_linears
from vllm_mtpspec.tree import TreeShape, chain_tree
from vllm_mtpspec.tree_builder import DraftTreeBuilder
from vllm_mtpspec.vllm.block_context import BlockContexts, ScheduledRows
from vllm_mtpspec.vllm.context_store import DEFAULT_CONTEXT_STORE_MB, ContextStore
from vllm_mtpspec.vllm.fallback import log_fallback_once
from vllm_mtpspec.vllm.hooks import install_layer_states_for
from vllm_mtpspec.vllm.logs import logger
from vllm_mtpspec.vllm.options import check_against_model, options_from_additional_config
from vllm_mtpspec.vllm.parallel import RankZeroDecision, tensor_parallel_group
from vllm_mtpspec.vllm.platform_defaults import (
    default_backoff_start,
    default_draft_size,
    draft_dtype,
    drafts_whole_vocabulary,
    int8_drafting,
    platform_blocker,
    sampled_chains_verifier,
)
from vllm_mtpspec.vllm.rows import last_sampled_rows
from vllm_mtpspec.vllm.tree_step import ProposedTree
from vllm_mtpspec.vllm.version import require_supported_vllm


class MTPSpecProposer:
    def __init__(self, vllm_config) -> None:
        require_supported_vllm()
        self.options = options_from_additional_config(vllm_config.additional_config)
        model_config = vllm_config.model_config
        # vLLM's budget of draft tokens per request and step: the chain length, or the
        # largest tree (hooks.py sets it to max_tree_nodes where the platform verifies trees).
        self.max_drafts = vllm_config.speculative_config.num_speculative_tokens
        hf_config = model_config.hf_text_config
        self._num_layers = getattr(hf_config, "num_hidden_layers", None)
        # Heads used per step (the tree's depth): as asked, else a chain as long as vLLM's
        # budget, else (trees) every head.
        wanted = self.options.num_speculative_tokens or (self.max_drafts if self.options.tree == "chain" else None)
        self.heads_config = check_against_model(
            self.options,
            num_speculative_tokens=wanted,
            model_path=model_config.model,
            hidden_size=hf_config.hidden_size,
            vocab_size=hf_config.vocab_size,
            num_layers=self._num_layers,
        )
        if (refusal := self.heads_config.kind.tree_refusal(self.options.tree)) is not None:
            raise ConfigError(f"{self.options.heads}/config.json: {refusal}, and tree={self.options.tree!r} was asked: "
                              "use tree='chain'" + (" or tree='dynamic'" if self.heads_config.kind.grows_trees else ""))
        self.depth = wanted or self.heads_config.num_heads
        self.model_path = model_config.model
        self._model_config = model_config
        self.profile = profile_of_hf_config(hf_config)
        if self.heads_config.feature_layers:  # before the runner builds the model (hooks.py says why)
            install_layer_states_for(self.profile.architecture)
        self.tied_target = self.profile.tied_embeddings
        self.dtype = model_config.dtype
        self.device = torch.device(vllm_config.device_config.device)
        self.int8_drafts = int8_drafting(self.options.draft_dtype, self.device, self.dtype,
                                         quantized=self.heads_config.quantization is not None)
        self.heads = None  # loaded with the target, in load_model
        self._chain_builder: DraftTreeBuilder | None = None  # built in load_model
        self._tree_builder: DraftTreeBuilder | None = None
        self.uses_trees = self.options.tree != "chain"
        if self.uses_trees and (reason := platform_blocker()):
            logger.warning("mtpspec: %s", reason)
            self.uses_trees = False
        logger.info("mtpspec: sampled requests' drafted chains are verified by %s",
                    {"vllm": "vLLM's rejection sampler", "mtpspec": "mtpspec's verifier (tree_sampler.py)"}[
                        sampled_chains_verifier()])
        # What was sent as each request's drafts, when it was a tree (read by the runner).
        self.proposed_trees: dict[str, ProposedTree] = {}
        # Set by the runner hook each step, consumed by propose.
        self._sample_hidden_states: torch.Tensor | None = None
        self._num_draft_tokens: list[int] | None = None
        self._req_ids: list[str] | None = None
        self._tree_paths: dict[int, list[int]] = {}
        self._tree_blocker: Callable[[int], str | None] | None = None
        self._is_sampled: Callable[[int], bool] | None = None
        self._budget: Callable[[int], tuple[int, int] | None] | None = None
        self._step_was_decode_only = False
        self._scheduled: ScheduledRows | None = None
        self.block_contexts: BlockContexts | None = None  # an attention draft block's caches (load_model)
        # The largest tree a step may send: the user's node budget within vLLM's.
        self.max_tree_budget = min(self.options.max_tree_nodes, self.max_drafts)
        self.draft_size_rule = self.options.draft_size_rule(default_draft_size())
        self.draft_size: DraftSizeRule = draft_size_rule(
            self.draft_size_rule, depth=self.depth, max_tree_budget=self.max_tree_budget,
            batch_backoff_start=self.options.batch_backoff_start or default_backoff_start(),
            pacing=self.options.pace_cohorts, log=lambda line: logger.info("mtpspec: draft planner: %s", line))
        # Read once: during a step the proposer asks the rule its two questions and nothing else.
        self._rule_on_rank_zero = self.draft_size.one_rank_decides
        logger.info("mtpspec: draft size %s: %s", self.draft_size_rule, self.draft_size.describe())

    @property
    def feature_layers(self) -> list[int]:
        """Target layers whose input states the draft block reads: vLLM is asked for them
        at load (hooks.install_layer_states_hook) and hands them over every step."""
        return self.heads_config.feature_layers

    # The draft-size rule's planner and cohort pacer, where it has them (read by tests and benchmarks).
    @property
    def planner(self) -> DraftPlanner | None:
        return getattr(self.draft_size, "planner", None)

    @property
    def pacer(self) -> CohortPacer | None:
        return getattr(self.draft_size, "pacer", None)

    @property
    def pacing(self) -> str:
        return getattr(self.draft_size, "pacing", "never")

    @property
    def paced_steps(self) -> int:
        return getattr(self.draft_size, "paced_steps", 0)

    def forget(self, req_id: str) -> None:
        """A request finished or was aborted: nothing of it is kept (but a draft block's
        entries, which the context store keeps for later requests with the same prefix)."""
        self.proposed_trees.pop(req_id, None)
        if self.block_contexts is not None:
            self.block_contexts.leave(req_id)
        self.draft_size.forget(req_id)

    def held_requests(self) -> set[str]:
        """The requests the proposer keeps any state for."""
        held = set(self.proposed_trees)
        if self.block_contexts is not None:
            held |= self.block_contexts.held_requests()
        return held | self.draft_size.held_requests()

    def load_model(self, target_model) -> None:
        if self.uses_trees:
            from vllm_mtpspec.vllm.hooks import tree_attention_blocker

            if reason := tree_attention_blocker(target_model, self._model_config):
                raise ConfigError(f"tree={self.options.tree!r} was asked, and this engine cannot verify trees: "
                                  f"{reason}. Use tree='chain'")
        self.draft_dtype = draft_dtype(self.options.draft_dtype, self.dtype,
                                       quantized=self.heads_config.quantization is not None)
        self.heads = load_heads(self.options.heads, device=self.device, dtype=self.draft_dtype,
                                target_layers=self._num_layers)
        # Heads tied to the target's LM head may draft over its whole vocabulary; heads with
        # a head of their own draft among its rows.
        own_head = not self.heads.config.tied
        if own_head and self.heads.draft_vocab is not None and self.options.draft_vocab == "full":
            raise ConfigError(f"draft_vocab='full' was asked, and the heads in {self.options.heads} draft through an "
                              f"LM head of their own over {self.heads.config.draft_vocab_size} tokens: leave "
                              "draft_vocab out")
        if self.heads.draft_vocab is not None and not own_head and drafts_whole_vocabulary(self.options.draft_vocab):
            self.heads = self.heads.with_draft_vocab(None)
        if self.int8_drafts:
            int8_linears(self.heads)
        self._temperatures = self.heads.temperatures.to(self.device)
        # Through the target's modules, never its weights: on the CPU they are repacked.
        # The heads' states reach the target's LM head in the model's dtype.
        compute_logits, model_dtype = target_model.compute_logits, self.dtype
        self._lm_head = lambda states: compute_logits(states.to(model_dtype))
        self._embed = getattr(target_model, "embed_input_ids", None) or target_model.get_input_embeddings
        if self.heads.config.kind.keeps_context:
            store_mb = self.options.context_store_mb
            store_mb = DEFAULT_CONTEXT_STORE_MB if store_mb is None else store_mb
            self.block_contexts = BlockContexts(self.heads, self._embed,
                                                ContextStore(store_mb << 20) if store_mb else None)
        elif self.options.context_store_mb is not None:
            raise ConfigError(f"context_store_mb={self.options.context_store_mb} keeps a draft block's entries, and "
                              f"the heads in {self.options.heads} are {self.heads.config.head_kind!r} heads, which "
                              "keep none: leave context_store_mb out")
        self._draft_ids = None
        if self.heads.draft_vocab is not None:
            self._draft_ids = self.heads.draft_vocab.to(self.device)
        if self.heads.draft_vocab is not None and not own_head:
            rows = draft_vocab_lm_head_rows(self._draft_ids, embed=self._embed, tied_target=self.tied_target,
                                            embed_scale=self.profile.embed_scale, model=self.model_path,
                                            heads_dir=self.options.heads)
            self._lm_head = (Int8Linear.from_weight(rows.to(self.device)) if self.int8_drafts
                             else SlicedLMHead(rows.to(self.device, self.draft_dtype)))
        if self.block_contexts is not None:
            with torch.no_grad():
                self.heads.prepare_drafting(None if self._draft_ids is None else self._embed(self._draft_ids))
        options = self.options
        builder = dict(min_path_prob=options.min_path_prob, dynamic_top_k=options.dynamic_top_k,
                       rank_accuracy=options.head_rank_accuracy or self.heads.config.rank_accuracy)
        self._chain_builder = DraftTreeBuilder("chain", self.depth, max_nodes=self.depth, **builder)
        if self.uses_trees:
            self._tree_builder = DraftTreeBuilder(options.tree, self.depth,
                                                  max_nodes=self.max_tree_budget, **builder)
        logger.info("mtpspec: loaded %s heads (%s, %s, drafting among %s tokens) from %s; drafting %s of depth %d",
                    self.heads.num_heads, "tied" if self.heads.config.tied else "untied",
                    ("int2, " if self.heads.is_quantized else "")
                    + ("drafting in int8" if self.int8_drafts else f"drafting in {self.draft_dtype}"),
                    self.heads.config.draft_vocab_size or f"all {self.heads.config.vocab_size}", self.options.heads,
                    self.options.tree if self.uses_trees else "chains", self.depth)

    @property
    def static_shape(self) -> TreeShape | None:
        """The fixed tree shape drafted (None for chains and dynamic trees)."""
        return None if self._tree_builder is None else self._tree_builder.static_shape

    def capture_step(self, sample_hidden_states: torch.Tensor, spec_decode_metadata, req_ids=None,
                     tree_paths: dict[int, list[int]] | None = None,
                     tree_blocker: Callable[[int], str | None] | None = None,
                     decode_only: bool = False, sampled: Callable[[int], bool] | None = None,
                     scheduled: ScheduledRows | None = None,
                     budget: Callable[[int], tuple[int, int] | None] | None = None) -> None:
        """tree_paths: for requests verified as trees, the rows (within the request) of
        the root and the accepted nodes, in path order. tree_blocker: by batch index, why a
        request must get a chain (or None). sampled: by batch index, whether a request
        samples (temperature > 0).
        decode_only: the step prefilled no prompt (so its time says what drafting cost).
        scheduled: the states of every token computed (an attention draft block reads them).
        budget: by batch index, a request's max_tokens and the tokens it has made (None
        without max_tokens)."""
        self._scheduled = scheduled
        self._step_was_decode_only = decode_only
        self._sample_hidden_states = sample_hidden_states
        self._num_draft_tokens = None if spec_decode_metadata is None else list(spec_decode_metadata.num_draft_tokens)
        self._req_ids = req_ids
        self._tree_paths = tree_paths or {}
        self._tree_blocker = tree_blocker
        self._is_sampled = sampled
        self._budget = budget

    @cached_property
    def _rank_zero(self) -> RankZeroDecision:
        # Resolved at the first drafted step: the worker's distributed state exists by then.
        return RankZeroDecision(tensor_parallel_group())

    def _ask_rule(self, ask: Callable[[], Any]) -> Any:
        """The draft-size rule's answer. A rule that decides from state one rank alone holds
        (the planner's clock) is asked on rank 0 only and every rank takes its answer
        (parallel.py); the other ranks' rules stay idle, since nothing is ever decided from
        what they would have learnt."""
        return self._rank_zero(ask) if self._rule_on_rank_zero else ask()

    @torch.inference_mode()
    def propose(self, sampled_token_ids, num_tokens_no_spec=None, token_ids_cpu=None, slot_mappings=None, **_) -> list[list[int]]:
        num_requests = len(sampled_token_ids)
        view = StepView(
            tuple(self._batch_ids(num_requests)), tuple(len(t) for t in sampled_token_ids),
            None if self._num_draft_tokens is None else tuple(self._num_draft_tokens),
            tuple(self._request_samples(i) for i in range(num_requests)), self._step_was_decode_only,
            None if self._budget is None else tuple(self._budget(i) for i in range(num_requests)))
        # Asked first thing: the step that just ended is timed up to here.
        allowance = self._ask_rule(lambda: self.draft_size.before_drafting(view))
        drafts, chains, drafted = self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, view, allowance)
        lengths = self._ask_rule(lambda: self.draft_size.after_drafting(drafted))
        for i, chain in chains.items():
            self._send_draft(i, chain_tree(lengths[i]), list(chain.tokens[:lengths[i]]), drafts, self._req_ids)
        return drafts

    def _propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, view: StepView, allowance: Allowance
                 ) -> tuple[list[list[int]], dict[int, Candidate], Drafted]:
        """The drafts within the allowance: trees already in place, chains by request still
        to be cut to the rule's lengths, and what the rule is told of them."""
        hidden_all = self._sample_hidden_states
        self._sample_hidden_states = None
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        req_ids = self._req_ids
        self._feed_block(req_ids, num_tokens_no_spec, token_ids_cpu, long_rest=allowance.long_rest)
        live = None if req_ids is None else set(req_ids)
        if live is not None:
            self.proposed_trees = {r: t for r, t in self.proposed_trees.items() if r in live}
        depth, budget = allowance.depth, allowance.tree_budget
        if hidden_all is None or depth == 0:
            return drafts, {}, Drafted(None)
        # The rule's own clock: what it compares drafting against is timed by it too.
        clock = self.draft_size.clock
        proposing_started = clock()
        pairs = last_sampled_rows(sampled_token_ids, self._num_draft_tokens, hidden_all.shape[0],
                                  {i: path[-1] for i, path in self._tree_paths.items()})
        if allowance.may_draft is not None:
            pairs = [(i, row) for i, row in pairs if allowance.may_draft[i]]
        if not pairs:
            return drafts, {}, Drafted(None)
        owners = [i for i, _ in pairs]
        # Where the context repeats, its continuation is the draft and the heads are not
        # run at all (no LM-head projection for that request).
        chains = {j: Candidate("lookup", view.sampled[owners[j]], len(tokens), tokens=tuple(tokens))
                  for j, tokens in self._lookup_drafts(owners, depth, num_tokens_no_spec, token_ids_cpu).items()}
        head_owners = [j for j in range(len(owners)) if j not in chains]
        heads_needed = bool(head_owners)
        if not allowance.heads:
            head_owners = []
        drafting_started = clock()
        if head_owners:
            tree_rows = [n for n, j in enumerate(head_owners) if self._tree_allowed(owners[j], req_ids)]
            on_tree = set(tree_rows)
            chain_rows = [n for n in range(len(head_owners)) if n not in on_tree]
            if self.block_contexts is not None:
                drafted = [owners[j] for j in head_owners]
                chained = [drafted[n] for n in chain_rows]
                chain_probs = self.block_contexts.chain_probs(
                    chained, req_ids, depth, self._lm_head, self._temperatures, self._draft_ids,
                    self._copy_drafts(chained, depth, num_tokens_no_spec, token_ids_cpu)) if chain_rows else None
                trees = self._block_trees([drafted[n] for n in tree_rows], req_ids, depth,
                                          budget) if tree_rows else []
            elif self.heads.config.kind.grows_trees:
                # Each tree node's children come from its own draft step (grown_tree.py).
                chain_probs = (self._head_probs(hidden_all, [pairs[head_owners[n]] for n in chain_rows],
                                                sampled_token_ids, depth) if chain_rows else None)
                trees = self._grown_trees(hidden_all, [pairs[head_owners[n]] for n in tree_rows], sampled_token_ids,
                                          depth, budget) if tree_rows else []
            else:
                probs = self._head_probs(hidden_all, [pairs[j] for j in head_owners], sampled_token_ids, depth)
                chain_probs = probs[chain_rows]
                trees = self._tree_builder.build(probs[tree_rows], budget=budget,
                                                 token_ids=self._draft_ids) if tree_rows else []
            chains_built = self._chain_builder.chains(chain_probs, token_ids=self._draft_ids) if chain_rows else []
            for n, (tokens, path) in zip(chain_rows, chains_built):
                j = head_owners[n]
                chains[j] = Candidate("heads", view.sampled[owners[j]], len(tokens), tuple(path), tuple(tokens))
            for n, (shape, tokens) in zip(tree_rows, trees):
                i = owners[head_owners[n]]
                self._send_draft(i, *self._tree_within_budget(i, shape, list(tokens)), drafts, req_ids)
        chains = self._within_budgets(chains, owners)
        drafting_seconds = clock() - drafting_started if head_owners else 0.0
        by_request = {owners[j]: chain for j, chain in chains.items()}
        offered = tuple(by_request.get(i) for i in range(len(sampled_token_ids)))
        return drafts, by_request, Drafted(offered, heads_needed, drafting_seconds, clock() - proposing_started)

    def _room(self, batch_index: int) -> int | None:
        """How deep a request's drafts can still be kept (None: no max_tokens). The next
        step emits one token whatever is kept, so a request that has made `made` of its
        max_tokens can keep at most max_tokens - made - 1 drafts; vLLM verifies any further
        ones for nothing (its scheduler does not cut drafts at max_tokens). Where vLLM's
        async scheduling counts drafts not yet verified among those made, the cut comes
        early: a few drafts fewer at a request's end, never a different token."""
        budget = None if self._budget is None else self._budget(batch_index)
        return None if budget is None else max(budget[0] - budget[1] - 1, 0)

    def _within_budgets(self, chains: dict[int, Candidate], owners: list[int]) -> dict[int, Candidate]:
        """Each chain cut to the depth its request may still keep (_room)."""
        cut = {}
        for j, chain in chains.items():
            room = self._room(owners[j])
            cut[j] = chain if room is None or room >= chain.length else dataclasses.replace(chain, length=room)
        return cut

    def _tree_within_budget(self, batch_index: int, shape: TreeShape, tokens: list[int]
                            ) -> tuple[TreeShape, list[int]]:
        """A tree cut to the depth its request may still keep (_room): its upper levels,
        breadth-first still, each node with its token."""
        room = self._room(batch_index)
        if room is None:
            return shape, tokens
        return shape.limit_depth(room), [token for path, token in zip(shape.paths, tokens) if len(path) <= room]

    def _feed_block(self, req_ids, num_tokens_no_spec, token_ids_cpu, *, long_rest: bool) -> None:
        """Every step, drafted or not: the draft block takes the accepted rows (block_context.py);
        in a long rest it keeps only each request's latest ones."""
        scheduled, self._scheduled = self._scheduled, None
        if self.block_contexts is None:
            return
        if scheduled is None or req_ids is None or num_tokens_no_spec is None or token_ids_cpu is None:
            raise RuntimeError("an attention draft block needs every step's hidden states and token ids from the "
                               "runner hook (hooks.py), and this step had none")
        self.block_contexts.update(req_ids, scheduled, num_tokens_no_spec, token_ids_cpu, self._tree_paths,
                                   long_rest=long_rest)

    def _batch_ids(self, num_requests: int) -> list[str]:
        return list(self._req_ids) if self._req_ids is not None else [str(i) for i in range(num_requests)]

    def _request_samples(self, batch_index: int) -> bool:
        return self._is_sampled is not None and bool(self._is_sampled(batch_index))

    @staticmethod
    def _roots(hidden_all: torch.Tensor, pairs: list[tuple[int, int]], sampled_token_ids):
        """(request, row) pairs -> the states [B, d] the heads read and the sampled tokens [B]."""
        hidden = hidden_all[torch.tensor([row for _, row in pairs], device=hidden_all.device)]
        return hidden, torch.tensor([sampled_token_ids[i][-1] for i, _ in pairs], device=hidden.device)

    def _head_probs(self, hidden_all: torch.Tensor, pairs: list[tuple[int, int]], sampled_token_ids,
                    depth: int) -> torch.Tensor:
        """(request, row) pairs -> the heads' temperature-scaled probabilities [B, depth, V]
        (V: the draft vocabulary's N entries where the heads have one)."""
        hidden, token_ids = self._roots(hidden_all, pairs, sampled_token_ids)
        embeds = self._embed(token_ids) if self.heads.config.token_conditioned else None
        logits = self.heads.draft_logits(hidden, embeds, depth, self._lm_head, self._embed, self._draft_ids)
        return torch.softmax(logits.float() / self._temperatures[:depth, None], dim=-1)  # [B, depth, V]

    def _grown_trees(self, hidden_all: torch.Tensor, pairs: list[tuple[int, int]], sampled_token_ids, depth: int,
                     budget: int) -> list[tuple[TreeShape, list[int]]]:
        """(request, row) pairs -> each request's dynamic tree, grown depth by depth by heads
        whose deeper drafts read their own guesses (grown_tree.py)."""
        hidden, token_ids = self._roots(hidden_all, pairs, sampled_token_ids)
        step = self.heads.draft_step(self._lm_head, self._embed, self._temperatures)
        return self._tree_builder.grow(step, hidden, token_ids, depth=depth, budget=budget, token_ids=self._draft_ids)

    def _block_trees(self, batch_indices: list[int], req_ids, depth: int,
                     budget: int) -> list[tuple[TreeShape, list[int]]]:
        """The requests' dynamic trees, grown depth by depth by the draft block from each
        one's newest accepted position (DraftBlock.tree_step)."""
        newest, step = self.block_contexts.tree_step(batch_indices, req_ids, self._lm_head, self._temperatures,
                                                     self._draft_ids)
        roots = torch.zeros(len(batch_indices), dtype=torch.long, device=newest.device)  # the block's state holds them
        return self._tree_builder.grow(step, newest, roots, depth=depth, budget=budget, token_ids=self._draft_ids)

    def _send_draft(self, batch_index: int, shape: TreeShape, tokens: list[int], drafts, req_ids) -> None:
        drafts[batch_index] = tokens
        if req_ids is None:
            return
        if tokens and self._blocker(batch_index) is None:  # a tree, or a chain our verifier may check
            self.proposed_trees[req_ids[batch_index]] = ProposedTree(shape, tuple(tokens))
        else:
            self.proposed_trees.pop(req_ids[batch_index], None)

    def _lookup_drafts(self, owners: list[int], depth: int, num_tokens, token_ids) -> dict[int, list[int]]:
        """Prompt-lookup drafts (lookup.py) by position in owners, where the context has one."""
        max_n = self.options.prompt_lookup_max
        if not max_n or token_ids is None or num_tokens is None:
            return {}
        found = {}
        for j, i in enumerate(owners):
            draft = lookup_draft(token_ids[i, :num_tokens[i]], min_n=self.options.prompt_lookup_min, max_n=max_n, k=depth)
            if draft:
                found[j] = draft
        return found

    def _copy_drafts(self, batch_indices: list[int], depth: int, num_tokens, token_ids):
        """The copy bias's continuations for these requests' chains (copy_bias.py), or None
        where the block has no copy bias. Built on the host from the token ids vLLM keeps
        there, then copied to the device once."""
        biases = self.heads.config.copy_bias
        if not biases or token_ids is None or num_tokens is None:
            return None
        contexts = [token_ids[i, :num_tokens[i]] for i in batch_indices]
        return copy_drafts(contexts, depth, biases, self.device)

    def _blocker(self, batch_index: int) -> str | None:
        return None if self._tree_blocker is None else self._tree_blocker(batch_index)

    def _tree_allowed(self, batch_index: int, req_ids) -> bool:
        if not self.uses_trees or req_ids is None:
            return False
        blocker = self._blocker(batch_index)
        if blocker is not None:
            log_fallback_once(blocker)
            return False
        return True


def draft_vocab_lm_head_rows(draft_ids: torch.Tensor, *, embed: Callable[[torch.Tensor], torch.Tensor],
                             tied_target: bool, embed_scale: float, model: str, heads_dir: str) -> torch.Tensor:
    """The [N, d] rows of the target's LM head for the draft vocabulary's ids. A tied
    target's LM head is its input embedding, read through the loaded embedding module:
    whatever vLLM loaded the weights from (a hub id, any load format), and on every
    tensor-parallel rank all N rows (the vocab-parallel embedding gathers them). Its LM-head
    weight itself may be repacked on the CPU. The module scales its rows where the model
    does (Gemma: sqrt(d)); the LM head's rows are the unscaled ones. An untied target's
    rows come from its files."""
    if tied_target:
        with torch.no_grad():
            rows = embed(draft_ids).detach()
        return rows / embed_scale if embed_scale != 1.0 else rows
    return draft_vocab_lm_head_weight(model, heads_dir)[draft_ids.cpu()]


def draft_vocab_lm_head_weight(model: str, heads_dir: str) -> torch.Tensor:
    """The target's [V, d] LM head from its files: a local folder, or a hub id vLLM has
    already downloaded into the Hugging Face cache."""
    from pathlib import Path

    from vllm_mtpspec.checkpoint import HeadsError
    from vllm_mtpspec.weights import embedding_and_lm_head

    folder = Path(model)
    if not (folder / "config.json").is_file():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(model, local_files_only=True))
        except Exception as err:  # not a hub id, or not in the cache
            raise HeadsError(f"{heads_dir}/config.json: draft_vocab_size is set, and its LM-head rows are read from "
                             f"the model's files, but {model!r} is neither a local model folder nor in the Hugging "
                             f"Face cache ({type(err).__name__}); serve a local folder, or use heads without a "
                             "draft vocabulary") from None
    return embedding_and_lm_head(folder)[1]
