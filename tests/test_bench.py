"""`mtpspec bench` pieces that need no engine: prompts, batches, methods, the derived
draft model, the report's arithmetic, tables and plots."""
import json

import pytest
import torch

from vllm_mtpspec.bench.draft_model import truncated_copy
from vllm_mtpspec.bench.methods import DRAFT_SIZES, Method, build_methods
from vllm_mtpspec.bench.prompts import load_bench_prompts
from vllm_mtpspec.bench.report import markdown, plot, summarize
from vllm_mtpspec.bench.runner import Tally, batches_for
from vllm_mtpspec.prompts import Prompt, PromptsError


def test_humaneval_and_jsonl_prompts_are_interleaved(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"q{i}", "category": "writing"}) for i in range(3)) + "\n")
    prompts = load_bench_prompts(f"humaneval,{path}", 5)
    assert [p.category for p in prompts] == ["code", "writing", "code", "writing", "code"]
    assert prompts[0].id == "HumanEval/0" and "def " in prompts[0].text
    with pytest.raises(PromptsError, match="not a file"):
        load_bench_prompts("no-such-source", 3)


def test_batches_repeat_prompts_to_fill_every_batch():
    prompts = [Prompt(str(i)) for i in range(5)]
    assert [len(b) for b in batches_for(prompts, 1)] == [1] * 5
    assert [[p.text for p in b] for b in batches_for(prompts, 4)] == [["0", "1", "2", "3"], ["4", "0", "1", "2"]]
    assert [len(b) for b in batches_for(prompts, 16)] == [16]


def test_every_engine_decodes_each_settings_first_batch_untimed_before_its_rounds(tmp_path, monkeypatch):
    """The figures are steady state: the planner has measured each kind of batch before it
    is timed, and engines without speculation get the same warm-up."""
    from vllm_mtpspec.bench import runner

    calls = []

    class FakeWorker:
        def __init__(self, name, *args):
            self.name = name

        def wait_ready(self):
            return None

        def generate(self, batch):
            calls.append((self.name, len(batch.prompts), batch.temperature, batch.max_tokens))
            tokens = [[1] * batch.max_tokens for _ in batch.prompts]
            return {"token_ids": tokens, "seconds": 1.0, "counters": {}}

        def close(self):
            pass

    monkeypatch.setattr(runner, "EngineWorker", FakeWorker)
    methods = [Method("none", "none", None), Method("other", "none", None)]
    prompts = [Prompt(str(i)) for i in range(6)]
    tallies = runner.run_benchmark(methods, prompts, model="m", batch_sizes=[4], temperatures=[0.0, 0.7],
                                   max_new_tokens=5, rounds=2, engine={}, log_dir=tmp_path)
    # Start-up (one prompt, 8 tokens), then per temperature: each engine's untimed first
    # batch, then 2 rounds of the 2 batches of 4, the engines taking turns.
    greedy = [c for c in calls if c[2] == 0.0 and c[3] == 5]
    assert len(greedy) == 2 * (1 + 2 * 2) and greedy[:2] == [("none", 4, 0.0, 5), ("other", 4, 0.0, 5)]
    assert len([c for c in calls if c[2] == 0.7]) == 2 * (1 + 2 * 2)
    assert tallies[("none", 4, 0.0)].tokens == 2 * 2 * 4 * 5  # the warm-up batch is not counted
    assert tallies[("other", 4, 0.7)].seconds == 2 * 2


def test_unknown_methods_are_named(tmp_path):
    with pytest.raises(ValueError, match="unknown \\['medusa'\\]"):
        build_methods(["none", "medusa"], model_dir="m", heads_dirs=["h"], num_heads=[2], quants=["fp"],
                      tree="consensus", work_dir=tmp_path)


