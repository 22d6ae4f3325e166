"""A draft model for vLLM's `draft_model` method when the target has no smaller sibling:
the target's first layers plus its embedding, final norm and LM head (a truncated copy,
sharing the tokenizer). It is labelled as such wherever it appears."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def truncated_copy(model_dir: str | Path, num_layers: int, out_dir: str | Path) -> Path:
    """Write (once) an HF folder holding the first num_layers layers of model_dir."""
    from safetensors.torch import load_file, save_file

    source, out = Path(model_dir), Path(out_dir)
    config = json.loads((source / "config.json").read_text())
    total = config["num_hidden_layers"]
    if not 0 < num_layers < total:
        raise ValueError(f"a truncated draft model keeps 1..{total - 1} of {source}'s {total} layers, not {num_layers}")
    if (out / "config.json").is_file() and json.loads((out / "config.json").read_text()).get("num_hidden_layers") == num_layers:
        return out
    out.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(file, out / file.name)
    kept = {}
    for shard in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(shard).items():
            layer = _LAYER.search(name)
            if layer is None or int(layer.group(1)) < num_layers:
                kept[name] = tensor
    save_file(kept, out / "model.safetensors")
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
