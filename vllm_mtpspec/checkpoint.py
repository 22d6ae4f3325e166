"""Heads directories: `config.json` + `heads.safetensors`, and the base-model fingerprint.

Every failure names the file, the field and the fix, and happens when the heads are
loaded, before the first request: heads made for another model must never draft.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from vllm_mtpspec.config import ConfigError, HeadsConfig, layers_beyond
from vllm_mtpspec.draft_vocab import check_id_map
from vllm_mtpspec.eagle3_format import eagle3_format, eagle3_heads_config, eagle3_state, is_eagle3_dir, weights_file
from vllm_mtpspec.heads import DraftModule
from vllm_mtpspec.weights import EMBED, read_tensor

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "heads.safetensors"
# Rows of the input embedding that enter the fingerprint: enough to tell models apart,
# cheap to read from safetensors without loading the whole matrix.
FINGERPRINT_ROWS = 64


class HeadsError(ValueError):
    """A heads directory that cannot serve: the message says which file and what to do."""


def save_heads(heads: DraftModule, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().contiguous().cpu() for name, t in heads.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config = heads.config.to_dict()
    config["temperatures"] = [float(t) for t in heads.temperatures.tolist()]
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def read_heads_config(heads_dir: str | Path, *, target_layers: int | None = None) -> HeadsConfig:
    """The heads config of a heads directory, or of a published EAGLE-3 drafter's folder
    (eagle3_format.py; target_layers: the served model's layer count, for the layers it
    reads where the checkpoint names none)."""
    path = Path(heads_dir)
    if not path.is_dir():
        raise HeadsError(
            f"heads directory {path} does not exist; pass the folder written by "
            "`mtpspec heads init` or the training job's export"
        )
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise HeadsError(f"{config_path} is missing: {path} is not a heads directory")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise HeadsError(f"{config_path} is not valid JSON ({err}); re-export the heads") from None
    try:
        if eagle3_format(raw) is not None:
            return eagle3_heads_config(raw, source=str(config_path), target_layers=target_layers)
        return HeadsConfig.from_dict(raw, source=str(config_path))
    except ConfigError as err:
        message = str(err)  # every refusal names the file it came from
        raise HeadsError(message if message.startswith(str(config_path)) else f"{config_path}: {message}") from None


def heads_weights_file(heads_dir: str | Path) -> Path:
    """The file a heads directory (or a published EAGLE-3 drafter's folder) keeps its weights in."""
    path = Path(heads_dir)
    return weights_file(path) if is_eagle3_dir(path) else path / WEIGHTS_FILE


def load_heads(heads_dir: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               target_layers: int | None = None) -> DraftModule:
    """Loads heads (FP or INT2; INT2 stays packed), or a published EAGLE-3 drafter, and
    checks every tensor against config.json."""
    path = Path(heads_dir)
    config = read_heads_config(path, target_layers=target_layers)
    eagle3 = is_eagle3_dir(path)
    try:
        weights_path = weights_file(path) if eagle3 else path / WEIGHTS_FILE
    except ConfigError as err:
        raise HeadsError(str(err)) from None
    if not weights_path.is_file():
        raise HeadsError(f"{weights_path} is missing; re-export the heads")
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            state = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise HeadsError(
            f"{weights_path} is corrupt or truncated ({err}); re-export the heads or fetch the file again"
        ) from None
    if eagle3:
        try:
            state = eagle3_state(state, config, source=str(weights_path))
        except ConfigError as err:
            raise HeadsError(str(err)) from None
    heads = config.kind.build(config)
    expected = heads.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise HeadsError(
            f"{weights_path} does not match {path / CONFIG_FILE}: missing tensors {missing}, "
            f"unexpected tensors {unexpected} (head_kind, num_heads, tied, mlp_size, block.feature_layers, "
            "draft_vocab_size or quantization disagree)"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise HeadsError(
                f"{weights_path}: tensor {name!r} has shape {tuple(tensor.shape)}, but config.json "
                f"(hidden_size={config.hidden_size}, vocab_size={config.vocab_size}, "
                f"num_heads={config.num_heads}, draft_vocab_size={config.draft_vocab_size}) needs "
                f"{tuple(expected[name].shape)}"
            )
    if "draft_token_ids" in state and (reason := check_id_map(state["draft_token_ids"], vocab_size=config.vocab_size)):
        raise HeadsError(f"{weights_path}: the draft vocabulary's id map draft_token_ids {reason}; rebuild it with "
                         "`mtpspec heads draft-vocab`")
    heads.load_state_dict(state)
    if dtype is not None:
        # Packed codes and their fp16 scales keep their own dtypes.
        for module in heads.modules():
            for pname, param in list(module.named_parameters(recurse=False)):
                param.data = param.data.to(dtype)
    return heads.to(device).eval()


def stored_dtype(heads_dir: str | Path) -> torch.dtype | None:
    """The dtype the heads' floating-point weights are stored in (None: INT2 codes)."""
    with safe_open(str(Path(heads_dir) / WEIGHTS_FILE), framework="pt") as f:
        # The first matrix of each head kind: parallel heads' block, sequential heads' first
        # depth, the draft block's fusion. INT2 heads store codes under other names.
        for name in ("block.weight", "blocks.0.weight", "fuse.weight"):
            if name in f.keys():
                return f.get_slice(name)[:1].dtype
        return None


def model_fingerprint(model_dir: str | Path) -> str:
    """A short hash of what makes heads fit a model: architecture, shapes, tokenizer and
    the first rows of the input embedding (rounded to bf16, so bf16 and fp32 copies of
    one model share a fingerprint). Computed from files, so vLLM can check it without
    reading the (repacked) weights it loaded."""
    path = Path(model_dir)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise HeadsError(f"{config_path} is missing: pass a Hugging Face model folder")
    cfg = json.loads(config_path.read_text())
    text_cfg = cfg.get("text_config", cfg)
    digest = hashlib.sha256()
    for key in ("architectures", "hidden_size", "vocab_size", "num_hidden_layers", "model_type"):
        digest.update(f"{key}={text_cfg.get(key, cfg.get(key))!r};".encode())
    tokenizer = path / "tokenizer.json"
    if tokenizer.is_file():
        vocab = json.loads(tokenizer.read_text()).get("model", {}).get("vocab", {})
        digest.update(hashlib.sha256(json.dumps(vocab, sort_keys=True).encode()).digest())
    rows = read_tensor(path, EMBED, rows=FINGERPRINT_ROWS)
    if rows is not None:
        digest.update(rows.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


def check_heads_match_model(
    config: HeadsConfig,
    *,
    heads_dir: str | Path,
    hidden_size: int,
    vocab_size: int,
    fingerprint: str | None,
    num_layers: int | None = None,
) -> None:
    """Refuses heads made for another model, before they can draft garbage."""
    where = Path(heads_dir) / CONFIG_FILE
    made_for = f" (made for {config.base_model_name})" if config.base_model_name else ""
    if config.hidden_size != hidden_size:
        raise HeadsError(
            f"{where}: hidden_size={config.hidden_size} but the model's hidden size is {hidden_size}: "
            f"these heads{made_for} belong to another model; train or init heads for this one"
        )
    if config.vocab_size != vocab_size:
        raise HeadsError(
            f"{where}: vocab_size={config.vocab_size} but the model's vocabulary has {vocab_size} "
            f"entries: these heads{made_for} belong to another model"
        )
    layers = config.feature_layers
    if num_layers is not None and layers_beyond(layers, num_layers):
        raise HeadsError(
            f"{where}: block.feature_layers={layers} but the model has {num_layers} layers (0 .. {num_layers - 1}): "
            f"these heads{made_for} read layers it does not have; use heads trained for this model"
        )
    if fingerprint is not None and config.base_model_fingerprint and config.base_model_fingerprint != fingerprint:
        raise HeadsError(
            f"{where}: base_model_fingerprint={config.base_model_fingerprint} but the served model's is "
            f"{fingerprint}: these heads{made_for} were made for another model of the same shape; "
            "use heads trained for this model"
        )
