"""From the last Ray Train checkpoint to a heads directory (and its INT2 copy): fit one
temperature per head on held-out data, record measured rank accuracies (static trees use
them), evaluate, and draw the loss curves.

Heads trained outside the job are calibrated the same way on the CPU:

    python -m vllm_mtpspec_train.export HEADS_DIR --held-out runs/sd-ctx-layers/held-out --out CALIBRATED_DIR
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from vllm_mtpspec.checkpoint import load_heads, model_fingerprint, save_heads
from vllm_mtpspec.models import resolve_model
from vllm_mtpspec.shards import list_shards
from vllm_mtpspec.weights import embedding_and_lm_head

logger = logging.getLogger("mtpspec.train")


def plot_losses(metrics_path: Path, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in map(json.loads, filter(str.strip, metrics_path.read_text().splitlines())) if "loss" in r]
    if not rows:
        return
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    heads = sorted(int(k.split("_")[1]) for k in rows[0] if k.startswith("ce_"))
    for i in heads:
        ax.plot(steps, [r[f"ce_{i}"] for r in rows], label=f"head {i + 1} cross-entropy")
    ax.plot(steps, [r["loss"] for r in rows], "k--", label="total loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (candidate-set softmax)")
    ax.set_title("MTP head training loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _save_png_with_palette(fig, out_png)
    plt.close(fig)


def _save_png_with_palette(fig, out_png: Path) -> None:
    """A line plot has a few dozen colours; as a 256-colour palette PNG it is a third of the
    RGBA size, which matters for a plot that ships inside the repository."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    Image.open(buffer).convert("RGB").quantize(256).save(out_png, optimize=True)


def _export_student(state: dict, student_dir: Path, out: Path) -> Path:
    """The trained student as a Hugging Face folder (its heads are fingerprinted to it)."""
    import shutil

    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(str(student_dir), dtype=torch.float32)
    student.load_state_dict({k.removeprefix("student."): v for k, v in state["model"].items() if k.startswith("student.")})
    student.save_pretrained(str(out))
    from vllm_mtpspec_train.student import TOKENIZER_FILES

    for name in TOKENIZER_FILES:
        if (student_dir / name).is_file():
            shutil.copy(student_dir / name, out / name)
    return out


def _student_held_out(config, student_dir: Path, out: Path) -> list[Path]:
    """Held-out shards for heads that read a student's states: the student's pass along the
    teacher's held-out answers (the job's held-out shards hold the teacher's states)."""
    from vllm_mtpspec_train.answers import shards_from_answers
    from vllm_mtpspec_train.data import answers_dir_for

    shards_from_answers(student_dir, answers_dir_for(config.held_out_data, config.held_out_answers), out,
                        answers_by=resolve_model(config.model, dtype="fp32"),
                        context_rows=config.context_rows if config.kind.keeps_context else 0)
    return list_shards(out)


def calibrate(heads, held_out: list[Path], *, lm_head: torch.Tensor, embed: torch.Tensor) -> dict:
    """Fits one temperature per head and records the rank accuracies (static trees read
    them) on held-out shards, in place; returns the held-out evaluation."""
    from vllm_mtpspec_train.evaluate import evaluate_heads

    report = evaluate_heads(heads, held_out, lm_head=lm_head, embed=embed, fit_temperatures=True)
    heads.config.temperatures = report.pop("temperatures")
    heads.temperatures = torch.tensor(heads.config.temperatures)
    heads.config.rank_accuracy = report["rank_accuracy"]
    return report


def export_heads(config, checkpoint, *, init_dir: Path, model_dir: Path, held_out: list[Path], metrics_path: Path,
                 train_shards: list[Path] = ()) -> dict:
    heads = load_heads(init_dir)
    with checkpoint.as_directory() as folder:
        state = torch.load(Path(folder) / "state.pt", weights_only=False)
    heads_state = {k.removeprefix("heads."): v for k, v in state["model"].items() if k.startswith("heads.")}
    heads.load_state_dict(heads_state)
    out = Path(config.out)
    summary: dict = {"config": config.to_dict()}
    if config.mode == "cotrain":
        model_dir = _export_student(state, model_dir, out / "student")
        summary["student_dir"] = str(model_dir)
        if config.mtp_weight == 0:  # the student trained alone: there is no drafter to write
            if metrics_path.is_file():
                plot_losses(metrics_path, out / "loss_curves.png")
            return summary
        heads.config.base_model_fingerprint = model_fingerprint(model_dir)
        held_out = _student_held_out(config, model_dir, out / "student-held-out") if config.held_out_data else []
    embed, lm_head = embedding_and_lm_head(model_dir)
    if held_out:
        summary["held_out"] = {"fp32": calibrate(heads, held_out, lm_head=lm_head, embed=embed)}
    save_heads(heads, out)
    summary["heads_dir"] = str(out)
    if config.int2_group_size:
        int2_dir = out.with_name(out.name + "-int2")
        from vllm_mtpspec_train.quantize_aware import int2_copy

        save_heads(int2_copy(heads, config, list(train_shards), lm_head=lm_head, embed=embed), int2_dir)
        summary["int2_dir"] = str(int2_dir)
        if held_out:
            from vllm_mtpspec_train.evaluate import evaluate_heads

            summary["held_out"]["int2"] = evaluate_heads(load_heads(int2_dir), held_out, lm_head=lm_head, embed=embed)
    if metrics_path.is_file():
        plot_losses(metrics_path, out / "loss_curves.png")
        summary["loss_curves"] = str(out / "loss_curves.png")
    logger.info("heads written to %s", out)
    return summary


def main(argv: list[str] | None = None) -> int:
    import argparse

    from vllm_mtpspec.checkpoint import check_heads_match_model, stored_dtype

    parser = argparse.ArgumentParser(
        prog="python -m vllm_mtpspec_train.export",
        description="Calibrate trained heads on held-out shards (one temperature per head, rank accuracies) "
                    "and write them, with the run's summary, loss log and curves where the folder has them.")
    parser.add_argument("heads", help="the trained heads directory")
    parser.add_argument("--held-out", required=True,
                        help="held-out shards (a folder; `python -m vllm_mtpspec_train.data`)")
    parser.add_argument("--out", required=True, help="the heads directory to write")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    model_dir = resolve_model(args.model, dtype="fp32")
    shards = list_shards(args.held_out)
    if not shards:
        parser.error(f"--held-out {args.held_out}: no shards there; build them with "
                     "`python -m vllm_mtpspec_train.data`")
    heads = load_heads(args.heads)
    embed, lm_head = embedding_and_lm_head(model_dir)
    check_heads_match_model(heads.config, heads_dir=args.heads, hidden_size=embed.shape[1], vocab_size=embed.shape[0],
                            fingerprint=model_fingerprint(model_dir))
    dtype = stored_dtype(args.heads) or torch.float32
    report = calibrate(heads, shards, lm_head=lm_head, embed=embed)
    out = Path(args.out)
    save_heads(heads.to(dtype), out)  # stored as it came (fp16 stays fp16)
    run = Path(args.heads).parent
    summary = {"held_out": {"fp32": report}, "held_out_shards": args.held_out, "heads_dir": str(out)}
    if (run / "summary.json").is_file():
        summary["training"] = json.loads((run / "summary.json").read_text())
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if (run / "train_log.jsonl").is_file():
        plot_losses(run / "train_log.jsonl", out / "loss_curves.png")
    logger.info("calibrated heads written to %s: conditional top-1 %s", out, report.get("conditional_top1"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
