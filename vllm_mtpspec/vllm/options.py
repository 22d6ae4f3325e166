"""`{"method": "mtpspec", ...}`: the user's speculative config, turned into vLLM's own
`custom_class` form plus `additional_config["mtpspec"]`, and checked before any engine
is built so that a mistake fails at start-up with a message that names it."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from vllm_mtpspec.checkpoint import check_heads_match_model, model_fingerprint, read_heads_config
from vllm_mtpspec.config import RETIRED_OPTIONS, ConfigError, HeadsConfig, SpecOptions

METHOD = "mtpspec"
PROPOSER_PATH = "vllm_mtpspec.vllm.proposer.MTPSpecProposer"
ADDITIONAL_CONFIG_KEY = "mtpspec"
# SpeculativeConfig keys that keep their vLLM meaning when given with method=mtpspec.
PASSTHROUGH_KEYS = frozenset({"num_speculative_tokens", "enforce_eager"})


def translate(spec: dict[str, Any], additional_config: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """method=mtpspec -> (vLLM speculative dict, additional_config with our options)."""
    spec = {k.replace("-", "_"): v for k, v in spec.items()}
    options = dict(spec.pop("options", None) or {})
    heads = spec.pop("model", None)
    spec.pop("method")
    vllm_spec = {"method": "custom_class", "model": PROPOSER_PATH}
    known_options = {f.name for f in dataclasses.fields(SpecOptions)}
    for key, value in spec.items():
        if key in PASSTHROUGH_KEYS:
            vllm_spec[key] = value
        elif key in known_options or key in RETIRED_OPTIONS:  # a retired one is named below
            options[key] = value
        else:
            raise ConfigError(
                f"speculative config: unknown option {key!r} for method 'mtpspec'; known options are "
                f"{sorted(PASSTHROUGH_KEYS | known_options | {'model', 'method'})}"
            )
    if heads is not None:
        options["heads"] = str(heads)
    if vllm_spec.get("num_speculative_tokens") is not None:
        options["num_speculative_tokens"] = vllm_spec["num_speculative_tokens"]
    merged = dict(additional_config or {})
    merged[ADDITIONAL_CONFIG_KEY] = _merge_options(options, merged.get(ADDITIONAL_CONFIG_KEY))
    # Names a bad key or value now.
    SpecOptions.from_dict(merged[ADDITIONAL_CONFIG_KEY], source="speculative config and additional_config['mtpspec']")
    return vllm_spec, merged


def _merge_options(from_spec: dict[str, Any], from_additional: Any) -> dict[str, Any]:
    """Options may be given in either place; one given in both must agree."""
    if from_additional is None:
        return from_spec
    if not isinstance(from_additional, dict):
        raise ConfigError(f"additional_config['{ADDITIONAL_CONFIG_KEY}'] must be a dict of mtpspec options, "
                          f"not {type(from_additional).__name__}")
    for key, value in from_spec.items():
        if key in from_additional and from_additional[key] != value:
            where = "'model'" if key == "heads" else repr(key)
            raise ConfigError(
                f"mtpspec option {key!r} is given twice with different values: {value!r} in the speculative config "
                f"(as {where}) and {from_additional[key]!r} in additional_config['{ADDITIONAL_CONFIG_KEY}']; "
                "give it in one place"
            )
    return {**from_additional, **from_spec}


def options_from_additional_config(additional_config: dict | None) -> SpecOptions:
    raw = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    if raw is None:
        raise ConfigError(
            "the mtpspec proposer needs its options: use speculative_config={'method': 'mtpspec', "
            "'model': HEADS_DIR, 'num_speculative_tokens': K}, or pass additional_config="
            "{'mtpspec': {'heads': HEADS_DIR}} with the custom_class form"
        )
    return SpecOptions.from_dict(dict(raw), source="additional_config['mtpspec']")


def check_against_model(
    options: SpecOptions,
    *,
    num_speculative_tokens: int | None,
    model_path: str,
    hidden_size: int,
    vocab_size: int,
    num_layers: int | None = None,
) -> HeadsConfig:
    """Everything that can be known before the engine starts: heads exist and load, fit
    the served model, and there are enough of them."""
    if not options.heads:
        raise ConfigError("speculative config: 'model' must be the heads directory (e.g. the folder "
                          "written by `mtpspec heads init` or the training job)")
    config = read_heads_config(options.heads, target_layers=num_layers)
    local = Path(model_path)
    fingerprint = model_fingerprint(local) if (local / "config.json").is_file() else None
    check_heads_match_model(config, heads_dir=options.heads, hidden_size=hidden_size,
                            vocab_size=vocab_size, fingerprint=fingerprint, num_layers=num_layers)
    k = num_speculative_tokens or options.num_speculative_tokens
    SpecOptions(num_speculative_tokens=k).depth_for(config, source="speculative config")
    if options.draft_vocab == "heads" and not config.draft_vocab_size:
        raise ConfigError(f"{options.heads}/config.json: draft_vocab='heads' was asked, and these heads carry no "
                          "draft vocabulary (draft_vocab_size 0): build one with `mtpspec heads draft-vocab`, "
                          "or leave draft_vocab out")
    return config