def test_without_a_tree_asked_each_heads_kind_picks_its_preset(tmp_path, tiny_model, tiny_model_dir):
    from vllm_mtpspec.checkpoint import save_heads
    from vllm_mtpspec.heads_init import init_draft_block, init_heads

    parallel = save_heads(init_heads(tiny_model, tiny_model_dir, num_heads=2), tmp_path / "parallel")
    block = save_heads(init_draft_block(tiny_model, tiny_model_dir, num_heads=2), tmp_path / "block")
    methods = build_methods(["mtpspec-tree"], model_dir="m", heads_dirs=[str(parallel), str(block)], num_heads=[2],
                            quants=["fp"], tree=None, work_dir=tmp_path)
    assert [m.speculative_config["tree"] for m in methods] == ["consensus", "dynamic"]
    assert all(m.unavailable is None for m in methods)
    # A tree asked for is drafted as asked, or refused with the reason where the kind cannot.
    asked = build_methods(["mtpspec-tree"], model_dir="m", heads_dirs=[str(block)], num_heads=[2], quants=["fp"],
                          tree="consensus", work_dir=tmp_path)
    assert "drafts chains and dynamic trees only" in asked[0].unavailable


def test_mtpspec_variants_per_head_count_and_prompt_lookup(tmp_path):
    methods = build_methods(["ngram", "mtpspec-chain"], model_dir="m", heads_dirs=["h"], num_heads=[2, 3],
                            quants=["fp"], tree="consensus", work_dir=tmp_path, lookups=[False, True])
    assert [m.name for m in methods] == ["ngram", "mtpspec-chain k=2", "mtpspec-chain k=2 +lookup",
                                         "mtpspec-chain k=3", "mtpspec-chain k=3 +lookup"]
    with_lookup = methods[2].speculative_config
    assert with_lookup["prompt_lookup_max"] == methods[0].speculative_config["prompt_lookup_max"]
    assert methods[1].speculative_config["prompt_lookup_max"] == 0  # off, whatever the default
    from vllm_mtpspec.vllm.options import translate

    translate(with_lookup, None)  # a config vLLM will accept


def test_tree_rows_per_node_budget_and_chains_once(tmp_path):
    methods = build_methods(["mtpspec-chain", "mtpspec-tree"], model_dir="m", heads_dirs=["h"], num_heads=[4],
                            quants=["fp"], tree="consensus", work_dir=tmp_path, max_tree_nodes=[8, 16])
    assert [m.name for m in methods] == ["mtpspec-chain k=4 +lookup", "mtpspec-consensus k=4 n<=8 +lookup",
                                         "mtpspec-consensus k=4 n<=16 +lookup"]
    assert "max_tree_nodes" not in methods[0].speculative_config
    assert [m.speculative_config["max_tree_nodes"] for m in methods[1:]] == [8, 16]


def test_engine_settings_serve_the_asked_dtype():
    from vllm_mtpspec.bench.runner import engine_settings

    fp32 = engine_settings(4, 512, 64, bytes_per_token=1000)
    bf16 = engine_settings(4, 512, 64, bytes_per_token=500, dtype="bf16")
    assert (fp32["dtype"], bf16["dtype"]) == ("float32", "bfloat16")
    assert bf16["kv_cache_memory_bytes"] < fp32["kv_cache_memory_bytes"]


