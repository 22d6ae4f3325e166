"""The Ray Train job that trains MTP heads.

    mtpspec train --config configs/smollm2.json        (or python -m vllm_mtpspec_train.train)

Post-hoc: the target is frozen; its hidden states come with the self-distillation data,
so a step only runs the heads. Co-trained: a student model and its heads train together
on the teacher's data, L = L_KD(student || teacher) + lambda * sum_i L_MTP(i).

The same command runs on one machine (local Ray, CPU workers) and on a cluster
(--address, --num-workers, --use-gpu): data parallel across workers, checkpoints through
Ray Train, and a worker that dies is restarted from the last checkpoint.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from vllm_mtpspec.answers import list_answer_files
from vllm_mtpspec.kinds.base import resolve
from vllm_mtpspec.kinds.registry import kind_named
from vllm_mtpspec.models import resolve_model
from vllm_mtpspec.shards import ShardsError, has_context_rows, layer_columns, list_shards
from vllm_mtpspec.sharegpt import is_held_out
from vllm_mtpspec_train.config import TrainConfig, TrainConfigError, what_trains
from vllm_mtpspec_train.examples import shard_examples
from vllm_mtpspec_train.prompts import load_prompt_source

logger = logging.getLogger("mtpspec.train")
METRICS_FILE = "metrics.jsonl"
TOP_K = 8  # the target's top-k kept per answer row for the KL term, as the shards keep it


# --------------------------------------------------------------------------- worker side
def lr_factor(step: int, *, warmup_steps: int, total_steps: int) -> float:
    """The learning rate's multiplier at a step: a linear warm-up, then a linear fall to 5% at
    the last step. A function of the step alone, so that a run (and a resumed one) repeats."""
    return min(1.0, (step + 1) / warmup_steps) * max(0.05, 1 - step / max(total_steps, 1))


def _restore(model, optimizer, worker):
    """(step, epoch, batches of that epoch done, restored?) from the last checkpoint."""
    checkpoint = worker.latest_checkpoint()
    if checkpoint is None:
        return 0, 0, 0, False
    with checkpoint.as_directory() as folder:
        state = torch.load(Path(folder) / "state.pt", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"], state["epoch"], state.get("epoch_batches", 0), True


def _report(metrics: dict, *, worker, model, optimizer, step: int, epoch: int, epoch_batches: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        written = None
        if worker.rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "epoch": epoch,
                        "epoch_batches": epoch_batches}, Path(folder) / "state.pt")
            written = Path(folder)
        worker.report(metrics, written)


def _fail_once(loop_config: dict, step: int) -> None:
    """fail_at_step: the first time this step is reached in a run, the worker dies, as a
    crashed or preempted machine would; Ray Train restarts the group from the last
    checkpoint (a local run resumes from it when started again). It waits a little first: Ray's controller collects reported checkpoints
    by polling, and a worker that dies right after reporting can take its last one along."""
    marker = Path(loop_config["metrics_path"]).with_name(f"failed-at-step-{step}")
    if marker.exists():
        return
    marker.touch()
    time.sleep(10)
    logger.warning("failing on purpose at step %d (fail_at_step)", step)
    os._exit(1)


def _build_module(loop_config: dict):
    from vllm_mtpspec.checkpoint import load_heads
    from vllm_mtpspec_train.modules import CotrainModule

    heads = load_heads(loop_config["init_heads"])
    if loop_config["mode"] == "cotrain":
        from transformers import AutoModelForCausalLM

        student = AutoModelForCausalLM.from_pretrained(loop_config["student"], dtype=torch.float32)
        if loop_config["gradient_checkpointing"]:
            student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return CotrainModule(student.train(), heads, num_negatives=loop_config["num_negatives"],
                             kl_weight=loop_config["kl_weight"], mtp_weight=loop_config["mtp_weight"],
                             freeze_student=loop_config["freeze_student"],
                             depth_decay=loop_config["depth_loss_decay"])
    from vllm_mtpspec.weights import embedding_and_lm_head

    embed, lm_head = embedding_and_lm_head(loop_config["model_dir"])
    kind = heads.config.kind
    module = resolve(kind.online_training_module if loop_config["data_source"] == "online" else kind.training_module)
    return module(heads, lm_head=lm_head, embed=embed, num_negatives=loop_config["num_negatives"],
                  kl_weight=loop_config["kl_weight"], depth_decay=loop_config["depth_loss_decay"])


def _shard_epochs(loop_config: dict, worker):
    """epoch -> its batches, from this worker's shard of the Ray dataset (streamed)."""
    shard = worker.dataset_shard("train")

    def batches(epoch: int):
        return shard.iter_batches(batch_size=loop_config["batch_size"], batch_format="numpy", drop_last=True,
                                  local_shuffle_buffer_size=20000, local_shuffle_seed=loop_config["seed"] + epoch)

    return batches, loop_config["epochs"]


