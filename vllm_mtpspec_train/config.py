"""TrainConfig: everything a training run needs, from a JSON or YAML file."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_mtpspec.config import reject_unknown_keys
from vllm_mtpspec.kinds.base import DrafterKind
from vllm_mtpspec.kinds.registry import kind_named, kind_names
from vllm_mtpspec.shards import CONTEXT_ROWS

MODES = ("posthoc", "cotrain")
DATA_SOURCES = ("shards", "online")
RUNNERS = ("ray", "local")


class TrainConfigError(ValueError):
    pass


def what_trains(mode: str, mtp_weight: float, freeze_student: bool) -> str:
    """'drafter', 'student' or 'student and drafter': what a run's steps move."""
    if mode != "cotrain" or freeze_student:
        return "drafter"
    return "student and drafter" if mtp_weight else "student"


@dataclass(kw_only=True)
class TrainConfig:
    model: str = "smollm2-135m-instruct"      # the target (post-hoc) or teacher (co-trained)
    mode: str = "posthoc"
    student: str | None = None                 # co-trained: the student model folder
    # Data: self-distillation shards, rebuilt from the answer files where those exist and
    # generated from `prompts` where they do not (answers default to <data folder>/answers).
    # Several sources train together: train_data (and train_answers) as lists, paired in
    # order; their shards are interleaved so that every stretch of training sees each.
    # Co-trained, the drafter is calibrated on the student's pass along the held-out answers
    # (OUT/student-held-out): held_out_data then names where those answers lie and where
    # `prompts` has the teacher write them; the job reads no shards from it.
    train_data: str | list[str] = "runs/sharegpt-sd/train"
    held_out_data: str | None = "runs/sharegpt-sd/held-out"
    train_answers: str | list[str] | None = None
    held_out_answers: str | None = None
    prompts: str | None = None                 # JSONL / ShareGPT JSON / text, or "sharegpt"
    max_prompts: int | None = None
    max_new_tokens: int = 256
    max_train_shards: int | None = None         # the first N shards (online: answer files) only, split over the sources
    # "shards": the target's states read from shards on disk (train_data). "online" (any
    # drafter, post-hoc): each worker runs the frozen target over its share of the
    # train_answers folders and keeps the rows in memory; no shards (vllm_mtpspec_train/online.py).
    data_source: str = "shards"
    # An attention block's prompt rows read before each answer (co-trained: every prompt row
    # in training, these in the held-out calibration).
    context_rows: int = CONTEXT_ROWS
    batch_rows: int = 32768                    # online: rows per worker's batch of whole answers, padding included
    record_batch_rows: int = 65536             # online: tokens per pass of the target
    # Heads
    head_kind: str = "parallel"                # a drafter kind (vllm_mtpspec/kinds/)
    num_heads: int = 4                         # draft depths trained
    tied: bool = True
    head_input: str = "hidden"
    mlp_size: int = 0                          # each head's hidden layer (0: none; see HeadsConfig), or a
                                               # draft block's MLP width (0: the target layer's)
    init_from: str | None = None               # a heads directory to train further (None: fresh heads)
    # head_kind="attention": target layers whose input states the block reads too
    # (EAGLE-3); a block in init_from that reads none grows the new fusion, starting at 0.
    feature_layers: list[int] = field(default_factory=list)
    # Optimisation
    # The schedule is in steps: warm-up, then the learning rate falls linearly with the step
    # to the last one (min(max_steps, epochs' worth)); online, max_steps alone sets it.
    epochs: int = 2
    max_steps: int | None = None
    warmup_steps: int = 50
    batch_size: int = 256                      # shards: rows (answers for a block or a student) per worker's batch
    lr: float = 1e-3
    weight_decay: float = 0.0
    num_negatives: int = 2048
    # Matmuls in bfloat16 (autocast; weights and optimizer stay fp32): about twice as fast
    # on CPUs with native bf16 (AMX, avx512_bf16), slower on AVX2-only ones.
    bf16_autocast: bool = False
    kl_weight: float = 1.0
    depth_loss_decay: float = 1.0              # head i's loss weighs this ** i (see losses.mtp_losses)
    mtp_weight: float = 1.0                    # lambda in L = L_KD + lambda * sum_i L_MTP(i); 0: the student alone
    # cotrain: the student does not train, its drafter trains on its states (L_MTP alone):
    # the post-hoc drafter of a distilled student, fed the same data as co-training.
    freeze_student: bool = False
    # cotrain: the student's layers recompute their activations during backward instead of
    # keeping them: a long prompt's attention weights no longer fill memory, for more time a step.
    gradient_checkpointing: bool = False
    seed: int = 0
    # Ray
    num_workers: int = 1
    use_gpu: bool = False
    address: str | None = None                 # a Ray cluster ("auto", "ray://host:10001"); None = local
    # "ray": Ray Train workers. "local": the same loop in this process, no Ray (one worker,
    # data_source 'online'), for a machine with torch and no Ray (vllm_mtpspec_train/workers.py).
    runner: str = "ray"
    storage_path: str = "runs/ray"
    name: str = "mtpspec-heads"
    checkpoint_every: int = 200                # steps
    log_every: int = 10                        # steps between rows of metrics.jsonl
    max_failures: int = 2
    fail_at_step: int | None = None            # for testing recovery: a worker dies once here
    # Output
    out: str = "runs/heads"
    int2_group_size: int | None = 64           # also write an INT2 copy (None: don't)
    int2_method: str = "rtn"                   # rtn, search, gptq or gptq-refit (calibrated on the training shards)
    quantize_aware_steps: int = 0              # > 0: GPTQ, then this many fake-quantized training steps
    int2_calibration_shards: int = 4           # training shards the calibrated INT2 copy reads

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise TrainConfigError(f"mode={self.mode!r}: choose one of {MODES}")
        if self.mode == "cotrain" and not self.student:
            raise TrainConfigError("mode='cotrain' needs 'student': the folder of the model to train with its heads")
        if self.mode != "cotrain" and self.student:
            raise TrainConfigError(f"student={self.student!r} with mode={self.mode!r}: post-hoc heads train on the "
                                   "frozen model; set mode='cotrain' to train a student, or remove 'student'")
        if self.mode != "cotrain" and self.gradient_checkpointing:
            raise TrainConfigError(f"gradient_checkpointing with mode={self.mode!r}: it saves a training student's "
                                   "memory; post-hoc runs train no model. Set mode='cotrain' or remove it")
        if self.mode != "cotrain" and self.freeze_student:
            raise TrainConfigError(f"freeze_student with mode={self.mode!r}: it keeps a co-training student frozen; "
                                   "set mode='cotrain' and 'student', or leave freeze_student false (post-hoc heads "
                                   "never train the model)")
        if self.mtp_weight < 0 or (self.mtp_weight == 0 and self.mode != "cotrain"):
            raise TrainConfigError(f"mtp_weight={self.mtp_weight}: must be > 0 (0 trains a co-training student alone, "
                                   "mode 'cotrain' only)")
        if self.freeze_student and self.mtp_weight == 0:
            raise TrainConfigError("freeze_student with mtp_weight 0 trains nothing: unfreeze the student, or give "
                                   "the drafter's losses a weight > 0")
        if self.num_heads < 1 or self.batch_size < 1 or self.num_workers < 1:
            raise TrainConfigError("num_heads, batch_size and num_workers must be >= 1")
        from vllm_mtpspec.quant.calibrated import METHODS

        if self.int2_method not in METHODS:
            raise TrainConfigError(f"int2_method={self.int2_method!r}: choose one of {METHODS}")
        if self.quantize_aware_steps < 0 or self.int2_calibration_shards < 1:
            raise TrainConfigError("quantize_aware_steps must be >= 0 and int2_calibration_shards >= 1")
        if (self.quantize_aware_steps or self.int2_method != "rtn") and self.mode == "cotrain":
            raise TrainConfigError("int2_method / quantize_aware_steps calibrate on the target's hidden states in the "
                                   "shards; co-trained heads read the student's: use int2_method 'rtn' in cotrain mode")
        if (self.quantize_aware_steps or self.int2_method != "rtn") and not self.int2_group_size:
            raise TrainConfigError("int2_method / quantize_aware_steps shape the INT2 copy: set int2_group_size "
                                   "(e.g. 64), or leave them at rtn / 0")

        if self.head_kind not in kind_names():
            raise TrainConfigError(f"head_kind={self.head_kind!r}: choose one of {kind_names()}")
        kind = self.kind
        if kind.training_module is None:
            raise TrainConfigError(f"head_kind={self.head_kind!r}: the training job does not train {kind.label}s yet; "
                                   f"choose one of {[k for k in kind_names() if kind_named(k).training_module]}")
        if (kind.tied_only or kind.trains_tied_only) and not self.tied:
            raise TrainConfigError(f"head_kind={self.head_kind!r} projects through the target's LM head: set tied=true")
        if self.quantize_aware_steps and not kind.quantize_aware_training:
            raise TrainConfigError(f"head_kind={self.head_kind!r}: quantization-aware steps train MLP heads only so "
                                   "far; set quantize_aware_steps to 0 (int2_method 'gptq-refit' calibrates the "
                                   "block's INT2 copy on the training shards)")
        if self.feature_layers and not kind.reads_layers:
            raise TrainConfigError(f"feature_layers={self.feature_layers} with head_kind={self.head_kind!r}: only an "
                                   "attention draft block reads other layers' states; set head_kind='attention' or "
                                   "leave feature_layers empty")
        if self.mlp_size < 0:
            raise TrainConfigError(f"mlp_size={self.mlp_size}: must be >= 0 (0: no hidden layer, or a block's "
                                   "MLP as wide as the target layer's)")
        if self.mlp_size and kind.needs_block_shape and not kind.sizes_block_mlp:
            raise TrainConfigError(f"mlp_size={self.mlp_size} with head_kind={self.head_kind!r}: {kind.noun} are "
                                   "shaped like the target's own layer; remove mlp_size")
        if kind.token_conditioned_only and self.head_input != "hidden+token":
            raise TrainConfigError(f"head_kind={self.head_kind!r} with head_input={self.head_input!r}, "
                                   f"tied={self.tied}: each depth reads the token drafted before it through the "
                                   "target's embedding and LM head; set head_input='hidden+token' and tied=true")
        if not 0.0 < self.depth_loss_decay <= 1.0:
            raise TrainConfigError(f"depth_loss_decay={self.depth_loss_decay}: must lie in (0, 1] (1: every depth alike)")
        datas, answers = self.train_data, self.train_answers
        online = self.data_source == "online"  # train_answers alone, no shard folders to pair them with
        if isinstance(answers, list) and not online and (not isinstance(datas, list) or len(answers) != len(datas)):
            raise TrainConfigError(f"train_answers has {len(answers)} folders and train_data "
                                   f"{len(datas) if isinstance(datas, list) else 1}: give one answers folder per "
                                   "train_data folder, in the same order (or leave train_answers out)")
        if isinstance(datas, list) and (not datas or len(set(datas)) != len(datas)):
            raise TrainConfigError(f"train_data={datas!r}: give one or more distinct folders")
        if isinstance(datas, list) and self.prompts:
            raise TrainConfigError("'prompts' makes the data of one train_data folder: give train_data as one "
                                   "folder, or make each source's answers first (python -m vllm_mtpspec_train.data)")
        if self.max_train_shards is not None and self.max_train_shards < 1:
            raise TrainConfigError(f"max_train_shards={self.max_train_shards}: must be >= 1 (or null for all)")
        for name in ("warmup_steps", "checkpoint_every", "log_every", "context_rows", "batch_rows",
                     "record_batch_rows"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < (0 if name == "context_rows" else 1):
                raise TrainConfigError(f"{name}={getattr(self, name)!r}: must be a whole number >= "
                                       f"{0 if name == 'context_rows' else 1}")
        if self.max_steps is not None and (not isinstance(self.max_steps, int) or self.max_steps < 1):
            raise TrainConfigError(f"max_steps={self.max_steps!r}: must be a whole number >= 1 (or null: the epochs)")
        self._check_online()
        self._check_runner()

    def _check_runner(self) -> None:
        if self.runner not in RUNNERS:
            raise TrainConfigError(f"runner={self.runner!r}: choose one of {RUNNERS}")
        if self.runner != "local":
            return
        refusals = [(self.num_workers != 1, f"num_workers={self.num_workers}", "num_workers 1"),
                    (self.address is not None, f"address={self.address!r}", "no address"),
                    (self.data_source != "online", f"data_source={self.data_source!r}",
                     "data_source 'online' (training shards stream through Ray Data)")]
        for refused, asked, fix in refusals:
            if refused:
                raise TrainConfigError(f"runner='local' runs one worker in this process without Ray, and {asked} "
                                       f"was asked: give {fix}, or runner 'ray'")

    def _check_online(self) -> None:
        if self.data_source not in DATA_SOURCES:
            raise TrainConfigError(f"data_source={self.data_source!r}: choose one of {DATA_SOURCES}")
        if self.data_source != "online":
            return
        if self.mode != "posthoc":
            raise TrainConfigError(f"data_source='online' with mode={self.mode!r}: the online path trains drafters "
                                   "post-hoc on the frozen target's states; co-training reads the answers from "
                                   "shards, so set data_source='shards'")
        if self.quantize_aware_steps:
            raise TrainConfigError("data_source='online' with quantize_aware_steps: they calibrate on training "
                                   "shards, which the online path does not write; set quantize_aware_steps to 0 "
                                   "or data_source='shards'")
        if not self.train_answers:
            raise TrainConfigError("data_source='online' reads answer files: set train_answers to the answer "
                                   "folders (one or a list), e.g. data/self-distilled/smollm2-135m-instruct/train")
        if self.prompts:
            raise TrainConfigError("data_source='online' trains on answer files that exist: remove 'prompts' and "
                                   "make the answers first (python -m vllm_mtpspec_train.data --answers-only)")
        if self.max_steps is None:
            raise TrainConfigError("data_source='online': the schedule is in steps, and an epoch's steps are only "
                                   "known once the workers have recorded their rows; set max_steps (e.g. 1000)")
        if self.int2_group_size and self.int2_method != "rtn":
            raise TrainConfigError(f"data_source='online' with int2_method={self.int2_method!r}: calibrated INT2 "
                                   "methods read training shards, which the online path does not write; use "
                                   "int2_method 'rtn', or quantize afterwards with `mtpspec heads quantize "
                                   "--calibration SHARDS`")

    @property
    def kind(self) -> DrafterKind:
        """The kind of drafter trained (vllm_mtpspec/kinds/)."""
        return kind_named(self.head_kind)

    @property
    def context_rows_read(self) -> int:
        """The prompt rows the trained drafter reads before each answer from the shards: a
        drafter that keeps the context reads them, post-hoc (co-trained, it reads the
        student's states instead)."""
        return self.context_rows if self.kind.keeps_context and self.mode == "posthoc" else 0

    @property
    def train_sources(self) -> list[tuple[str, str | None]]:
        """(shards folder, answers folder or None) of every training source."""
        datas = self.train_data if isinstance(self.train_data, list) else [self.train_data]
        answers = self.train_answers if isinstance(self.train_answers, list) else [self.train_answers] * len(datas)
        return list(zip(datas, answers))

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> "TrainConfig":
        file = Path(path)
        if not file.is_file():
            raise TrainConfigError(f"training config {file} does not exist")
        text = file.read_text()
        try:
            if file.suffix in (".yaml", ".yml"):
                import yaml

                raw = yaml.safe_load(text) or {}
            else:
                raw = json.loads(text)
        except Exception as err:  # noqa: BLE001 - any parse error is the file's
            raise TrainConfigError(f"{file}: cannot parse ({err})") from None
        return cls.from_dict({**raw, **overrides}, source=str(file))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config") -> "TrainConfig":
        reject_unknown_keys(cls, raw, source=source, error=TrainConfigError)
        try:
            return cls(**raw)
        except TrainConfigError as err:  # the checks in __post_init__ know the field, not the file
            raise TrainConfigError(f"{source}: {err}") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
