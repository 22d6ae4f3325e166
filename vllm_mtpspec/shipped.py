"""Where the drafters shipped inside the package lie. Its own module because the command
line and the bench both need it, and the command line imports the bench."""
from __future__ import annotations

from pathlib import Path

SHIPPED_HEADS = Path(__file__).parent / "shipped_heads"


def shipped_heads_dir(model_name: str = "smollm2-135m-instruct") -> Path | None:
    path = SHIPPED_HEADS / model_name
    return path if (path / "config.json").is_file() else None


def shipped_int2_heads_dir(heads_dir: str | Path) -> Path | None:
    """The shipped INT2 form of shipped heads (quantized by GPTQ on training shards; see
    its README), or None for any other heads directory."""
    heads = Path(heads_dir).resolve()
    if heads.parent != SHIPPED_HEADS.resolve():
        return None
    int2 = SHIPPED_HEADS / f"{heads.name}-int2"
    return int2 if (int2 / "config.json").is_file() else None
