"""Where the drafters shipped inside the package lie. Its own module because the command
line and the bench both need it, and the command line imports the bench."""
from __future__ import annotations

from pathlib import Path

SHIPPED_HEADS = Path(__file__).parent / "shipped_heads"


def shipped_heads_dir(model_name: str = "smollm2-135m-instruct") -> Path | None:
    """The drafter shipped for a known model (models.MODELS), or None: none ships for it, or
    model_name is a folder (a Hugging Face model folder has a config.json too)."""
    path = SHIPPED_HEADS / model_name
    if path.parent != SHIPPED_HEADS:
        return None
    return path if (path / "config.json").is_file() else None


def shipped_heads_for(model_name: str, command: str) -> Path:
    """The drafter shipped for the model a command serves, or a clear exit naming the fix."""
    path = shipped_heads_dir(model_name)
    if path is None:
        raise SystemExit(f"{command}: no drafter ships for {model_name}; pass --heads DIR (a drafter trained for "
                         "it: docs/training.md)")
    return path


def shipped_int2_heads_dir(heads_dir: str | Path) -> Path | None:
    """The shipped INT2 form of shipped heads (quantized by GPTQ on training shards; see
    its README), or None for any other heads directory."""
    heads = Path(heads_dir).resolve()
    if heads.parent != SHIPPED_HEADS.resolve():
        return None
    int2 = SHIPPED_HEADS / f"{heads.name}-int2"
    return int2 if (int2 / "config.json").is_file() else None