def test_truncated_draft_model_keeps_the_first_layers(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    out = truncated_copy(tiny_model_dir, 1, tmp_path / "draft")
    config = json.loads((out / "config.json").read_text())
    names = load_file(out / "model.safetensors").keys()
    assert config["num_hidden_layers"] == 1
    assert any(".layers.0." in n for n in names) and not any(".layers.1." in n for n in names)
    assert any("embed_tokens" in n for n in names)
    with pytest.raises(ValueError, match="keeps 1"):
        truncated_copy(tiny_model_dir, 0, tmp_path / "none")


def tally(tokens, seconds, outputs, **counters):
    t = Tally()
    t.add({"token_ids": outputs, "seconds": seconds, "counters": counters}, "code")
    t.tokens = tokens
    return t


def test_report_arithmetic_tables_and_plots(tmp_path):
    methods = [Method("none", "none", None), Method("mtpspec-chain k=3", "mtpspec-chain", {}),
               Method("suffix", "suffix", {}, unavailable="needs the arctic-inference package")]
    same, other = [[1, 2, 3]], [[1, 2, 4]]
    tallies = {
        ("none", 1, 0.0): tally(100, 10.0, same),
        ("mtpspec-chain k=3", 1, 0.0): tally(100, 8.0, same, num_drafts=40, num_accepted_tokens=30,
                                             num_accepted_tokens_per_pos=[20, 10, 0], draft_seconds=0.8),
        ("none", 4, 0.0): tally(400, 10.0, same),
        ("mtpspec-chain k=3", 4, 0.0): tally(400, 12.5, other, num_drafts=100, num_accepted_tokens=50,
                                             num_accepted_tokens_per_pos=[40, 10, 0], draft_seconds=1.0),
    }
    rows = summarize(methods, tallies)
    chain1 = next(r for r in rows if r["method"].startswith("mtpspec") and r["batch_size"] == 1)
    assert chain1["speedup"] == 1.25 and chain1["mean_accepted_length"] == 1.75
    assert chain1["acceptance_per_position"] == [0.5, 0.25]
    assert chain1["efficiency"] == round(1.25 / 1.75, 3) and chain1["drafting_share"] == 0.1
    assert chain1["identical_greedy_output"] is True
    # 100 tokens, 30 of them accepted drafts: 70 steps, with drafts or without.
    assert chain1["tokens_per_step"] == round(100 / 70, 4)
    assert next(r for r in rows if r["method"] == "none" and r["batch_size"] == 1)["tokens_per_step"] == 1.0
    chain4 = next(r for r in rows if r["method"].startswith("mtpspec") and r["batch_size"] == 4)
    assert chain4["speedup"] == 0.8 and chain4["identical_greedy_output"] is False
    table = markdown(rows, methods, [], "## test")
    assert "| mtpspec-chain k=3 | 1 | 12.5 | 1.25x | 1.75 | 1.43 |" in table
    assert "| NO |" in table and "suffix (needs the arctic-inference package)" in table
    png = tmp_path / "bench.png"
    plot(rows, png, "test")
    from PIL import Image

    with Image.open(png) as image:
        assert image.size[0] > 1000 and image.size[1] > 400


def test_drafts_accepted_past_a_stop_do_not_count():
    """vLLM's counter says 10 drafts were accepted in 4 verification steps; the output kept
    12 tokens over 6 steps that emitted any (the prefill's first token, 4 steps with drafts
    and one without), so 6 drafts were accepted up to the stop: 4 more ran past it."""
    methods = [Method("none", "none", None), Method("ngram k=3", "ngram", {})]
    tallies = {("none", 1, 0.0): tally(12, 1.0, [[0] * 12]),
               ("ngram k=3", 1, 0.0): tally(12, 1.0, [[0] * 12], num_drafts=4, num_accepted_tokens=10,
                                            emitting_steps=6)}
    ngram = next(r for r in summarize(methods, tallies) if r["method"] == "ngram k=3")
    assert ngram["tokens_per_step"] == 2.0
    assert ngram["mean_accepted_length"] == 2.5


@pytest.mark.slow
def test_the_workers_step_count_is_what_the_output_kept(tmp_path):
    """The bench's engine processes, vLLM alone and vLLM's ngram (which drafts past
    max_tokens): the same tokens; alone, every request-step emits one; with ngram, tokens -
    steps never exceeds vLLM's own accepted count. (Processes of their own, as the bench
    runs them: ngram loads numba, which vLLM's in-process engines of later tests trip on.)"""
    from tests.test_vllm_integration import ENGINE
    from vllm_mtpspec.bench.worker import Batch, EngineWorker
    from vllm_mtpspec.models import fetch_model
    from vllm_mtpspec.prompts import Prompt

    model = str(fetch_model("smollm2-135m-instruct", dtype="fp32"))
    batch = Batch([Prompt("Repeat after me, ten times: red green blue. " * 4, "general", "a"),
                   Prompt("Hi!", "general", "b")], temperature=0.0, max_tokens=12)
    replies = {}
    for name, spec in (("none", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3})):
        worker = EngineWorker(name, model, ENGINE, spec, str(tmp_path / f"{name}.log"))
        try:
            assert worker.wait_ready() is None
            replies[name] = worker.generate(batch)
        finally:
            worker.close()
    alone, ngram = replies["none"], replies["ngram"]
    assert ngram["token_ids"] == alone["token_ids"] and sum(map(len, alone["token_ids"])) == 24
    assert alone["counters"]["emitting_steps"] == 24
    counters = ngram["counters"]
    assert counters["num_drafts"] > 0
    assert 2 <= counters["emitting_steps"] < 24
    assert 24 - counters["emitting_steps"] <= counters["num_accepted_tokens"]


