"""Train an attention draft block on one GPU, straight from the answer files.

The Ray job (vllm_mtpspec_train/train.py) reads training shards that a CPU pass wrote to disk, 1-5 KB
a row. On a GPU the frozen target's teacher-forced pass over every prompt and answer token
takes about a minute and all rows fit in the GPU's memory, so this path keeps them there and
writes no shards: one batched pass records each kept row's final state (and the states
entering block.feature_layers), the token it produced and, at answer rows, the target's
top-k; then the block trains on whole answers read with up to `--context-rows` prompt rows
before each, every depth unrolled as drafting runs it (DraftBlock.unrolled, the same
examples and losses as the Ray job's BlockModule), for a wall-clock budget, its learning
rate decaying with the time spent. The held-out answers are scored before and after.

    python -m vllm_mtpspec_train.block_gpu --init-from data/heads/smollm2-135m-instruct-block-v1-layers \\
        --answers data/self-distilled/smollm2-135m-instruct/train,... --seconds 300 --out runs/block-v2

The heads written are the block's weights in fp16 with the init's temperatures;
`python -m vllm_mtpspec_train.export` (on the CPU, against held-out shards) fits the temperatures and
rank accuracies that serving reads.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_mtpspec.answers import list_answer_files, read_answers
from vllm_mtpspec.layer_states import recording_layer_inputs
from vllm_mtpspec.models import resolve_model
from vllm_mtpspec_train.losses import mtp_losses

logger = logging.getLogger("mtpspec.block_gpu")

FINISH_RESERVE_S = 45  # scoring the held-out answers and writing the heads, after training


@dataclass
class RowStore:
    """Every kept row of a set of answers, packed: answer a's rows are start[a] ..
    start[a] + context[a] - 1 (prompt rows, the last `context_rows` before the answer) then
    length[a] answer rows. Row p's token is the one its state produced (s_{p+1})."""
    features: torch.Tensor              # [R, d] fp16, the target's final (normed) state
    layer_features: torch.Tensor | None  # [R, n, d] fp16, the states entering feature_layers
    tokens: torch.Tensor                # [R] long
    positions: torch.Tensor             # [R] long, the row's place in prompt + answer
    topk_ids: torch.Tensor              # [R, K] int32 (-1 outside answers)
    topk_logprobs: torch.Tensor         # [R, K] fp16
    start: torch.Tensor                 # [A] long, on the store's device
    context: list[int]                  # [A] on the host: batching reads them
    length: list[int]

    @property
    def num_answers(self) -> int:
        return len(self.context)


def read_answer_dirs(dirs: list[str], *, fingerprint: str | None, vocab_size: int,
                     max_answers: int | None = None) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) of every answer in the folders' answer files, in order."""
    pairs: list[tuple[list[int], list[int]]] = []
    for folder in dirs:
        files = list_answer_files(folder)
        if not files:
            raise FileNotFoundError(f"{folder}: no answer files (answers-*.npz); pass folders that "
                                    "`python -m vllm_mtpspec_train.data --answers-only` wrote")
        for path in files:
            kept = read_answers(path, fingerprint=fingerprint, vocab_size=vocab_size)
            pairs += [(p, a) for p, a in zip(kept["prompt_ids"], kept["answers"]) if len(a) >= 2 and len(p) >= 1]
            if max_answers is not None and len(pairs) >= max_answers:
                return pairs[:max_answers]
    return pairs


def _length_batches(lengths: list[int], batch_tokens: int, order: list[int]) -> list[list[int]]:
    """Consecutive items of `order` grouped while (items x the longest) stays within batch_tokens."""
    batches, current, longest = [], [], 0
    for i in order:
        longest_if = max(longest, lengths[i])
        if current and longest_if * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest_if = [], lengths[i]
        current.append(i)
        longest = longest_if
    if current:
        batches.append(current)
    return batches