def _online_epochs(loop_config: dict, *, rank: int, world_size: int, device: torch.device, num_heads: int):
    """epoch -> its batches, from the rows this worker recorded of its share of the answers.
    Epochs do not end the run (max_steps does): each worker's share has its own count of
    batches, and every worker must take the same number of steps."""
    from vllm_mtpspec_train.online import batch_examples, epoch_batches, record_share, row_examples, seed_of

    # A draft block reads whole answers with their prompt rows; heads read answer rows alone.
    block = kind_named(loop_config["head_kind"]).keeps_context
    examples = batch_examples if block else row_examples
    store = record_share(loop_config["model_dir"], loop_config["train_answers"], rank=rank, world_size=world_size,
                         context_rows=loop_config["context_rows"] if block else 0,
                         feature_layers=loop_config["feature_layers"],
                         top_k=TOP_K, batch_tokens=loop_config["record_batch_rows"], device=device,
                         files_per_dir=loop_config["answer_files_per_dir"])
    logger.info("worker %d: %d rows of %d answers recorded", rank, store.features.shape[0], store.num_answers)

    def batches(epoch: int):
        for answers in epoch_batches(store, batch_rows=loop_config["batch_rows"],
                                     seed=seed_of(loop_config["seed"], rank, epoch)):
            yield examples(store, answers, num_heads)

    return batches, None


