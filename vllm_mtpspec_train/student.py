"""A student for co-training: the teacher cut to fewer decoder layers, each kept layer
initialized from the teacher's own, saved as a Hugging Face folder that vLLM serves.

    python -m vllm_mtpspec_train.student --model smollm2-135m-instruct --layers 15 --out runs/cotrain/student

A student keeps the teacher's first third of its layers and the last layers for the rest:
the first read the embeddings as they were trained to, the last write what the final norm
and LM head expect. Cut from SmolLM2-135M-Instruct's 30 layers to 15, along 6 held-out
answers, this cut agrees with the teacher's greedy token at 12.7% of them; an even spread
(every other layer) at 0%, the first 14 and the last at 0%: distillation starts from
there either way, but closer with this one.
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

import torch

from vllm_mtpspec.models import resolve_model

logger = logging.getLogger("mtpspec.student")
# What a model folder holds beside its weights and config, copied into every student folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "merges.txt")


class StudentError(ValueError):
    pass


def kept_layers(teacher_layers: int, student_layers: int) -> list[int]:
    """The teacher's layers a student of student_layers keeps: the first third, then the last."""
    if not 1 <= student_layers < teacher_layers:
        raise StudentError(f"--layers {student_layers}: a student keeps between 1 and {teacher_layers - 1} of the "
                           f"teacher's {teacher_layers} layers")
    first = student_layers // 3
    return list(range(first)) + list(range(teacher_layers - (student_layers - first), teacher_layers))


def make_student(teacher_dir: str | Path, out: str | Path, *, layers: int) -> Path:
    """Writes the cut teacher to `out`; returns the folder."""
    from transformers import AutoModelForCausalLM

    teacher_dir, out = Path(teacher_dir), Path(out)
    model = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype=torch.float32)
    config = model.config
    keep = kept_layers(config.num_hidden_layers, layers)
    decoder = model.get_decoder()
    decoder.layers = torch.nn.ModuleList([decoder.layers[i] for i in keep])
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in keep]
    config.num_hidden_layers = layers
    model.save_pretrained(str(out))
    for name in TOKENIZER_FILES + ("generation_config.json",):
        if (teacher_dir / name).is_file() and not (out / name).is_file():
            shutil.copy(teacher_dir / name, out / name)
    (out / "student.json").write_text(json.dumps({"teacher": str(teacher_dir), "kept_layers": keep}, indent=2) + "\n")
    logger.info("student of %d layers (the teacher's %s) written to %s", layers, keep, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_mtpspec_train.student",
        description="Cut a model to fewer layers (its first third and its last, initialized from its own) "
                    "and save it as a Hugging Face folder: the student that co-training (mode 'cotrain') distils.")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the teacher: a known name or an HF folder")
    parser.add_argument("--layers", type=int, required=True, help="decoder layers the student keeps")
    parser.add_argument("--out", required=True, help="the student's folder to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        make_student(resolve_model(args.model, dtype="fp32"), args.out, layers=args.layers)
    except StudentError as err:
        parser.error(str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