@pytest.mark.slow
def test_bench_end_to_end_writes_json_markdown_and_plot(tmp_path):
    """Two engines (vLLM alone and mtpspec trees), HumanEval prompts, batch sizes 1 and 2."""
    from PIL import Image

    from vllm_mtpspec.checkpoint import read_heads_config
    from vllm_mtpspec.cli import main
    from vllm_mtpspec.shipped import shipped_heads_dir

    out = tmp_path / "bench"
    code = main(["bench", "--prompts", "humaneval", "--num-prompts", "2", "--methods", "none,mtpspec-tree",
                 "--prompt-lookup", "off", "--batch-sizes", "1,2", "--temperatures", "0", "--max-new-tokens", "8", "--work-dir", str(tmp_path),
                 "--json", f"{out}.json", "--markdown", f"{out}.md", "--plot", f"{out}.png"])
    assert code == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    tree_rows = [r for r in result["rows"] if r["method"].startswith("mtpspec")]
    assert {r["batch_size"] for r in tree_rows} == {1, 2}
    assert all(r["identical_greedy_output"] for r in tree_rows)
    assert all(r["output_tokens"] == 2 * 8 for r in result["rows"])  # ignore_eos: every method decodes the same
    assert all(r["mean_accepted_length"] and r["mean_accepted_length"] >= 1 for r in tree_rows)
    # No --tree: the shipped heads' kind picks the preset. Their row names their draft
    # vocabulary, where they have one.
    config = read_heads_config(shipped_heads_dir())
    label = next(m["name"] for m in result["methods"] if m["name"].startswith("mtpspec"))
    assert label.startswith(f"mtpspec-{config.kind.default_tree} k=3 n<=8")
    assert (f"vocab={config.draft_vocab_size}" in label) == bool(config.draft_vocab_size)
    assert f"| {label} | 1 |" in (tmp_path / "bench.md").read_text()
    with Image.open(f"{out}.png") as image:
        assert image.size[0] > 1000


def test_draft_size_variants_default_fixed_and_planned(tmp_path):
    from vllm_mtpspec.config import SpecOptions

    methods = build_methods(["mtpspec-chain"], model_dir="m", heads_dirs=["h"], num_heads=[3], quants=["fp"],
                            tree="consensus", work_dir=tmp_path, draft_sizes=["default", "fixed", "planned"])
    assert [m.name for m in methods] == ["mtpspec-chain k=3 +lookup", "mtpspec-chain k=3 +lookup fixed-size",
                                         "mtpspec-chain k=3 +lookup planned-size"]
    options = [SpecOptions.from_dict({k: v for k, v in m.speculative_config.items() if k not in ("method", "model")})
               for m in methods]
    # The default row leaves the rule to the platform: here one whose default is "planned".
    assert [o.draft_size_rule("planned") for o in options] == ["planned", "fixed", "planned"]


def test_a_second_engine_without_speculation_measures_the_noise(tmp_path):
    methods = build_methods(["none", "none-again"], model_dir="m", heads_dirs=["h"], num_heads=[3], quants=["fp"],
                            tree="consensus", work_dir=tmp_path)
    assert [(m.name, m.speculative_config) for m in methods] == [("none", None), ("none (again)", None)]


def test_options_reach_every_mtpspec_row_last_and_name_themselves(tmp_path):
    from vllm_mtpspec.bench.command import _options

    options = _options('{"min_path_prob": 0, "prompt_lookup_max": 3}')
    methods = build_methods(["ngram", "mtpspec-chain"], model_dir="m", heads_dirs=["h"], num_heads=[3], quants=["fp"],
                            tree="consensus", work_dir=tmp_path, lookups=[False], options=options)
    ngram, chain = methods
    assert "min_path_prob" not in ngram.speculative_config
    assert chain.speculative_config["min_path_prob"] == 0
    assert chain.speculative_config["prompt_lookup_max"] == 3   # over --prompt-lookup off: given last
    assert chain.name == "mtpspec-chain k=3 min_path_prob=0 prompt_lookup_max=3"


@pytest.mark.parametrize("text, named", [('{"min_path_prb": 0}', "min_path_prb"), ('{"min_path_prob": 2}', "must lie"),
                                         ("[1]", "not a JSON object"), ("{", "Expecting")])
def test_bad_options_stop_the_bench_before_any_engine_starts(text, named):
    from vllm_mtpspec.bench.command import _options

    with pytest.raises(SystemExit, match=named):
        _options(text)