def train_loop_per_worker(loop_config: dict, worker=None) -> None:
    """One worker's training: a Ray Train worker's (worker None), or a local run's
    (workers.LocalWorker)."""
    import itertools

    from tqdm import tqdm

    from vllm_mtpspec_train.online import seed_of
    from vllm_mtpspec_train.workers import RayWorker

    worker = worker or RayWorker(loop_config["use_gpu"])
    torch.manual_seed(loop_config["seed"])
    torch.set_num_threads(max(1, loop_config.get("threads_per_worker", 1)))
    rank, world_size = worker.rank, worker.world_size
    module = _build_module(loop_config)
    model = worker.prepare_model(module)
    raw = model.module if hasattr(model, "module") else model
    params = raw.trainable_parameters()
    # fused: one kernel over all parameters; for untied heads (4 x |V| x d) the per-tensor
    # update took ~10x longer than the step's forward pass.
    optimizer = torch.optim.AdamW(params, lr=loop_config["lr"], weight_decay=loop_config["weight_decay"], fused=True)
    step, start_epoch, done_in_epoch, restored = _restore(raw, optimizer, worker)
    if restored and rank == 0:
        logger.warning("resumed from the checkpoint of step %d", step)
        with open(loop_config["metrics_path"], "a") as f:
            f.write(json.dumps({"event": "resumed", "step": step}) + "\n")
    total_steps = loop_config["total_steps"]
    if loop_config["data_source"] == "online":
        epoch_batches, epochs = _online_epochs(loop_config, rank=rank, world_size=world_size, device=worker.device,
                                               num_heads=raw.heads.num_heads)
    else:
        epoch_batches, epochs = _shard_epochs(loop_config, worker)
    trains = what_trains(loop_config["mode"], loop_config["mtp_weight"], loop_config["freeze_student"])
    bar = tqdm(total=total_steps, initial=step, desc=f"training the {trains}", disable=rank != 0, mininterval=5)
    generator = torch.Generator()
    autocast_device = "cuda" if loop_config["use_gpu"] else "cpu"
    metrics = {"step": step, "epoch": start_epoch}
    for epoch in itertools.count(start_epoch) if epochs is None else range(start_epoch, epochs):
        # Resuming: the checkpoint's epoch again, past the batches it had trained on.
        skip = done_in_epoch if epoch == start_epoch else 0
        for done, batch in enumerate(epoch_batches(epoch), start=1):
            if done <= skip:
                continue
            if loop_config.get("fail_at_step") == step + 1:
                _fail_once(loop_config, step + 1)
            for group in optimizer.param_groups:
                group["lr"] = loop_config["lr"] * lr_factor(step, warmup_steps=loop_config["warmup_steps"],
                                                            total_steps=total_steps)
            # Negatives drawn from the step's own seed: a resumed run draws what the first would have.
            generator.manual_seed(seed_of(loop_config["seed"], rank, step))
            with torch.autocast(autocast_device, dtype=torch.bfloat16, enabled=loop_config["bf16_autocast"]):
                loss, step_metrics = model(batch, generator)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{step_metrics['loss']:.3f}")
            metrics = {"step": step, "epoch": epoch, "lr": optimizer.param_groups[0]["lr"], **step_metrics}
            if rank == 0 and (step % loop_config["log_every"] == 0 or step == 1):
                with open(loop_config["metrics_path"], "a") as f:
                    f.write(json.dumps(metrics) + "\n")
            finished = step >= total_steps
            if step % loop_config["checkpoint_every"] == 0 or finished:
                _report(metrics, worker=worker, model=raw, optimizer=optimizer, step=step, epoch=epoch,
                        epoch_batches=done)
            if finished:
                bar.close()
                return
    bar.close()  # the data ran out before total_steps
    _report(metrics, worker=worker, model=raw, optimizer=optimizer, step=step, epoch=loop_config["epochs"],
            epoch_batches=0)


# --------------------------------------------------------------------------- driver side
def _expand_shard(batch: dict, num_heads: int) -> dict:
    parts = [shard_examples(torch.load(p, weights_only=True), num_heads) for p in batch["path"]]
    return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}


def ensure_data(config: TrainConfig, model_dir: Path) -> tuple[list[Path], list[Path]]:
    """Shards for training and held-out evaluation: rebuilt from the kept answer files,
    and generated for config.prompts where answers are missing."""
    from vllm_mtpspec_train.answers import shards_from_answers
    from vllm_mtpspec_train.data import answers_dir_for, generate_self_distillation

    # A co-trained block reads the student's states, not the recorded ones.
    context_rows = config.context_rows_read
    if config.data_source == "online":
        # The workers read the training answers themselves; only the held-out shards, which
        # export calibrates the temperatures on, are built here.
        if not config.held_out_data:
            return [], []
        shards_from_answers(model_dir, answers_dir_for(config.held_out_data, config.held_out_answers),
                            config.held_out_data, context_rows=context_rows, feature_layers=config.feature_layers)
        return [], list_shards(config.held_out_data)
    shares = _shares_of_sources(config)
    splits = [(data, answers, False) for data, answers in config.train_sources]
    # A co-trained drafter is calibrated on the student's states along the held-out answers
    # (export.py): the teacher's pass over them is run only where it writes those answers.
    teacher_held_out = config.held_out_data and (config.mode == "posthoc" or config.prompts)
    if teacher_held_out:
        splits.append((config.held_out_data, config.held_out_answers, True))
    if config.prompts:
        prompts = load_prompt_source(config.prompts)
        prompts = prompts[: config.max_prompts]
        for data, answers, held_out in splits:
            split = [p for p in prompts if is_held_out(p.id) == held_out]
            if split:
                generate_self_distillation(model_dir, split, data, answers_dir=answers_dir_for(data, answers),
                                           max_new_tokens=config.max_new_tokens,
                                           context_rows=context_rows,
                                           feature_layers=config.feature_layers)
    else:
        for (data, answers, held_out), share in zip(splits, shares + [None]):
            # A run that trains on N shards needs only their answers read.
            shards_from_answers(model_dir, answers_dir_for(data, answers), data,
                                max_files=None if held_out else share,
                                context_rows=context_rows,
                                feature_layers=config.feature_layers)
    found = [list_shards(data) for data, _ in config.train_sources]
    held_shards = list_shards(config.held_out_data) if config.held_out_data and config.mode == "posthoc" else []
    for (data, _), shards in zip(config.train_sources, found):
        if not shards:
            raise TrainConfigError(
                f"train_data folder {data!r} holds no shard-*.pt files, its answers folder holds no answer files "
                "and no 'prompts' were given to make them: the data set is empty. Set 'prompts' (a JSONL file or "
                "'sharegpt') or run python -m vllm_mtpspec_train.data; the committed training answers under "
                "data/self-distilled/ come back from git history with: bash scripts/restore_answers.sh"
            )
    per_source = [shards[:share] for shards, share in zip(found, shares)]
    return interleave(per_source)[: config.max_train_shards], held_shards


