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
        if self.heads.config.head_kind == "sequential":  # each depth reads the answer's token before it
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
        losses = mtp_losses(stacked[row_b, row_p], self.lm_head, torch.cat(targets).to(device),
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
    """A student and its heads on the teacher's answers: L = L_KD + lambda * sum_i L_MTP(i).
    Batches name answers (shard path, answer index); the student reads prompt + answer."""

    def __init__(self, student, heads, *, num_negatives: int, kl_weight: float, mtp_weight: float) -> None:
        super().__init__()
        self.student, self.heads = student, heads
        self.num_negatives, self.kl_weight, self.mtp_weight = num_negatives, kl_weight, mtp_weight

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    def forward(self, batch: dict, generator=None):
        device = next(self.student.parameters()).device
        k = self.heads.num_heads
        seqs, rows, row_answer = [], [], []
        targets, t_ids, t_lp, kd_ids, kd_lp, tokens = [], [], [], [], [], []
        for path, j in zip(batch["path"], batch["answer"]):
            shard = _load_shard(str(path))
            j = int(j)
            start, end = int(shard["offsets"][j]), int(shard["offsets"][j + 1])
            prompt = list(shard["prompt_ids"][j])
            answer = shard["tokens"][start:end].long()
            seqs.append(torch.tensor(prompt + answer.tolist()))
            # Answer row r is predicted from sequence position len(prompt) + r - 1.
            rows.append(torch.arange(end - start) + len(prompt) - 1)
            one = {"offsets": torch.tensor([0, end - start]), "tokens": shard["tokens"][start:end],
                   "topk_ids": shard["topk_ids"][start:end], "topk_logprobs": shard["topk_logprobs"][start:end],
                   "hidden": torch.zeros(end - start, 1)}
            ex = shard_examples(one, k)
            keep = torch.from_numpy(ex["position"])
            row_answer.append(torch.full((len(keep),), len(seqs) - 1))
            rows[-1] = rows[-1][keep]
            targets.append(torch.from_numpy(ex["targets"]))
            t_ids.append(torch.from_numpy(ex["teacher_ids"]))
            t_lp.append(torch.from_numpy(ex["teacher_logprobs"]))
            tokens.append(answer[keep])
            kd_ids.append(shard["topk_ids"][start:end][keep])
            kd_lp.append(shard["topk_logprobs"][start:end][keep])
        length = max(s.numel() for s in seqs)
        input_ids = torch.zeros(len(seqs), length, dtype=torch.long)
        mask = torch.zeros(len(seqs), length, dtype=torch.long)
        for b, s in enumerate(seqs):
            input_ids[b, : s.numel()], mask[b, : s.numel()] = s, 1
        out = self.student.model(input_ids=input_ids.to(device), attention_mask=mask.to(device))
        row_b = torch.cat(row_answer).to(device)
        row_p = torch.cat(rows).to(device)
        hidden = out.last_hidden_state[row_b, row_p]                           # [R, d]
        lm_head = self.student.get_output_embeddings()
        student_logits = lm_head(hidden)                                       # [R, V]
        kd = kd_loss(student_logits, torch.cat(kd_ids).to(device), torch.cat(kd_lp).float().to(device),
                     torch.ones(hidden.shape[0], dtype=torch.bool, device=device))
        embed = self.student.get_input_embeddings()
        embeds = None
        if self.heads.config.head_kind == "sequential":
            embeds = embed(example_chain_tokens(torch.cat(tokens), torch.cat(targets), k).to(device))
        elif self.heads.config.token_conditioned:
            embeds = embed(torch.cat(tokens).to(device))
        head_hidden = self.heads.hidden(hidden, embeds)
        projection = lm_head.weight if self.heads.proj is None else [p.weight for p in self.heads.proj]
        losses = mtp_losses(head_hidden, projection, torch.cat(targets).to(device), torch.cat(t_ids).to(device),
                            torch.cat(t_lp).to(device), num_negatives=self.num_negatives, kl_weight=self.kl_weight,
                            generator=generator)
        total = kd + self.mtp_weight * losses.total
        return total, {"loss": total.item(), "kd": kd.item(), "mtp": losses.total.item(), **_head_metrics(losses)}