def test_an_unknown_draft_size_is_named(capsys):
    from vllm_mtpspec.bench.command import _choices

    with pytest.raises(SystemExit, match="--draft-size: 'learned': choose from default, fixed, planned"):
        _choices("learned", DRAFT_SIZES, "--draft-size")


def test_rows_of_several_heads_are_labelled_by_kind_draft_vocabulary_and_name(tiny_model, tiny_model_dir, tmp_path):
    from vllm_mtpspec.checkpoint import save_heads
    from vllm_mtpspec.heads_init import init_heads

    heads = init_heads(tiny_model, tiny_model_dir, num_heads=2)
    full = save_heads(heads, tmp_path / "v5")
    small = save_heads(heads.with_draft_vocab(torch.arange(64)), tmp_path / "v5-small")
    from vllm_mtpspec.heads_init import init_draft_block

    block = save_heads(init_draft_block(tiny_model, tiny_model_dir, num_heads=2), tmp_path / "b1")
    twin = save_heads(heads.with_draft_vocab(torch.arange(64)), tmp_path / "v6-small")  # same kind and vocabulary
    from vllm_mtpspec.sequential_heads import SequentialHeads

    hidden_token = init_heads(tiny_model, tiny_model_dir, num_heads=2, head_input="hidden+token", mlp_size=32)
    sequential = save_heads(SequentialHeads.from_parallel(hidden_token), tmp_path / "s1")
    dirs = [str(full), str(small), str(block), str(twin), str(sequential)]
    methods = build_methods(["mtpspec-chain"], model_dir="m", heads_dirs=dirs, num_heads=[2], quants=["fp"],
                            tree="consensus", work_dir=tmp_path)
    assert [m.name for m in methods] == ["mtpspec-chain k=2 +lookup [v5]", "mtpspec-chain k=2 +lookup vocab=64 [v5-small]",
                                         "mtpspec-chain k=2 +lookup block [b1]",
                                         "mtpspec-chain k=2 +lookup vocab=64 [v6-small]",
                                         "mtpspec-chain k=2 +lookup sequential [s1]"]
    assert [m.speculative_config["model"] for m in methods] == dirs
    alone = build_methods(["mtpspec-chain"], model_dir="m", heads_dirs=[str(small)], num_heads=[2], quants=["fp"],
                          tree="consensus", work_dir=tmp_path)
    assert [m.name for m in alone] == ["mtpspec-chain k=2 +lookup vocab=64"]


def test_the_serving_benchmark_table_compares_each_level_with_vllm_alone():
    from vllm_mtpspec.bench.serve_load import markdown_table

    def row(server, c, rate, accept=None):
        return {"server": server, "concurrency": c, "completed": 8, "failed": 0, "output_throughput": rate,
                "spec_decode_acceptance_length": accept,
                **{f"{s}_{m}_ms": 10.0 for s in ("mean", "median", "p99") for m in ("ttft", "tpot")},
                "mean_e2el_ms": 900.0, "median_e2el_ms": 800.0, "p99_e2el_ms": 2000.0}

    table = markdown_table([row("plain", 1, 20.0), row("mtpspec", 1, 30.0, 1.8), row("plain", 4, 50.0),
                            row("mtpspec", 4, 40.0, 1.5)])
    lines = table.splitlines()
    assert "| 1 | mtpspec | 8 (0) | 30.0 | 1.50x |" in lines[3] and lines[3].endswith("| 1.80 |")
    assert "| 4 | mtpspec | 8 (0) | 40.0 | 0.80x |" in lines[5]
    assert "| 4 | plain | 8 (0) | 50.0 | 1.00x |" in lines[4]
    assert "| 900.0 / 800.0 / 2000.0 |" in lines[4]  # request latency beside TTFT and TPOT


def test_vllms_command_line_runs_through_the_version_shim():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "vllm_mtpspec.vllm.serve", "bench", "serve",
                           "--help=max-concurrency"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--max-concurrency MAX_CONCURRENCY" in done.stdout