def _shares_of_sources(config: TrainConfig) -> list[int | None]:
    """The shards each training source gives (None: all it has)."""
    from vllm_mtpspec_train.data import answers_dir_for

    if config.max_train_shards is None:
        return [None] * len(config.train_sources)
    if config.prompts:  # one source, its shards generated from the prompts
        return [config.max_train_shards]
    available = [max(len(list_answer_files(answers_dir_for(data, answers))), len(list_shards(data)))
                 for data, answers in config.train_sources]
    return split_budget(config.max_train_shards, available)


def split_budget(budget: int, available: list[int]) -> list[int]:
    """How many shards each source gives to a run of `budget` shards: as even a split as the
    sources allow (one with too few leaves the rest to the others), so that the mix a
    same-budget comparison trains on does not depend on what earlier runs left on disk."""
    shares = [0] * len(available)
    left = min(budget, sum(available))
    while left:
        open_sources = [i for i, n in enumerate(available) if shares[i] < n]
        for i in open_sources[:left]:
            shares[i] += 1
        left -= min(left, len(open_sources))
    return shares


def interleave(lists: list[list[Path]]) -> list[Path]:
    """One from each list in turn, each list's own order kept, spread evenly over the
    longest (a source with half the shards comes every other turn)."""
    keyed = [((i + 0.5) / len(shards), n, path) for n, shards in enumerate(lists) for i, path in enumerate(shards)]
    return [path for _, _, path in sorted(keyed)]


def _require_context_rows(shards: list[Path], config: TrainConfig) -> None:
    """An attention draft block learns to read the prompt: shards without its rows would
    train it on answers alone, unlike what it sees when drafting."""
    first_of_each_folder = {}
    for shard in shards:
        first_of_each_folder.setdefault(shard.parent, shard)
    for shard in first_of_each_folder.values():
        loaded = torch.load(shard, weights_only=True, mmap=True)
        if not has_context_rows(loaded):
            raise TrainConfigError(
                f"train_data: {shard} carries no prompt rows (context_hidden), which head_kind='attention' trains "
                "on; rebuild the shards with `python -m vllm_mtpspec_train.data --context-rows 512` into a new "
                "folder and point train_data there")
        try:
            layer_columns(loaded, config.feature_layers, where=f"train_data: {shard} and its folder")
        except ShardsError as err:
            raise TrainConfigError(str(err)) from None


