"""What a drafter must know about the model it serves, read from the model folder's
config.json (and tokenizer files): one place for what differs between architectures, so
that a Llama 3.x, Qwen 2.5/3 or Gemma 3 folder a user brings needs no code change.

Families differ from Llama's layout in ways a drafter can see: Gemma multiplies its token
embedding by sqrt(hidden_size) before the first layer and keeps its RMSNorm gains as
1 + w, and its sliding layers attend to a window of the latest tokens only. Everything
else a drafter reads (hidden size, layers, vocabulary, tied LM head) is in every config.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


@dataclass(frozen=True)
class Family:
    """How a model family departs from Llama's layout (the default)."""
    scales_embedding: bool = False   # the model feeds embed_tokens(ids) * sqrt(hidden_size) to layer 0
    norm_gain_offset: float = 0.0    # RMSNorm multiplies by offset + weight
    needs_bos: bool = False          # prompts must start with BOS (the model degrades badly without)


# model_type (config.json) -> family; any type not named here is laid out as Llama is.
FAMILIES = {
    "gemma": Family(scales_embedding=True, norm_gain_offset=1.0, needs_bos=True),
    "gemma2": Family(scales_embedding=True, norm_gain_offset=1.0, needs_bos=True),
    "gemma3_text": Family(scales_embedding=True, norm_gain_offset=1.0, needs_bos=True),
}


def eagle3_default_layers(num_layers: int) -> list[int]:
    """The layers whose entering states EAGLE-3 reads where none are named: vLLM's default
    (low, middle, high: 2, L/2, L-3), as vLLM keeps them (distinct, ascending), so a
    model of a few layers gets fewer."""
    return sorted({layer for layer in (2, num_layers // 2, num_layers - 3) if 0 <= layer < num_layers})


class ModelProfileError(ValueError):
    pass


@dataclass(frozen=True)
class ModelProfile:
    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    tied_embeddings: bool
    embed_scale: float                       # layer 0 reads embed_tokens(ids) * embed_scale
    norm_gain_offset: float                  # the final norm's gain is offset + norm.weight
    layer_windows: tuple[int | None, ...]    # per layer: its sliding window, or None (full attention)
    bos_token_id: int | None
    needs_bos: bool

    @property
    def default_feature_layers(self) -> list[int]:
        return eagle3_default_layers(self.num_layers)

    def norm_gain(self, weight):
        """The gain a final RMSNorm with this weight applies."""
        return weight + self.norm_gain_offset if self.norm_gain_offset else weight

    @classmethod
    def from_config(cls, config: dict, *, where: str = "config.json") -> "ModelProfile":
        config = _text_config(config)
        missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if k not in config]
        if missing:
            raise ModelProfileError(f"{where}: no {', '.join(missing)}; a drafter needs the model's hidden size, "
                                    "layer count and vocabulary size: pass a causal language model's folder")
        model_type = config.get("model_type", "")
        family = FAMILIES.get(model_type, Family())
        d = int(config["hidden_size"])
        bos = config.get("bos_token_id")
        return cls(
            architecture=(config.get("architectures") or [""])[0],
            model_type=model_type,
            hidden_size=d,
            num_layers=int(config["num_hidden_layers"]),
            vocab_size=int(config["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            embed_scale=math.sqrt(d) if family.scales_embedding else 1.0,
            norm_gain_offset=family.norm_gain_offset,
            layer_windows=_layer_windows(config),
            bos_token_id=bos if isinstance(bos, int) else None,
            needs_bos=family.needs_bos,
        )


def _text_config(config: dict) -> dict:
    """A multimodal config's language model part (Gemma 3 4B+ nests it as text_config)."""
    text = config.get("text_config")
    if isinstance(text, dict) and "hidden_size" not in config:
        return {**text, "architectures": config.get("architectures"),
                "tie_word_embeddings": config.get("tie_word_embeddings", text.get("tie_word_embeddings"))}
    return config


def _layer_windows(config: dict) -> tuple[int | None, ...]:
    n = int(config["num_hidden_layers"])
    window = config.get("sliding_window")
    types = config.get("layer_types")
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if window and config.get("use_sliding_window", True):
        return (int(window),) * n
    return (None,) * n


@lru_cache(maxsize=16)
def _profile_of(config_path: str, mtime: float) -> ModelProfile:
    return ModelProfile.from_config(json.loads(Path(config_path).read_text()), where=config_path)


def model_profile(model_dir: str | Path) -> ModelProfile:
    """The profile of the model folder's config.json."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelProfileError(f"{model_dir}: no config.json; pass a Hugging Face model folder")
    return _profile_of(str(path), path.stat().st_mtime)


def profile_of_hf_config(config) -> ModelProfile:
    """The profile of a loaded transformers config (the one vLLM or transformers built)."""
    return ModelProfile.from_config(config.to_dict(), where=f"{getattr(config, 'name_or_path', '') or 'model'} config")