def test_a_long_later_turn_loses_its_oldest_exchanges_first_to_fit_the_budget():
    from transformers import AutoTokenizer

    from vllm_mtpspec.bench.command import cut_prompt
    from vllm_mtpspec.models import fetch_model
    from vllm_mtpspec.prompts import apply_chat_template

    tokenizer = AutoTokenizer.from_pretrained(str(fetch_model("smollm2-135m-instruct", dtype="fp32")))
    history = tuple(pair for n in range(6) for pair in (("user", f"question {n} " + "word " * 80),
                                                         ("assistant", f"answer {n} " + "more " * 80)))
    prompt = Prompt("And the last question?", "general", "c#6", history=history)
    cut = cut_prompt(prompt, tokenizer, 600)
    length = len(tokenizer(apply_chat_template(tokenizer, cut.text, cut.history), add_special_tokens=False)["input_ids"])
    assert length <= 600 and cut.text == prompt.text
    assert 0 < len(cut.history) < len(history) and cut.history == history[-len(cut.history):]
    assert cut.history[0][0] == "user"
    assert cut_prompt(prompt, tokenizer, 10_000) == prompt


def test_each_asked_draft_dtype_is_a_row_of_its_own(tiny_model, tiny_model_dir, tmp_path):
    from vllm_mtpspec.checkpoint import save_heads
    from vllm_mtpspec.heads_init import init_heads

    heads = save_heads(init_heads(tiny_model, tiny_model_dir, num_heads=2), tmp_path / "h")
    methods = build_methods(["mtpspec-chain"], model_dir="m", heads_dirs=[str(heads)], num_heads=[2], quants=["fp"],
                            tree="consensus", work_dir=tmp_path, draft_dtypes=["auto", "model"])
    assert [m.name for m in methods] == ["mtpspec-chain k=2 +lookup drafts-auto", "mtpspec-chain k=2 +lookup drafts-model"]
    assert [m.speculative_config["draft_dtype"] for m in methods] == ["auto", "model"]
    default = build_methods(["mtpspec-chain"], model_dir="m", heads_dirs=[str(heads)], num_heads=[2], quants=["fp"],
                            tree="consensus", work_dir=tmp_path)
    assert default[0].name == "mtpspec-chain k=2 +lookup" and default[0].speculative_config["draft_dtype"] == "auto"


def test_pacing_rows_ask_for_their_pacing(tmp_path):
    methods = build_methods(["mtpspec-chain"], model_dir="m", heads_dirs=["h"], num_heads=[3], quants=["fp"],
                            tree="consensus", work_dir=tmp_path, pacings=["default", "never"])
    assert [m.name for m in methods] == ["mtpspec-chain k=3 +lookup", "mtpspec-chain k=3 +lookup paced-never"]
    assert "pace_cohorts" not in methods[0].speculative_config
    assert methods[1].speculative_config["pace_cohorts"] == "never"


def test_backoff_start_rows_ask_for_their_start(tmp_path):
    methods = build_methods(["mtpspec-chain"], model_dir="m", heads_dirs=["h"], num_heads=[3], quants=["fp"],
                            tree="consensus", work_dir=tmp_path, draft_sizes=["planned"], backoff_starts=[None, 1])
    assert [m.name for m in methods] == ["mtpspec-chain k=3 +lookup planned-size",
                                         "mtpspec-chain k=3 +lookup planned-size from-batch-1"]
    assert "batch_backoff_start" not in methods[0].speculative_config
    assert methods[1].speculative_config["batch_backoff_start"] == 1


def test_backoff_start_flag_refuses_what_is_not_a_batch_size():
    from vllm_mtpspec.bench.command import _backoff_starts

    assert _backoff_starts("default,1,4") == [None, 1, 4]
    for bad in ("0", "two", "-1"):
        with pytest.raises(SystemExit, match="--backoff-start"):
            _backoff_starts(bad)


def test_a_methods_note_names_it_once(tmp_path):
    from vllm_mtpspec.bench.report import markdown

    methods = build_methods(["none-again"], model_dir="m", heads_dirs=["h"], num_heads=[3], quants=["fp"],
                            tree="consensus", work_dir=tmp_path)
    table = markdown([], methods, [], "## test")
    assert "none (again): a second engine without speculation" in table
    assert "none (again): none (again)" not in table


