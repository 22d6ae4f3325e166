"""What a training step computes, for each mode. Each module turns a batch from Ray Data
into (loss, metrics); the Ray Train loop around them is shared."""
from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn

from vllm_mtpspec.sequential_heads import example_chain_tokens
from vllm_mtpspec.shards import answer_sequence, unroll_sequences
from vllm_mtpspec_train.examples import shard_examples
from vllm_mtpspec_train.losses import kd_loss, mtp_losses
from vllm_mtpspec_train.online import batch_loss


def _head_metrics(losses) -> dict:
    return {**{f"ce_{i}": v for i, v in enumerate(losses.ce)}, **{f"kl_{i}": v for i, v in enumerate(losses.kl)}}


class PosthocModule(nn.Module):
    """Heads on the frozen target's recorded hidden states; batches are answer rows."""

    def __init__(self, heads, *, lm_head: torch.Tensor, embed: torch.Tensor, num_negatives: int, kl_weight: float,
                 depth_decay: float = 1.0) -> None:
        super().__init__()
        self.heads = heads
        self.register_buffer("lm_head", lm_head, persistent=False)
        self.register_buffer("embed", embed, persistent=False)
        self.num_negatives, self.kl_weight, self.depth_decay = num_negatives, kl_weight, depth_decay

    def trainable_parameters(self):
        return [p for p in self.heads.parameters() if p.requires_grad]

    def projection(self) -> torch.Tensor | list[torch.Tensor]:
        if self.heads.proj is None:
            return self.lm_head
        return [p.weight for p in self.heads.proj]

    def forward(self, batch: dict, generator=None):
        device = self.lm_head.device
        batch = {key: torch.as_tensor(value) for key, value in batch.items()}
        token = batch["token"].to(device).long()
        embeds = None
        if self.heads.config.kind.reads_drafted_tokens:  # each depth reads the answer's token before it
            embeds = self.embed[example_chain_tokens(token, batch["targets"].to(device), self.heads.num_heads)]
        elif self.heads.config.token_conditioned:
            embeds = self.embed[token]
        head_hidden = self.heads.hidden(batch["hidden"].to(device).float(), embeds)
        losses = mtp_losses(head_hidden, self.projection(), batch["targets"].to(device), batch["teacher_ids"].to(device),
                            batch["teacher_logprobs"].to(device), num_negatives=self.num_negatives,
                            kl_weight=self.kl_weight, depth_decay=self.depth_decay, generator=generator)
        return losses.total, {"loss": losses.total.item(), **_head_metrics(losses)}


class BlockModule(PosthocModule):
    """An attention draft block on the frozen target's recorded states. Batches name
    answers (shard path, answer index); each is read with the prompt rows before it, and
    every depth trains as drafting runs it (DraftBlock.unrolled: depth j reads depth
    j - 1's output and the answer's token there, the draft of a chain still right)."""

    def __init__(self, heads, *, lm_head: torch.Tensor, embed: torch.Tensor, num_negatives: int, kl_weight: float,
                 depth_decay: float = 1.0) -> None:
        super().__init__(heads, lm_head=lm_head, embed=embed, num_negatives=num_negatives, kl_weight=kl_weight,
                         depth_decay=depth_decay)
        # Answers come shuffled across all shards, so every shard stays open once read.
        # Memory-mapped: an answer reads only its own rows, and the page cache, not the
        # process, holds the rest (shards with extra layers' states run to ~10 GB in all,
        # more than this process may keep).
        self._shards: dict[str, dict] = {}

    def _shard(self, path: str) -> dict:
        if path not in self._shards:
            self._shards[path] = torch.load(path, weights_only=True, mmap=True)
        return self._shards[path]

    def forward(self, batch: dict, generator=None):
        device = self.lm_head.device
        k = self.heads.num_heads
        seqs, targets, t_ids, t_lp = [], [], [], []
        for path, j in zip(batch["path"], batch["answer"]):
            shard = self._shard(str(path))
            seq = answer_sequence(shard, int(j), self.heads.feature_layers)
            start, end = int(shard["offsets"][int(j)]), int(shard["offsets"][int(j) + 1])
            one = {"offsets": torch.tensor([0, end - start]), "tokens": shard["tokens"][start:end],
                   "topk_ids": shard["topk_ids"][start:end], "topk_logprobs": shard["topk_logprobs"][start:end],
                   "hidden": torch.zeros(end - start, 1)}
            ex = shard_examples(one, k)
            seq["answer_rows"] = seq["first_answer_row"] + torch.from_numpy(ex["position"])
            seqs.append(seq)
            targets.append(torch.from_numpy(ex["targets"]))
            t_ids.append(torch.from_numpy(ex["teacher_ids"]))
            t_lp.append(torch.from_numpy(ex["teacher_logprobs"]))
        stacked = unroll_sequences(self.heads, seqs, self.embed)            # [B, T, k, d]
        row_b = torch.cat([torch.full((len(s["answer_rows"]),), b) for b, s in enumerate(seqs)]).to(device)
        row_p = torch.cat([s["answer_rows"] for s in seqs]).to(device)
        losses = mtp_losses(self.heads.projection_input(stacked[row_b, row_p]), self.lm_head, torch.cat(targets).to(device),
                            torch.cat(t_ids).to(device), torch.cat(t_lp).to(device), num_negatives=self.num_negatives,
                            kl_weight=self.kl_weight, depth_decay=self.depth_decay, generator=generator)
        return losses.total, {"loss": losses.total.item(), **_head_metrics(losses)}