def connect_ray(config: TrainConfig) -> None:
    import ray

    if ray.is_initialized():
        return
    try:
        if config.address:
            ray.init(address=config.address, log_to_driver=True)
        else:
            # Logical CPUs: one per training worker plus room for Ray Data's loading tasks,
            # which would otherwise wait for a CPU that the workers never give back.
            ray.init(num_cpus=config.num_workers + max(2, os.cpu_count() or 1), include_dashboard=False,
                     log_to_driver=True)
    except (ConnectionError, ValueError, RuntimeError) as err:
        raise TrainConfigError(
            f"address={config.address!r}: cannot reach a Ray cluster there ({err}); start one with `ray start --head` "
            "and pass its address (e.g. 'auto' or 'ray://HOST:10001'), or leave address unset for a local run"
        ) from None


def initial_heads(config: TrainConfig, heads_base: Path):
    """Fresh heads that start as the model's LM head or, with `init_from`, the heads of an
    earlier run to train further (same shape, same model)."""
    from vllm_mtpspec.checkpoint import check_heads_match_model, load_heads, model_fingerprint
    from vllm_mtpspec.target import load_target

    if config.init_from is None:
        base = load_target(str(heads_base), dtype="fp32")
        return config.kind.initial_heads(base.model, heads_base, num_heads=config.num_heads, seed=config.seed,
                                         tied=config.tied, head_input=config.head_input, mlp_size=config.mlp_size,
                                         feature_layers=config.feature_layers)
    heads = load_heads(config.init_from)
    if heads.is_quantized:
        raise TrainConfigError(f"init_from={config.init_from}: INT2 heads cannot train further; "
                               "pass the full-precision heads directory")
    if heads.config.kind is not config.kind and (seeded := config.kind.seeded_from(heads)) is not None:
        logger.info("init_from=%s: %s; the %s start from them", config.init_from, heads.config.kind.label,
                    config.kind.label)
        heads = seeded
    base_config = json.loads((heads_base / "config.json").read_text())
    if (heads.config.kind is config.kind and config.kind.reads_layers and config.feature_layers
            and not heads.feature_layers):
        from vllm_mtpspec.heads_init import check_feature_layers, grown_block

        check_feature_layers(config.feature_layers, base_config["num_hidden_layers"], where="feature_layers")
        logger.info("init_from=%s: a block that reads the final state only; it grows a fusion of layers %s, "
                    "starting at zero", config.init_from, config.feature_layers)
        heads = grown_block(heads, config.feature_layers)
    asked = {"head_kind": config.head_kind, "num_heads": config.num_heads, "tied": config.tied}
    # A kind's own shape fields (a draft block's shape is the model's layer, not head_input or mlp_size).
    asked.update({key: getattr(config, key) for key in config.kind.shape_fields})
    if "feature_layers" in asked:
        asked["feature_layers"] = list(asked["feature_layers"])
    if config.kind.sizes_block_mlp and config.mlp_size:  # 0: whatever width the block has
        asked["mlp_size"] = config.mlp_size
    found = {key: heads.feature_layers if key == "feature_layers"
             else heads.config.block.mlp_size if key == "mlp_size" and config.kind.sizes_block_mlp
             else getattr(heads.config, key) for key in asked}
    if found != asked:
        differ = sorted(key for key in asked if found[key] != asked[key])
        raise TrainConfigError(
            f"init_from={config.init_from}: its heads have {({k: found[k] for k in differ})}, the training config "
            f"asks for {({k: asked[k] for k in differ})}; set these fields to match the heads")
    check_heads_match_model(heads.config, heads_dir=config.init_from, hidden_size=base_config["hidden_size"],
                            vocab_size=base_config["vocab_size"], fingerprint=model_fingerprint(heads_base))
    return heads