def test_a_blocks_int2_row_serves_its_int2_copy_and_int2_heads_get_one_row_labelled_so(tiny_model, tiny_model_dir,
                                                                                         tmp_path):
    from vllm_mtpspec.checkpoint import read_heads_config, save_heads
    from vllm_mtpspec.heads_init import init_draft_block

    block = init_draft_block(tiny_model, tiny_model_dir, num_heads=2)
    full = save_heads(block, tmp_path / "b1")
    methods = build_methods(["mtpspec-chain"], model_dir="m", heads_dirs=[str(full)], num_heads=[2],
                            quants=["fp", "int2"], tree="consensus", work_dir=tmp_path)
    assert [m.name for m in methods] == ["mtpspec-chain k=2 +lookup block", "mtpspec-chain k=2 +lookup block int2"]
    assert all(m.unavailable is None for m in methods)
    assert read_heads_config(methods[0].speculative_config["model"]).quantization is None
    assert read_heads_config(methods[1].speculative_config["model"]).quantization.method == "rtn"
    int2 = save_heads(block.quantized(group_size=32), tmp_path / "b1-int2")
    methods = build_methods(["mtpspec-chain"], model_dir="m", heads_dirs=[str(int2)], num_heads=[2],
                            quants=["fp", "int2"], tree="consensus", work_dir=tmp_path)
    assert [(m.name, m.speculative_config["model"]) for m in methods] == [
        ("mtpspec-chain k=2 +lookup block int2", str(int2))]
    methods = build_methods(["mtpspec-chain"], model_dir="m", heads_dirs=[str(int2)], num_heads=[2], quants=["int2"],
                            tree="consensus", work_dir=tmp_path)
    assert [(m.name, m.speculative_config["model"], m.unavailable) for m in methods] == [
        ("mtpspec-chain k=2 +lookup block int2", str(int2), None)]


def test_a_tree_row_the_heads_cannot_draft_is_reported_not_run(tiny_model, tiny_model_dir, tmp_path):
    from vllm_mtpspec.checkpoint import save_heads
    from vllm_mtpspec.heads_init import init_draft_block, init_heads
    from vllm_mtpspec.sequential_heads import SequentialHeads

    block = save_heads(init_draft_block(tiny_model, tiny_model_dir, num_heads=2), tmp_path / "b1")
    hidden_token = init_heads(tiny_model, tiny_model_dir, num_heads=2, head_input="hidden+token", mlp_size=32)
    sequential = save_heads(SequentialHeads.from_parallel(hidden_token), tmp_path / "s1")
    for tree, expected in (("consensus", {"b1": "drafts chains and dynamic trees only",
                                          "s1": "drafts chains and dynamic trees only"}),
                           ("dynamic", {"b1": None, "s1": None})):
        methods = build_methods(["mtpspec-chain", "mtpspec-tree"], model_dir="m",
                                heads_dirs=[str(block), str(sequential)], num_heads=[2], quants=["fp"], tree=tree,
                                work_dir=tmp_path)
        chains, trees = methods[:2], methods[2:]
        assert all(m.unavailable is None for m in chains)
        for method, name in zip(trees, ("b1", "s1")):
            if expected[name] is None:
                assert method.unavailable is None
            else:
                assert f"{name}/config.json" in method.unavailable and expected[name] in method.unavailable


def test_the_heads_memory_table_gives_untied_figures_for_parallel_heads_only(tiny_model, tiny_model_dir, tmp_path):
    from vllm_mtpspec.bench.report import heads_memory
    from vllm_mtpspec.checkpoint import save_heads
    from vllm_mtpspec.heads_init import init_draft_block, init_heads

    parallel = save_heads(init_heads(tiny_model, tiny_model_dir, num_heads=2), tmp_path / "p")
    block = save_heads(init_draft_block(tiny_model, tiny_model_dir, num_heads=2), tmp_path / "b")
    rows = heads_memory(str(parallel), str(tiny_model_dir), None)
    assert [(r["heads"], r["quant"]) for r in rows] == [("tied", "fp"), ("untied", "fp")]
    assert rows[1]["bytes"] == rows[0]["bytes"] + 2 * 2 * 64 * 256  # a 64 x 256 projection per head, 2 bytes each
    rows = heads_memory(str(block), str(tiny_model_dir), None)
    assert [(r["heads"], r["quant"]) for r in rows] == [("draft block", "fp")]
    assert rows[0]["bytes"] == (block / "heads.safetensors").stat().st_size
    int2 = save_heads(init_draft_block(tiny_model, tiny_model_dir, num_heads=2).quantized(group_size=32),
                      tmp_path / "b-int2")
    rows = heads_memory(str(int2), str(tiny_model_dir), None, name="b-int2")  # an INT2 directory, as it is
    assert [(r["heads"], r["quant"]) for r in rows] == [("draft block [b-int2]", "int2")]
    assert rows[0]["bytes"] == (int2 / "heads.safetensors").stat().st_size < rows[0]["model_bytes"]