class OnlineBlockModule(PosthocModule):
    """An attention draft block on the rows its worker recorded itself (data_source "online",
    vllm_mtpspec_train/online.py). Batches are whole answers with their context rows, laid out
    by online.batch_examples on the rows' device; every depth unrolled as in BlockModule."""

    def forward(self, batch: dict, generator=None):
        losses = batch_loss(self.heads, batch, embed=self.embed, lm_head=self.lm_head,
                            num_negatives=self.num_negatives, kl_weight=self.kl_weight,
                            depth_decay=self.depth_decay, generator=generator)
        return losses.total, {"loss": losses.total.item(), **_head_metrics(losses)}


@lru_cache(maxsize=8)
def _load_shard(path: str) -> dict:
    return torch.load(path, weights_only=True)


class CotrainModule(nn.Module):
    """A student and its drafter on the teacher's answers: L = L_KD + lambda * sum_i L_MTP(i).
    Batches name answers (shard path, answer index); the student reads prompt + answer, and
    the drafter reads the student's states, so the MTP losses shape the student too.

    The two arms of co-training's comparison use the same module: mtp_weight 0 trains the
    student alone (the drafter is not run), and freeze_student trains the drafter alone on
    the frozen student's states (the post-hoc drafter of a distilled student)."""

    def __init__(self, student, heads, *, num_negatives: int, kl_weight: float, mtp_weight: float,
                 freeze_student: bool = False, depth_decay: float = 1.0) -> None:
        super().__init__()
        self.student, self.heads = student, heads
        self.num_negatives, self.kl_weight, self.mtp_weight = num_negatives, kl_weight, mtp_weight
        self.freeze_student, self.depth_decay = freeze_student, depth_decay
        if freeze_student:
            self.student.eval().requires_grad_(False)
        if mtp_weight == 0:  # not run, so not trained (nor counted by data-parallel gradient sync)
            self.heads.requires_grad_(False)

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    def forward(self, batch: dict, generator=None):
        device = next(self.student.parameters()).device
        answers = _cotrain_answers(batch, self.heads.num_heads)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.freeze_student):
            out = self.student.model(input_ids=answers["input_ids"].to(device),
                                     attention_mask=answers["mask"].to(device))
        states = out.last_hidden_state                                         # [B, T, d]
        row_b, row_p = answers["row_b"].to(device), answers["row_p"].to(device)
        hidden = states[row_b, row_p]                                          # [R, d]: answer rows
        lm_head = self.student.get_output_embeddings()
        metrics, total = {}, torch.zeros((), device=device)
        if not self.freeze_student:
            kd = kd_loss(lm_head(hidden), answers["kd_ids"].to(device), answers["kd_logprobs"].float().to(device),
                         torch.ones(hidden.shape[0], dtype=torch.bool, device=device))
            total, metrics["kd"] = total + kd, kd.item()
        if self.mtp_weight:
            embed = self.student.get_input_embeddings().weight
            if self.heads.config.kind.keeps_context:
                drafted = self.heads.projection_input(
                    self._block_states(states, answers, embed)[row_b, answers["row_q"].to(device)])
                projection = lm_head.weight
            else:
                drafted = self.heads.hidden(hidden, self._head_token_embeds(answers, embed))
                projection = lm_head.weight if self.heads.proj is None else [p.weight for p in self.heads.proj]
            losses = mtp_losses(drafted, projection, answers["targets"].to(device),
                                answers["teacher_ids"].to(device), answers["teacher_logprobs"].to(device),
                                num_negatives=self.num_negatives, kl_weight=self.kl_weight,
                                depth_decay=self.depth_decay, generator=generator)
            total = total + self.mtp_weight * losses.total
            metrics.update(mtp=losses.total.item(), **_head_metrics(losses))
        return total, {"loss": total.item(), **metrics}

    def _head_token_embeds(self, answers: dict, embed: torch.Tensor):
        device = embed.device
        if self.heads.config.kind.reads_drafted_tokens:  # each depth reads the answer's token before it
            return embed[example_chain_tokens(answers["tokens"], answers["targets"], self.heads.num_heads).to(device)]
        if self.heads.config.token_conditioned:
            return embed[answers["tokens"].to(device)]
        return None

    def _block_states(self, states: torch.Tensor, answers: dict, embed: torch.Tensor) -> torch.Tensor:
        """The draft block's chains at the answer rows (answers["query_rows"] [B, Q]): [B, Q, k, d].
        Row p is position p of prompt + answer, the state that predicts token p + 1; the
        block reads the whole prompt before the answer, as its cache holds it when drafting,
        but runs chains from the answer rows only (every row's would hold [B, T, T] scores
        per depth for backward: gigabytes for a long prompt)."""
        device, k = states.device, self.heads.num_heads
        input_ids, mask = answers["input_ids"].to(device), answers["mask"].to(device)
        t = states.shape[1] - 1
        tokens = torch.nn.functional.pad(input_ids[:, 1:], (0, k - 1))  # depth j reads s_{p+j}; 0 past the end
        token_embeds = [embed[tokens[:, i:i + t]] for i in range(k)]
        positions = torch.arange(t, device=device).expand(states.shape[0], t)
        return torch.stack(self.heads.unrolled(states[:, :-1], token_embeds, positions, mask[:, 1:].bool(),
                                               query_rows=answers["query_rows"].to(device)), 2)


