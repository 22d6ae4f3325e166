"""Published EAGLE-3 drafters, read as they are, and ours written for stock vLLM.

Two formats hold an EAGLE-3 drafter (safetensors + config.json), both of which vLLM's
`eagle3` method serves:
- the speculators format: `speculators_model_type: "eagle3"`, the layer's shape in
  `transformer_layer_config`, `draft_vocab_size`, `norm_before_residual` (default true),
  `eagle_aux_hidden_state_layer_ids`, and `speculators_config` (proposal methods, verifier);
  the layer's weights under `layers.0.`;
- the original EAGLE-3 format: a Llama config with `architectures:
  ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`, optional `target_hidden_size` and
  `eagle_config.eagle_aux_hidden_state_layer_ids`; the layer's weights under `midlayer.`.
Both carry `fc`, `norm`, `lm_head` (draft_vocab_size rows) and, with a draft vocabulary,
`d2t` (draft index -> target id offsets) and `t2d`.

Reading gives an `eagle3` heads config (kinds/eagle3.py) and the state dict of
eagle3_layer.Eagle3Layer; what the plugin cannot compute exactly as vLLM does is refused
with the key and the fix. Writing gives the speculators format.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from vllm_mtpspec.config import BlockConfig, ConfigError, HeadsConfig
from vllm_mtpspec.model_profile import eagle3_default_layers

ORIGINAL_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
WEIGHTS_FILE = "model.safetensors"
# EAGLE-3 drafts any depth (each depth reads the one before): the deepest chain the plugin may ask of it.
MAX_DEPTH = 8
# The layer's weights, by their name in our module -> the name under the layer's prefix.
LAYER_WEIGHTS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "hidden_norm.weight": "hidden_norm.weight",
    "q_proj.weight": "self_attn.q_proj.weight",
    "k_proj.weight": "self_attn.k_proj.weight",
    "v_proj.weight": "self_attn.v_proj.weight",
    "o_proj.weight": "self_attn.o_proj.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "gate_proj.weight": "mlp.gate_proj.weight",
    "up_proj.weight": "mlp.up_proj.weight",
    "down_proj.weight": "mlp.down_proj.weight",
}
LAYER_PREFIXES = {"speculators": "layers.0.", "original": "midlayer."}


class Eagle3FormatError(ConfigError):
    """An EAGLE-3 checkpoint the plugin cannot draft with exactly as vLLM would."""


def eagle3_format(raw: dict[str, Any]) -> str | None:
    """"speculators" or "original" where a config.json holds an EAGLE-3 drafter, else None."""
    if "speculators_model_type" in raw:
        return "speculators"
    if any(arch in ORIGINAL_ARCHITECTURES for arch in raw.get("architectures") or []):
        return "original"
    return None


def _layer_config(raw: dict[str, Any], flavour: str) -> dict[str, Any]:
    return raw.get("transformer_layer_config") or {} if flavour == "speculators" else raw


def eagle3_heads_config(raw: dict[str, Any], *, source: str, target_layers: int | None = None) -> HeadsConfig:
    """The heads config of an EAGLE-3 checkpoint's config.json (raw). target_layers: the
    served model's layer count, which gives the layers read where the checkpoint names none
    (vLLM's default, 2, L/2 and L - 3)."""
    flavour = eagle3_format(raw)

    def refuse(key: str, why: str) -> Eagle3FormatError:
        return Eagle3FormatError(f"{source}: {key}: {why}")

    if flavour == "speculators" and raw["speculators_model_type"] != "eagle3":
        raise refuse("speculators_model_type", f"{raw['speculators_model_type']!r} is not a drafter the plugin "
                     "reads; it reads 'eagle3' (serve this one with vLLM's own method for it)")
    layer = _layer_config(raw, flavour)
    if not layer:
        raise refuse("transformer_layer_config", "missing: a speculators-format EAGLE-3 config gives the draft "
                     "layer's shape there")
    model_type = layer.get("model_type", "llama")
    if model_type != "llama":
        raise refuse("model_type", f"{model_type!r}: the plugin computes Llama-style EAGLE-3 layers only")
    if layer.get("num_hidden_layers", 1) != 1:
        raise refuse("num_hidden_layers", f"{layer['num_hidden_layers']}: the plugin drafts with one-layer "
                     "EAGLE-3 drafters (the published form)")
    for key in ("attention_bias", "mlp_bias"):
        if layer.get(key):
            raise refuse(key, "true: the plugin's EAGLE-3 layer has no biases; use a drafter without them")
    if layer.get("rope_scaling"):
        raise refuse("rope_scaling", f"{layer['rope_scaling']}: the plugin's EAGLE-3 layer applies plain RoPE; "
                     "a drafter with scaled RoPE is not supported yet")
    if layer.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", f"{layer['hidden_act']!r}: the plugin's EAGLE-3 layer uses SiLU")
    for key in ("norm_before_fc", "fc_norm", "norm_output"):
        if raw.get(key, layer.get(key)):
            raise refuse(key, "true: a variant of the EAGLE-3 layer the plugin does not compute; use a drafter "
                         "without it")
    hidden = int(layer["hidden_size"])
    target_hidden = raw.get("target_hidden_size", layer.get("target_hidden_size")) or hidden
    if target_hidden != hidden:
        raise refuse("target_hidden_size", f"{target_hidden} differs from hidden_size={hidden}: the plugin's "
                     "EAGLE-3 layer reads target states of its own width")
    vocab = int(layer["vocab_size"])
    draft_vocab = raw.get("draft_vocab_size", layer.get("draft_vocab_size")) or vocab
    layers = (raw.get("eagle_aux_hidden_state_layer_ids")
              or (raw.get("eagle_config") or layer.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
    if not layers:
        if target_layers is None:
            raise refuse("eagle_aux_hidden_state_layer_ids", "not given, and which layers vLLM reads by default "
                         "depends on the served model: load it for a model, or add the layer ids")
        layers = eagle3_default_layers(target_layers)
    norm_before_residual = raw.get("norm_before_residual", layer.get("norm_before_residual",
                                                                     flavour == "speculators"))
    heads = int(layer["num_attention_heads"])
    block = BlockConfig(
        attention_heads=heads,
        kv_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads),
        mlp_size=int(layer["intermediate_size"]),
        rope_theta=float(layer.get("rope_theta") or (layer.get("rope_parameters") or {}).get("rope_theta") or 10000.0),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        window=int(layer.get("max_position_embeddings") or 1 << 20),
        feature_layers=sorted(int(i) for i in layers),
        norm_before_residual=bool(norm_before_residual),
    )
    name = (((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or "")
    return HeadsConfig(num_heads=MAX_DEPTH, hidden_size=hidden, vocab_size=vocab, tied=False, head_kind="eagle3",
                       head_input="hidden+token", block=block,
                       draft_vocab_size=0 if draft_vocab == vocab else int(draft_vocab), base_model_name=name)


def eagle3_state(tensors: dict[str, torch.Tensor], config: HeadsConfig, *, source: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as eagle3_layer.Eagle3Layer's state dict (the layer's
    weights under whichever format's prefix holds them)."""
    prefix = next((p for p in LAYER_PREFIXES.values() if f"{p}{LAYER_WEIGHTS['q_proj.weight']}" in tensors), None)
    if prefix is None:
        raise Eagle3FormatError(f"{source}: no draft layer's weights (looked for "
                                f"{[p + LAYER_WEIGHTS['q_proj.weight'] for p in LAYER_PREFIXES.values()]}); is this "
                                "an EAGLE-3 checkpoint?")
    if "embed_tokens.weight" in tensors:
        raise Eagle3FormatError(f"{source}: embed_tokens.weight: the plugin drafts with the served model's own "
                                "embedding; a drafter that carries its own is not supported yet")
    state = {}
    wanted = {name: prefix + key for name, key in LAYER_WEIGHTS.items()}
    wanted.update({"fc.weight": "fc.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"})
    for name, key in wanted.items():
        if key not in tensors:
            raise Eagle3FormatError(f"{source}: tensor {key!r} is missing; re-export the drafter whole")
        state[name] = tensors[key]
    rows = state["lm_head.weight"].shape[0]
    expected_rows = config.draft_vocab_size or config.vocab_size
    if rows != expected_rows:
        raise Eagle3FormatError(f"{source}: lm_head.weight has {rows} rows and draft_vocab_size is {expected_rows}: "
                                "set draft_vocab_size to the head's rows")
    if config.draft_vocab_size:
        if "d2t" not in tensors:
            raise Eagle3FormatError(f"{source}: d2t is missing: a drafter with draft_vocab_size={rows} < "
                                    f"vocab_size={config.vocab_size} maps its rows to target ids with it")
        d2t = tensors["d2t"].long()
        if d2t.shape != (rows,):
            raise Eagle3FormatError(f"{source}: d2t has shape {tuple(d2t.shape)}, one offset per row of lm_head "
                                    f"({rows}) is needed")
        state["draft_token_ids"] = torch.arange(rows) + d2t
    return state


def is_eagle3_dir(path: str | Path) -> bool:
    config_path = Path(path) / "config.json"
    try:
        return eagle3_format(json.loads(config_path.read_text())) is not None
    except (OSError, json.JSONDecodeError):
        return False


def weights_file(path: str | Path) -> Path:
    """The checkpoint's safetensors file (model.safetensors, or the one file there is)."""
    path = Path(path)
    found = sorted(path.glob("*.safetensors"))
    if (path / WEIGHTS_FILE).is_file():
        return path / WEIGHTS_FILE
    if len(found) == 1:
        return found[0]
    raise Eagle3FormatError(f"{path}: {'no' if not found else len(found)} safetensors files; an EAGLE-3 drafter "
                            f"keeps its weights in one ({WEIGHTS_FILE})")


def with_own_lm_head(layer, lm_head_weight: torch.Tensor):
    """A tied layer as one with its own LM head: the target's rows ([V, d]) at its draft
    vocabulary (all of them without one), written out in full as published drafters are."""
    from vllm_mtpspec.eagle3_layer import Eagle3Layer

    if layer.lm_head is not None:
        return layer
    config = HeadsConfig.from_dict({**layer.config.to_dict(), "tied": False})
    out = Eagle3Layer(config)
    ids = layer.draft_vocab
    rows = lm_head_weight if ids is None else lm_head_weight[ids.to(lm_head_weight.device)]
    out.load_state_dict({**layer.state_dict(), "lm_head.weight": rows.to(layer.dtype)})
    return out


def write_speculators(layer, out: str | Path, *, verifier: str = "", speculative_tokens: int = 3) -> Path:
    """An Eagle3Layer with its own LM head in the speculators format, which stock vLLM's
    `eagle3` method serves."""
    from safetensors.torch import save_file

    config = layer.config
    if layer.lm_head is None:
        raise ValueError("write the layer with its own LM head (the target's rows at its draft vocabulary); a tied "
                         "layer has none to write")
    block, out = config.block, Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = layer.state_dict()
    tensors = {LAYER_PREFIXES["speculators"] + key: state[name] for name, key in LAYER_WEIGHTS.items()}
    tensors.update({"fc.weight": state["fc.weight"], "norm.weight": state["norm.weight"],
                    "lm_head.weight": state["lm_head.weight"]})
    if config.draft_vocab_size:
        ids = state["draft_token_ids"].long()
        tensors["d2t"] = ids - torch.arange(ids.shape[0])
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(out / WEIGHTS_FILE),
              metadata={"format": "pt"})
    layer_config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": config.hidden_size,
        "intermediate_size": block.mlp_size, "num_attention_heads": block.attention_heads,
        "num_key_value_heads": block.kv_heads, "head_dim": block.head_dim, "num_hidden_layers": 1,
        "rms_norm_eps": block.rms_norm_eps, "rope_theta": block.rope_theta, "vocab_size": config.vocab_size,
        "max_position_embeddings": block.window, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": str(state["norm.weight"].dtype).removeprefix("torch."),
    }
    raw = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
        "transformer_layer_config": layer_config, "draft_vocab_size": config.draft_vocab_size or config.vocab_size,
        "norm_before_residual": block.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": list(block.feature_layers),
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy",
                                                     "speculative_tokens": speculative_tokens}],
                               "verifier": {"name_or_path": verifier or config.base_model_name,
                                            "architectures": ["LlamaForCausalLM"]}},
    }
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out
