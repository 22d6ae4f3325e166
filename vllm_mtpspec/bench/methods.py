"""The speculation methods a benchmark compares, as vLLM speculative configs.

- none: no speculation.
- none-again: a second engine without speculation; its speed-up over `none` is the
  run-to-run noise of the machine, measured in the same run.
- ngram: vLLM's prompt lookup (n-gram) proposer.
- suffix: vLLM's suffix decoding (needs the arctic-inference package).
- draft: vLLM's draft-model method with a truncated copy of the target (draft_model.py).
- eagle3: vLLM's own EAGLE-3 proposer (no plugin) on each heads directory that holds an
  EAGLE-3 drafter: a published folder as it is, an `eagle3` heads directory exported to
  the speculators format first (eagle3_format.py); the plugin's rows read the same weights.
- mtpspec-chain / mtpspec-tree: our heads, as top-1 chains or verified as trees; one
  variant per number of heads, per tree node budget, per quantization, with or without
  prompt lookup, and with the draft size the platform's default rule chooses (default),
  the fixed batch back-off (fixed) or planned per request from measured step costs
  (planned), per draft dtype (the platform's choice, "auto", by default), and per pacing
  of batches that started together (pace_cohorts: the default, or never, sampled or
  always), and per batch size from which the draft-size rule acts (batch_backoff_start:
  the platform's, or a number; at 1 the planner plans every step of a lone request).
"""
from __future__ import annotations

import importlib.util
import itertools
from dataclasses import dataclass, field
from pathlib import Path

from vllm_mtpspec.shipped import shipped_int2_heads_dir

KNOWN_METHODS = ("none", "none-again", "ngram", "suffix", "draft", "eagle3", "mtpspec-chain", "mtpspec-tree")
DRAFT_SIZES = ("default", "fixed", "planned")
# -> SpecOptions.draft_size; "default": none given, the platform's own rule (the row a user gets)
DRAFT_SIZE_OPTION = {"default": None, "fixed": "fixed", "planned": "planned"}
PROMPT_LOOKUP_MAX = 4  # as the ngram row's prompt_lookup_max, so the two draft from the same matches


@dataclass
class Method:
    name: str                      # unique label in tables and plots
    family: str                    # one of KNOWN_METHODS
    speculative_config: dict | None
    unavailable: str | None = None  # why it cannot run here (reported, not run)
    notes: dict = field(default_factory=dict)


def build_methods(names: list[str], *, model_dir: str, heads_dirs: list[str], num_heads: list[int], quants: list[str],
                  tree: str, work_dir: Path, max_tree_nodes: list[int] = (8,), num_spec_tokens: int = 3,
                  draft_layers: int = 6, lookups: list[bool] = (True,),
                  draft_sizes: list[str] = ("default",), draft_dtypes: list[str] = ("auto",),
                  pacings: list[str] = ("default",),
                  backoff_starts: list[int | None] = (None,), options: dict | None = None) -> list[Method]:
    """options: mtpspec options (SpecOptions) for every mtpspec row, applied last: they
    take effect over what the other arguments set, and each is named in the row's label."""
    unknown = [n for n in names if n not in KNOWN_METHODS]
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; choose from {', '.join(KNOWN_METHODS)}")
    methods: list[Method] = []
    for name in names:
        if name == "none":
            methods.append(Method("none", name, None))
        elif name == "none-again":
            methods.append(Method("none (again)", name, None,
                                  notes={"noise": "a second engine without speculation; its speed-up "
                                                  "over none is this run's noise"}))
        elif name == "ngram":
            methods.append(Method("ngram", name, {"method": "ngram", "num_speculative_tokens": num_spec_tokens,
                                                  "prompt_lookup_max": PROMPT_LOOKUP_MAX, "prompt_lookup_min": 2}))
        elif name == "suffix":
            missing = importlib.util.find_spec("arctic_inference") is None
            methods.append(Method("suffix", name, {"method": "suffix", "num_speculative_tokens": num_spec_tokens},
                                  unavailable="needs the arctic-inference package" if missing else None))
        elif name == "draft":
            from vllm_mtpspec.bench.draft_model import truncated_copy

            draft = truncated_copy(model_dir, draft_layers, work_dir / f"draft-{draft_layers}-layers")
            methods.append(Method(f"draft ({draft_layers}-layer truncated copy)", name,
                                  {"method": "draft_model", "model": str(draft),
                                   "num_speculative_tokens": num_spec_tokens},
                                  notes={"draft_model": f"the target's first {draft_layers} layers + LM head"}))
        elif name == "eagle3":
            for heads_dir in heads_dirs:
                drafter, unavailable = _stock_eagle3_drafter(heads_dir, model_dir, work_dir)
                tag = _heads_tag(heads_dir, _heads_config(heads_dir), several=len(heads_dirs) > 1)
                methods.append(Method(f"vLLM eagle3 k={num_spec_tokens}{tag}", name,
                                      {"method": "eagle3", "model": drafter, "num_speculative_tokens": num_spec_tokens},
                                      unavailable=unavailable, notes={"eagle3": "vLLM's own proposer, no plugin"}))
        else:
            for heads_dir, quant in itertools.product(heads_dirs, quants):
                heads, unavailable = heads_dir, None
                heads_config = _heads_config(heads_dir)
                # No tree asked: each heads directory's own kind picks its preset.
                method_tree = ("chain" if name == "mtpspec-chain" else tree if tree
                               else heads_config.kind.default_tree if heads_config is not None else "consensus")
                already_int2 = heads_config is not None and heads_config.quantization is not None
                if quant != "fp" and already_int2 and "fp" in quants:
                    continue  # the same engine as its "fp" row, which serves (and is labelled) INT2 already
                if quant != "fp" and not already_int2:
                    from vllm_mtpspec.checkpoint import HeadsError

                    try:
                        heads = str(_int2_heads(heads_dir, work_dir))
                    except HeadsError as err:  # heads that cannot be read: that row alone is not run
                        unavailable = str(err)
                int2 = quant != "fp" or already_int2
                heads_tag = _heads_tag(heads_dir, heads_config, several=len(heads_dirs) > 1)
                # A tree these heads cannot draft: reported with the reason, as vLLM would refuse it.
                refusal = heads_config.kind.tree_refusal(method_tree) if heads_config is not None else None
                unavailable = unavailable or (f"{heads_dir}/config.json: {refusal}" if refusal else None)
                budgets = [None] if method_tree == "chain" else max_tree_nodes
                for k, budget in itertools.product(num_heads, budgets):
                    for lookup, draft_size, dtype, paced, start in itertools.product(
                            lookups, draft_sizes, draft_dtypes, pacings, backoff_starts):
                        config = {"method": "mtpspec", "model": heads, "num_speculative_tokens": k,
                                  "tree": method_tree}
                        label = f"mtpspec-chain k={k}"
                        if budget is not None:
                            config["max_tree_nodes"] = budget
                            label = f"mtpspec-{method_tree} k={k} n<={budget}"
                        # Either way explicitly: the options' default may change.
                        config["prompt_lookup_max"] = PROMPT_LOOKUP_MAX if lookup else 0
                        if lookup:
                            label += " +lookup"
                        if draft_size != "default":
                            config["draft_size"] = DRAFT_SIZE_OPTION[draft_size]
                            label += f" {draft_size}-size"
                        config["draft_dtype"] = dtype
                        if len(draft_dtypes) > 1 or dtype != "auto":
                            label += f" drafts-{dtype}"
                        if paced != "default":
                            config["pace_cohorts"] = paced
                            label += f" paced-{paced}"
                        if start is not None:
                            config["batch_backoff_start"] = start
                            label += f" from-batch-{start}"
                        for key, value in (options or {}).items():
                            config[key] = value
                            label += f" {key}={value}"
                        methods.append(Method(label + heads_tag + (" int2" if int2 else ""), name, config,
                                              unavailable=unavailable))
    return methods