def _cotrain_answers(batch: dict, num_heads: int) -> dict[str, torch.Tensor]:
    """The batch's answers as the student reads them: prompt + answer right-padded
    (input_ids, mask [B, T]), and at each answer row with all its depths' targets (the
    rows shard_examples keeps) its place (row_b, row_p: the position that predicts it;
    row_q: its place in query_rows [B, Q], its answer's row_p padded), its token, targets
    and the teacher's top-k there."""
    seqs, row_b, row_p, row_q = [], [], [], []
    columns: dict[str, list] = {key: [] for key in ("tokens", "targets", "teacher_ids", "teacher_logprobs", "kd_ids",
                                                   "kd_logprobs")}
    for path, j in zip(batch["path"], batch["answer"]):
        shard = _load_shard(str(path))
        j = int(j)
        start, end = int(shard["offsets"][j]), int(shard["offsets"][j + 1])
        prompt = list(shard["prompt_ids"][j])
        answer = shard["tokens"][start:end].long()
        one = {"offsets": torch.tensor([0, end - start]), "tokens": shard["tokens"][start:end],
               "topk_ids": shard["topk_ids"][start:end], "topk_logprobs": shard["topk_logprobs"][start:end],
               "hidden": torch.zeros(end - start, 1)}
        ex = shard_examples(one, num_heads)
        keep = torch.from_numpy(ex["position"])
        row_b.append(torch.full((len(keep),), len(seqs)))
        row_p.append(keep + len(prompt) - 1)  # answer row r is predicted from position len(prompt) + r - 1
        row_q.append(torch.arange(len(keep)))
        seqs.append(torch.tensor(prompt + answer.tolist()))
        columns["tokens"].append(answer[keep])
        columns["targets"].append(torch.from_numpy(ex["targets"]))
        columns["teacher_ids"].append(torch.from_numpy(ex["teacher_ids"]))
        # Log-probabilities in fp32: shards keep fp16, which autocast's cat refuses to mix.
        columns["teacher_logprobs"].append(torch.from_numpy(ex["teacher_logprobs"]).float())
        columns["kd_ids"].append(one["topk_ids"][keep])
        columns["kd_logprobs"].append(one["topk_logprobs"][keep].float())
    length = max(s.numel() for s in seqs)
    input_ids = torch.zeros(len(seqs), length, dtype=torch.long)
    mask = torch.zeros(len(seqs), length, dtype=torch.long)
    query_rows = torch.zeros(len(seqs), max(len(q) for q in row_q), dtype=torch.long)
    for b, s in enumerate(seqs):
        input_ids[b, : s.numel()], mask[b, : s.numel()] = s, 1
        query_rows[b, : len(row_q[b])] = row_p[b]
    return {"input_ids": input_ids, "mask": mask, "row_b": torch.cat(row_b), "row_p": torch.cat(row_p),
            "row_q": torch.cat(row_q), "query_rows": query_rows,
            **{key: torch.cat(value) for key, value in columns.items()}}