def _shard_dataset(config: TrainConfig, train_shards: list[Path], held_shards: list[Path]):
    """The Ray dataset the workers stream from shards, its item count, and what the summary says of it."""
    import ray.data

    offsets = [torch.load(p, weights_only=True, mmap=True)["offsets"] for p in train_shards]  # reads no states
    num_rows = sum(int(o[-1]) for o in offsets)
    if config.context_rows_read:
        _require_context_rows(train_shards + held_shards, config)
    if config.mode == "cotrain" or config.kind.keeps_context:
        # Items are answers: the student, or the draft block, reads each in full.
        # Absolute: Ray Train's workers do not run in the driver's working directory.
        items = [{"path": str(p.absolute()), "answer": j} for p, o in zip(train_shards, offsets)
                 for j in range(len(o) - 1)]
        return ray.data.from_items(items), len(items), {"train_rows": num_rows}
    # Items are answer rows with their recorded hidden states.
    dataset = ray.data.from_items([{"path": str(p)} for p in train_shards]).map_batches(
        _expand_shard, batch_size=1, fn_kwargs={"num_heads": config.num_heads})
    return dataset, num_rows, {"train_rows": num_rows}


def _online_answers(config: TrainConfig, model_dir: Path) -> dict:
    """Checks the online path's answer folders before any worker starts (each worker reads
    them again, its share only): they hold answers of this model, enough for every worker."""
    from vllm_mtpspec.answers import AnswersError
    from vllm_mtpspec.checkpoint import model_fingerprint
    from vllm_mtpspec_train.online import read_answer_dirs

    folders = config.train_answers if isinstance(config.train_answers, list) else [config.train_answers]
    folders = [str(Path(folder).absolute()) for folder in folders]
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    # max_train_shards counts answer files here (answer file i holds shard i's answers).
    files_per_dir = (None if config.max_train_shards is None else
                     split_budget(config.max_train_shards, [len(list_answer_files(folder)) for folder in folders]))
    try:
        pairs = read_answer_dirs(folders, fingerprint=model_fingerprint(model_dir), vocab_size=vocab_size,
                                 files_per_dir=files_per_dir)
    except (FileNotFoundError, AnswersError) as err:
        raise TrainConfigError(f"train_answers: {err}") from None
    if len(pairs) < config.num_workers:
        raise TrainConfigError(f"train_answers hold {len(pairs)} answers, fewer than num_workers="
                               f"{config.num_workers}: use fewer workers or more answers")
    return {"answer_dirs": folders, "answer_files_per_dir": files_per_dir, "train_answers": len(pairs),
            "train_answer_tokens": sum(len(pair.answer) for pair in pairs),
            "train_text_answer_tokens": sum(len(pair.answer) for pair in pairs if pair.labels_from_target)}