@torch.inference_mode()
def record_rows(model, pairs, *, context_rows: int, feature_layers: list[int], top_k: int, batch_tokens: int,
                device: torch.device) -> RowStore:
    """The frozen target read along every (prompt, answer): right-padded batches of similar
    length, one pass each. Row states are what vllm_mtpspec_train.answers.teacher_forced records."""
    decoder = model.get_decoder()
    lm_head = model.get_output_embeddings().weight
    d = lm_head.shape[1]
    context = [min(context_rows, len(p) - 1) for p, _ in pairs]
    length = [len(a) for _, a in pairs]
    kept = [c + n for c, n in zip(context, length)]
    start = [0]
    for n in kept:
        start.append(start[-1] + n)
    total = start[-1]
    store = RowStore(
        features=torch.empty(total, d, dtype=torch.float16, device=device),
        layer_features=(torch.empty(total, len(feature_layers), d, dtype=torch.float16, device=device)
                        if feature_layers else None),
        tokens=torch.empty(total, dtype=torch.long, device=device),
        positions=torch.empty(total, dtype=torch.long, device=device),
        topk_ids=torch.full((total, top_k), -1, dtype=torch.int32, device=device),
        topk_logprobs=torch.full((total, top_k), float("-inf"), dtype=torch.float16, device=device),
        start=torch.tensor(start[:-1], dtype=torch.long, device=device), context=context, length=length)
    full = [len(p) + len(a) for p, a in pairs]
    order = sorted(range(len(pairs)), key=lambda i: full[i])
    bar = tqdm(total=sum(full), desc="target states", unit="tok", unit_scale=True, mininterval=5)
    for batch in _length_batches(full, batch_tokens, order):
        width = max(full[i] for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for b, i in enumerate(batch):
            ids[b, :full[i]] = torch.tensor(pairs[i][0] + pairs[i][1])
            mask[b, :full[i]] = 1
        ids, mask = ids.to(device), mask.to(device)
        with recording_layer_inputs(decoder, feature_layers, whole_batch=True) as entering:
            states = decoder(input_ids=ids, attention_mask=mask).last_hidden_state
        for b, i in enumerate(batch):
            first = len(pairs[i][0]) - 1                      # the row behind answer token 0
            rows = slice(first - context[i], first + length[i])
            out = slice(start[i], start[i] + kept[i])
            store.features[out] = states[b, rows].half()
            if feature_layers:
                store.layer_features[out] = torch.stack([entering[layer][b, rows] for layer in feature_layers], 1).half()
            store.tokens[out] = ids[b, rows.start + 1:rows.stop + 1]
            store.positions[out] = torch.arange(rows.start, rows.stop, device=device)
            answer_rows = slice(start[i] + context[i], start[i] + kept[i])
            logprobs = torch.log_softmax((states[b, first:first + length[i]] @ lm_head.T).float(), -1)
            top_lp, top_ids = logprobs.topk(top_k, dim=-1)
            store.topk_ids[answer_rows], store.topk_logprobs[answer_rows] = top_ids.int(), top_lp.half()
        bar.update(sum(full[i] for i in batch))
    bar.close()
    return store


def batch_examples(store: RowStore, answers: list[int], depth: int) -> dict[str, torch.Tensor]:
    """Answers as one right-padded batch for DraftBlock.unrolled, with the answers' rows as
    query_rows and the loss rows among them: every answer row that has a next token, its
    targets at depths 1..depth (the answer's tokens 1..depth ahead, -1 past its end) and the
    target's top-k there (what vllm_mtpspec_train.examples gives the Ray job's BlockModule)."""
    device = store.features.device
    n = torch.tensor([store.context[a] + store.length[a] for a in answers], device=device)
    t = max(store.context[a] + store.length[a] for a in answers)
    q = max(store.length[a] for a in answers)
    start = store.start[torch.tensor(answers, device=device)]
    context = torch.tensor([store.context[a] for a in answers], device=device)
    length = torch.tensor([store.length[a] for a in answers], device=device)
    cols = torch.arange(t + depth - 1, device=device)
    rows = start[:, None] + cols                                              # [B, T + depth - 1]
    inside = cols < n[:, None]
    rows = torch.where(inside, rows, 0)
    valid = inside[:, :t]
    answer_row = torch.arange(q, device=device)                               # [Q]: r, the answer's row
    batch = {
        "features": store.features[rows[:, :t]].float(),
        "tokens": torch.where(inside, store.tokens[rows], 0),
        "positions": torch.where(valid, store.positions[rows[:, :t]], 0),
        "valid": valid,
        "query_rows": (context[:, None] + answer_row).clamp_max(t - 1),       # [B, Q]
    }
    if store.layer_features is not None:
        batch["layer_features"] = store.layer_features[rows[:, :t]].float()
    loss_b, loss_r = torch.nonzero(answer_row < length[:, None] - 1, as_tuple=True)
    ahead = torch.arange(1, depth + 1, device=device)
    has = loss_r[:, None] + ahead < length[loss_b][:, None]                   # [R, depth]
    target_rows = torch.where(has, start[loss_b][:, None] + context[loss_b][:, None] + loss_r[:, None] + ahead, 0)
    batch.update(
        loss_b=loss_b, loss_r=loss_r,
        targets=torch.where(has, store.tokens[target_rows], -1),
        teacher_ids=torch.where(has[..., None], store.topk_ids[target_rows], -1),
        teacher_logprobs=torch.where(has[..., None], store.topk_logprobs[target_rows].float(), float("-inf")),
    )
    return batch


def unrolled_states(block, batch: dict, embed: torch.Tensor) -> torch.Tensor:
    """[B, Q, k, d]: the chains of the batch's query rows (vllm_mtpspec.shards.unroll_sequences,
    at the answers' rows only)."""
    t = batch["features"].shape[1]
    token_embeds = [embed[batch["tokens"][:, i:i + t]] for i in range(block.num_heads)]
    return torch.stack(block.unrolled(batch["features"], token_embeds, batch["positions"], batch["valid"],
                                      batch.get("layer_features"), query_rows=batch["query_rows"]), 2)


def batch_loss(block, batch: dict, *, embed, lm_head, num_negatives: int, kl_weight: float, depth_decay: float,
               generator=None):
    states = unrolled_states(block, batch, embed)
    return mtp_losses(states[batch["loss_b"], batch["loss_r"]], lm_head, batch["targets"], batch["teacher_ids"],
                      batch["teacher_logprobs"], num_negatives=num_negatives, kl_weight=kl_weight,
                      depth_decay=depth_decay, generator=generator)


@torch.no_grad()
def score(block, store: RowStore, *, embed, lm_head, batch_tokens: int) -> dict:
    """Teacher-forced on the store's answers: per-depth top-1 and conditional top-1 (the
    chance depth i is right when depths 1..i-1 were), over the whole vocabulary, and the
    chain's expected accepted length 1 + a1 + a1 a2 + ... for k = 1..depth."""
    from vllm_mtpspec_train.evaluate import chain_hits

    k = block.num_heads
    device = store.features.device
    hits, asked, right, rows = (torch.zeros(k, device=device) for _ in range(4))
    lengths = [c + n for c, n in zip(store.context, store.length)]
    order = sorted(range(store.num_answers), key=lambda a: lengths[a])
    for answers in _length_batches(lengths, batch_tokens, order):
        batch = batch_examples(store, answers, k)
        states = unrolled_states(block, batch, embed)[batch["loss_b"], batch["loss_r"]]   # [R, k, d]
        top1 = (states.float() @ lm_head.T).argmax(-1)                                     # [R, k]
        targets = batch["targets"]
        batch_hits, batch_asked = chain_hits(top1, targets)
        hits, asked = hits + batch_hits, asked + batch_asked
        right += ((top1 == targets) & (targets >= 0)).sum(0)
        rows += (targets >= 0).sum(0)
    hits, asked, right, rows = hits.cpu(), asked.cpu(), right.cpu(), rows.cpu()
    conditional = (hits / asked.clamp_min(1)).tolist()
    chain_length, product = [1.0], 1.0
    for a in conditional:
        product *= a
        chain_length.append(chain_length[-1] + product)
    return {"rows": int(rows[0]), "top1": [round(x, 4) for x in (right / rows.clamp_min(1)).tolist()],
            "conditional_top1": [round(x, 4) for x in conditional],
            "expected_chain_accepted": [round(x, 4) for x in chain_length[1:]]}


def train(block, store: RowStore, *, embed, lm_head, seconds: float, batch_tokens: int, lr: float,
          warmup_steps: int, num_negatives: int, kl_weight: float, depth_decay: float, seed: int,
          log_every: int = 25, log=None) -> dict:
    """Epochs over the store's answers (batches of similar length, shuffled) until `seconds`
    have passed; the learning rate warms up, then falls linearly with the time spent."""
    device = store.features.device
    params = [p for p in block.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=device.type == "cuda")
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    rng = random.Random(seed)
    lengths = [c + n for c, n in zip(store.context, store.length)]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    started, step, answers_seen, skipped = time.perf_counter(), 0, 0, 0
    bar = tqdm(total=int(seconds), desc="training the block", unit="s", mininterval=5)
    block.train()
    done = False
    while not done:
        # Sorted by a jittered length: batches of near-equal lengths, different each epoch.
        order = sorted(range(store.num_answers), key=lambda a: lengths[a] * (1 + 0.2 * rng.random()))
        batches = _length_batches(lengths, batch_tokens, order)
        rng.shuffle(batches)
        for answers in batches:
            spent = time.perf_counter() - started
            if spent >= seconds:
                done = True
                break
            for group in optimizer.param_groups:
                group["lr"] = lr * min(1.0, (step + 1) / warmup_steps) * max(0.05, 1 - spent / seconds)
            batch = batch_examples(store, answers, block.num_heads)
            optimizer.zero_grad(set_to_none=True)
            try:
                with autocast:
                    losses = batch_loss(block, batch, embed=embed, lm_head=lm_head, num_negatives=num_negatives,
                                        kl_weight=kl_weight, depth_decay=depth_decay, generator=generator)
                losses.total.backward()
            except torch.OutOfMemoryError:
                # One batch too large for what the rows leave free: skip it, say so, go on.
                del batch
                optimizer.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                skipped += 1
                logger.warning("batch of %d answers (longest %d rows) did not fit in memory; skipped",
                               len(answers), max(lengths[a] for a in answers))
                continue
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
            answers_seen += len(answers)
            bar.n = min(int(time.perf_counter() - started), int(seconds))
            bar.set_postfix(step=step, epoch=answers_seen // store.num_answers, loss=f"{losses.total.item():.3f}")
            if log is not None and (step % log_every == 0 or step == 1):
                log({"step": step, "epochs": round(answers_seen / store.num_answers, 3),
                     "seconds": round(time.perf_counter() - started, 1), "loss": losses.total.item(),
                     "lr": optimizer.param_groups[0]["lr"],
                     **{f"ce_{i}": v for i, v in enumerate(losses.ce)}})
    bar.close()
    block.eval()
    return {"steps": step, "epochs": round(answers_seen / store.num_answers, 2),
            "seconds": round(time.perf_counter() - started, 1), "batches_skipped": skipped}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_mtpspec_train.block_gpu",
        description="Train an attention draft block on one GPU from answer files, with the frozen target's "
                    "states held in GPU memory (no shards on disk), for a wall-clock budget.")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the target: a known name or an HF folder")
    parser.add_argument("--init-from", required=True,
                        help="the attention block to train further (heads directory; fixes its shape and layers)")
    parser.add_argument("--answers", required=True, help="training answer folders, comma-separated")
    parser.add_argument("--held-out", help="held-out answer folder, scored before and after training")
    parser.add_argument("--out", required=True, help="where to write the heads, train_log.jsonl and summary.json")
    parser.add_argument("--seconds", type=float, default=300.0, help="training wall-clock budget (default 300)")
    parser.add_argument("--total-seconds", type=float,
                        help="a wall-clock budget for the whole run: training stops early enough to score and "
                             "write the heads within it")
    parser.add_argument("--context-rows", type=int, default=768,
                        help="prompt rows read before each answer (default 768: with an answer of up to 256 "
                             "tokens every row stays inside the block's window of 1,024 entries)")
    parser.add_argument("--batch-tokens", type=int, default=32768, help="rows per training batch, padding included")
    parser.add_argument("--record-batch-tokens", type=int, default=65536, help="tokens per pass of the target")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--depth-loss-decay", type=float, default=0.8, help="depth i's loss weighs this ** i")
    parser.add_argument("--num-negatives", type=int, default=2048)
    parser.add_argument("--kl-weight", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=8, help="target top-k kept for the KL term")
    parser.add_argument("--max-answers", type=int, help="the first N training answers only (a quick check)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    from transformers import AutoModelForCausalLM

    from vllm_mtpspec.checkpoint import check_heads_match_model, load_heads, model_fingerprint, save_heads

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    # TF32 for the target's pass: its states move by about what their fp16 storage rounds
    # off, and the pass runs several times faster than in full fp32.
    torch.backends.cuda.matmul.allow_tf32 = True
    began = time.perf_counter()
    model_dir = resolve_model(args.model, dtype="fp32")
    fingerprint = model_fingerprint(model_dir)
    block = load_heads(args.init_from)
    if block.config.head_kind != "attention":
        raise SystemExit(f"--init-from {args.init_from}: config.json field head_kind is "
                         f"{block.config.head_kind!r}; this trainer trains an attention draft block")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 attn_implementation="sdpa").to(device).eval()
    check_heads_match_model(block.config, heads_dir=args.init_from, hidden_size=model.config.hidden_size,
                            vocab_size=model.config.vocab_size, fingerprint=fingerprint)
    block = block.float().to(device)
    embed = model.get_input_embeddings().weight.detach()
    lm_head = model.get_output_embeddings().weight.detach()
    vocab = model.config.vocab_size
    train_pairs = read_answer_dirs(args.answers.split(","), fingerprint=fingerprint, vocab_size=vocab,
                                   max_answers=args.max_answers)
    record = dict(context_rows=args.context_rows, feature_layers=list(block.feature_layers), top_k=args.top_k,
                  batch_tokens=args.record_batch_tokens, device=device)
    summary: dict = {"args": vars(args), "model_dir": str(model_dir), "device": torch.cuda.get_device_name(device)
                     if device.type == "cuda" else "cpu", "train_answers": len(train_pairs)}
    held = None
    if args.held_out:
        held = record_rows(model, read_answer_dirs([args.held_out], fingerprint=fingerprint, vocab_size=vocab),
                           **record)
        summary["held_out_before"] = score(block, held, embed=embed, lm_head=lm_head, batch_tokens=args.batch_tokens)
        logger.info("held out, before: %s", summary["held_out_before"])
    t0 = time.perf_counter()
    store = record_rows(model, train_pairs, **record)
    summary["record_seconds"] = round(time.perf_counter() - t0, 1)
    summary["train_rows"] = int(store.features.shape[0])
    summary["train_answer_rows"] = sum(store.length)
    logger.info("recorded %d rows (%d answer rows) of %d answers in %.0f s", summary["train_rows"],
                summary["train_answer_rows"], store.num_answers, summary["record_seconds"])
    del model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "train_log.jsonl"
    log_path.write_text("")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")  # rewritten at the end

    def log(row: dict) -> None:
        with open(log_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    seconds = args.seconds
    if args.total_seconds is not None:  # leave time to score and write the heads
        seconds = min(seconds, args.total_seconds - (time.perf_counter() - began) - FINISH_RESERVE_S)
    try:
        summary["train"] = train(block, store, embed=embed, lm_head=lm_head, seconds=seconds,
                                 batch_tokens=args.batch_tokens, lr=args.lr, warmup_steps=args.warmup_steps,
                                 num_negatives=args.num_negatives, kl_weight=args.kl_weight,
                                 depth_decay=args.depth_loss_decay, seed=args.seed, log=log)
        logger.info("trained: %s", summary["train"])
    finally:  # what training reached is kept even when it stops on an error
        save_heads(copy.deepcopy(block).half().cpu(), out / "heads")
    if held is not None:
        summary["held_out_after"] = score(block, held, embed=embed, lm_head=lm_head, batch_tokens=args.batch_tokens)
        logger.info("held out, after: %s", summary["held_out_after"])
    summary["seconds"] = round(time.perf_counter() - began, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "args"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