def _heads_config(heads_dir: str):
    """The directory's HeadsConfig, or None where it cannot be read here (the engine that
    loads it reports why)."""
    from vllm_mtpspec.checkpoint import HeadsError, read_heads_config

    try:
        return read_heads_config(heads_dir)
    except HeadsError:
        return None


def _stock_eagle3_drafter(heads_dir: str, model_dir: str, work_dir: Path) -> tuple[str, str | None]:
    """(the folder vLLM's eagle3 method reads, why it cannot run or None): a published
    EAGLE-3 folder as it is; an eagle3 heads directory written in the speculators format."""
    from vllm_mtpspec.checkpoint import load_heads
    from vllm_mtpspec.eagle3_format import is_eagle3_dir, with_own_lm_head, write_speculators
    from vllm_mtpspec.weights import embedding_and_lm_head

    if is_eagle3_dir(heads_dir):
        return heads_dir, None
    config = _heads_config(heads_dir)
    if config is None or config.kind.stock_vllm_method != "eagle3" or config.quantization is not None:
        what = "unreadable heads" if config is None else config.kind.label + (" in INT2" if config.quantization else "")
        return heads_dir, (f"{heads_dir} holds {what}; vLLM's eagle3 method serves full-precision EAGLE-3 "
                           "layers only")
    layer = load_heads(heads_dir)
    if layer.lm_head is None:
        layer = with_own_lm_head(layer, embedding_and_lm_head(model_dir)[1])
    out = work_dir / f"eagle3-{Path(heads_dir).name}"
    return str(write_speculators(layer, out, verifier=model_dir)), None


def _heads_tag(heads_dir: str, config, *, several: bool) -> str:
    """What tells rows of different heads apart: their kind (block, sequential) and draft
    vocabulary, and, when several heads are compared, the directory's name (two heads
    of one kind and vocabulary would otherwise share a label, and a row)."""
    name = f" [{Path(heads_dir).name}]" if several else ""
    if config is None:
        return name
    tag = f" {config.kind.row_tag}" if config.kind.row_tag else ""
    if config.feature_layers:
        tag += f" layers={','.join(map(str, config.feature_layers))}"
    if config.draft_vocab_size:
        tag += f" vocab={config.draft_vocab_size}"
    return tag + name


def _int2_heads(heads_dir: str, work_dir: Path) -> Path:
    """The shipped INT2 form of shipped heads (GPTQ); for other heads, round-to-nearest
    (the calibrated methods need training shards: `mtpspec heads quantize --method gptq`)."""
    from vllm_mtpspec.checkpoint import load_heads, save_heads

    shipped = shipped_int2_heads_dir(heads_dir)
    if shipped is not None:
        return shipped
    out = int2_copy_path(heads_dir, work_dir)
    if not (out / "config.json").is_file():
        save_heads(load_heads(heads_dir).quantized(group_size=64), out)
    return out


def int2_copy_path(heads_dir: str, work_dir: Path) -> Path:
    """Where the bench keeps its round-to-nearest copy of these heads (one per directory)."""
    import hashlib

    resolved = Path(heads_dir).resolve()
    return work_dir / f"heads-int2-{resolved.name}-{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