def run_training(config: TrainConfig) -> dict:
    """Trains, exports and evaluates; returns the run summary (also written as JSON)."""
    from vllm_mtpspec.checkpoint import save_heads

    started = time.time()
    model_dir = resolve_model(config.model, dtype="fp32")
    train_shards, held_shards = ensure_data(config, model_dir)
    run_dir = Path(config.storage_path).absolute() / config.name
    run_dir.mkdir(parents=True, exist_ok=True)
    init_dir = run_dir / "init-heads"
    # Heads belong to the model whose hidden states they read: the student when co-training.
    heads_base = Path(config.student) if config.mode == "cotrain" else model_dir
    if not (init_dir / "config.json").is_file():
        save_heads(initial_heads(config, heads_base), init_dir)
    if config.runner == "ray":
        # Before any dataset is made: Ray Data would otherwise start Ray itself, with a CPU
        # apiece for the workers and none left for its own tasks.
        import ray.data

        connect_ray(config)
        ray.data.DataContext.get_current().enable_progress_bars = False  # the training bar is the one to watch
    metrics_path = run_dir / METRICS_FILE
    loop_config = {
        **config.to_dict(),
        "model_dir": str(model_dir),
        "init_heads": str(init_dir),
        "metrics_path": str(metrics_path),
        "threads_per_worker": max(1, (os.cpu_count() or 1) // config.num_workers),
    }
    if config.mode == "cotrain":  # absolute: Ray Train's workers do not run in the driver's working directory
        loop_config["student"] = str(heads_base.absolute())
    if config.data_source == "online":
        datasets, total_steps, data_summary = {}, config.max_steps, _online_answers(config, model_dir)
        # Absolute: Ray Train's workers do not run in the driver's working directory.
        loop_config["train_answers"] = data_summary.pop("answer_dirs")
        loop_config["answer_files_per_dir"] = data_summary["answer_files_per_dir"]
        logger.info("%d training answers, recorded by the workers; %d steps on %d worker(s)",
                    data_summary["train_answers"], total_steps, config.num_workers)
    else:
        dataset, num_items, data_summary = _shard_dataset(config, train_shards, held_shards)
        datasets = {"train": dataset}
        steps_per_epoch = max(1, num_items // (config.batch_size * config.num_workers))
        total_steps = min(config.max_steps or 10**12, steps_per_epoch * config.epochs)
        logger.info("%d training rows in %d shards; %d steps on %d worker(s)", data_summary["train_rows"],
                    len(train_shards), total_steps, config.num_workers)
    loop_config["total_steps"] = total_steps
    if config.runner == "local":
        from vllm_mtpspec_train.workers import LocalWorker

        worker = LocalWorker(run_dir / "local-checkpoints", use_gpu=config.use_gpu)
        train_loop_per_worker(loop_config, worker)
        checkpoint = worker.latest_checkpoint()
    else:
        checkpoint = _fit_with_ray(config, loop_config, datasets)
    from vllm_mtpspec_train.export import export_heads

    summary = export_heads(config, checkpoint, init_dir=init_dir, model_dir=heads_base, held_out=held_shards,
                           metrics_path=metrics_path, train_shards=train_shards)
    summary.update(data_summary)
    summary["steps"] = total_steps
    summary["seconds"] = round(time.time() - started, 1)
    (Path(config.out) / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _fit_with_ray(config: TrainConfig, loop_config: dict, datasets: dict):
    """The workers' loop under Ray Train's TorchTrainer: its last checkpoint."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=config.num_workers, use_gpu=config.use_gpu),
        run_config=RunConfig(
            name=config.name,
            storage_path=str(Path(config.storage_path).absolute()),
            failure_config=FailureConfig(max_failures=config.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
        datasets=datasets,
    )
    result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"training ended without a checkpoint: {result.error}")
    if not config.address:
        # Export runs here in the driver; a local Ray left up keeps polling the finished
        # trainer and fills the log while it does.
        ray.shutdown()
    return result.checkpoint


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mtpspec train",
        description="Train MTP heads with Ray Train (post-hoc on a frozen model, or co-trained with a student). "
                    "Flags override the config file.",
    )
    parser.add_argument("--config", required=True,
                        help="a JSON or YAML file with TrainConfig fields (see vllm_mtpspec_train/config.py)")
    parser.add_argument("--num-workers", type=int, help="Ray Train workers (data parallel)")
    parser.add_argument("--use-gpu", action="store_true", default=None, help="one GPU per worker")
    parser.add_argument("--address", help="Ray cluster address ('auto', 'ray://HOST:10001'); default: local Ray")
    parser.add_argument("--runner", choices=("ray", "local"),
                        help="'ray' (default): Ray Train workers; 'local': the same loop in this process without Ray, "
                             "one worker, answer files only (for a machine with torch and no Ray)")
    parser.add_argument("--out", help="heads directory to write")
    parser.add_argument("--max-steps", type=int, help="stop after this many steps")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # force: under `mtpspec train` the command line has configured logging (WARNING) already.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    overrides = {k: v for k, v in {"num_workers": args.num_workers, "use_gpu": args.use_gpu, "address": args.address,
                                   "out": args.out, "max_steps": args.max_steps, "runner": args.runner}.items()
                 if v is not None}
    try:
        config = TrainConfig.from_file(args.config, **overrides)
        summary = run_training(config)
    except TrainConfigError as err:
        print(f"mtpspec train: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