def _spin_in_own_group() -> None:
    import os

    os.setpgrp()
    while True:
        pass


def _cpu_ticks_and_state(pid: int) -> tuple[int, str]:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12]), fields[0]  # utime + stime, state


def test_an_engine_waiting_for_its_turn_spends_no_cpu():
    """Engines are paused whole between their turns, so idle ones cannot slow the one
    being timed; resumed, they run again."""
    import multiprocessing
    import time

    from vllm_mtpspec.bench.worker import PausedBetweenTurns

    process = multiprocessing.get_context("fork").Process(target=_spin_in_own_group, daemon=True)
    process.start()
    try:
        time.sleep(0.3)  # the child has made its own process group
        turns = PausedBetweenTurns(process.pid)
        turns.pause()
        time.sleep(0.1)  # SIGSTOP lands
        paused_ticks, state = _cpu_ticks_and_state(process.pid)
        time.sleep(0.5)
        assert state == "T" and _cpu_ticks_and_state(process.pid) == (paused_ticks, "T")
        turns.resume()
        time.sleep(0.5)
        ticks, state = _cpu_ticks_and_state(process.pid)
        assert state != "T" and ticks > paused_ticks
    finally:
        process.kill()
        process.join()


def test_the_held_out_sources_are_bench_prompts_by_name():
    prompts = load_bench_prompts("gsm8k,chitchat", 4)
    assert [p.category for p in prompts] == ["gsm8k", "chitchat"] * 2
    assert all(p.history for p in prompts if p.category == "chitchat")


@pytest.mark.parametrize("flag, ignore_eos, lengths", [([], True, "8 new tokens each"),
                                                       (["--stop-at-eos"], False, "up to 8 new tokens each, to the end")])
def test_stop_at_eos_lets_requests_end_where_their_answers_do(tmp_path, monkeypatch, flag, ignore_eos, lengths):
    from vllm_mtpspec.bench import runner
    from vllm_mtpspec.bench.runner import Tally
    from vllm_mtpspec.cli import main

    asked = {}

    def no_engines(methods, prompts, **kwargs):
        asked.update(kwargs)
        return {(m.name, 1, 0.0): Tally() for m in methods}

    monkeypatch.setattr(runner, "run_benchmark", no_engines)
    out = tmp_path / "bench"
    main(["bench", "--prompts", "humaneval",
          "--num-prompts", "1", "--methods", "none", "--batch-sizes", "1", "--temperatures", "0",
          "--max-new-tokens", "8", "--work-dir", str(tmp_path), "--json", f"{out}.json", "--markdown", f"{out}.md",
          *flag])
    assert asked["ignore_eos"] is ignore_eos
    assert json.loads((tmp_path / "bench.json").read_text())["stop_at_eos"] is not ignore_eos
    assert lengths in (tmp_path / "bench.md").read_text()


def test_a_bench_without_mtpspec_rows_needs_no_drafter_for_its_model(tmp_path, monkeypatch, tiny_smol_teacher):
    """ngram alone on a model no drafter ships for runs; an mtpspec row there asks for --heads."""
    from vllm_mtpspec.bench import runner
    from vllm_mtpspec.bench.runner import Tally
    from vllm_mtpspec.cli import main

    monkeypatch.setattr(runner, "run_benchmark", lambda methods, prompts, **kwargs:
                        {(m.name, 1, 0.0): Tally() for m in methods})
    common = ["bench", "--model", str(tiny_smol_teacher), "--prompts", "humaneval", "--num-prompts", "1",
              "--batch-sizes", "1", "--temperatures", "0", "--max-new-tokens", "8", "--work-dir", str(tmp_path)]
    main([*common, "--methods", "none,ngram", "--json", str(tmp_path / "bench.json")])
    assert json.loads((tmp_path / "bench.json").read_text())["heads"] == []
    with pytest.raises(SystemExit, match="no drafter ships for .*; pass --heads DIR"):
        main([*common, "--methods", "none,mtpspec-chain"])
