"""Benchmark results for machines (JSON) and people (Markdown tables, PNG plots).

Definitions:
- speed-up: output tokens per second over the same method-less run (same batches).
- mean accepted length: tokens emitted per verification step of a request that carried
  drafts, 1 + accepted drafts / verification steps (vLLM's count of those steps).
- tokens a step: tokens emitted per step of a request, drafts or none: output tokens /
  the steps that emitted them.
- accepted drafts: output tokens - the steps that emitted them (each step emits one token
  of the target's own), so only drafts up to a request's stop count, for every method
  alike. vLLM's own counter also counts drafts accepted past a stop (end of sequence or
  max_tokens) that the output drops; acceptance per position is still vLLM's.
  A method that drafts only where it finds something (ngram) keeps a high mean accepted
  length over few steps; this compares methods over the same steps.
- efficiency: speed-up / mean accepted length, the share of the ideal speed-up (free
  drafting and free verification) that the implementation reaches.
- drafting share: time in the proposer over generation time.
"""
from __future__ import annotations

from pathlib import Path

from vllm_mtpspec.bench.methods import Method
from vllm_mtpspec.bench.runner import Tally


def accepted_drafts(counters: dict, tokens: int) -> int:
    """Drafts accepted up to each request's stop (the worker counts the steps that emitted
    tokens), or vLLM's counter where no step count came."""
    steps = counters.get("emitting_steps")
    return tokens - steps if steps is not None else counters.get("num_accepted_tokens", 0)


def _acceptance(counters: dict, tokens: int) -> tuple[float | None, list[float]]:
    steps = counters.get("num_drafts", 0)
    if not steps:
        return None, []
    accepted = accepted_drafts(counters, tokens)
    per_position = [round(a / steps, 4) for a in counters.get("num_accepted_tokens_per_pos", [])]
    while per_position and per_position[-1] == 0:
        per_position.pop()
    return round(1 + accepted / steps, 4), per_position


def summarize(methods: list[Method], tallies: dict[tuple[str, int, float], Tally]) -> list[dict]:
    rows = []
    for (name, batch_size, temperature), tally in tallies.items():
        base = tallies.get(("none", batch_size, temperature))
        tok_s = tally.tokens / tally.seconds if tally.seconds else 0.0
        base_tok_s = base.tokens / base.seconds if base and base.seconds else None
        speedup = tok_s / base_tok_s if base_tok_s else None
        mean_len, per_position = _acceptance(tally.counters, tally.tokens)
        steps = tally.tokens - accepted_drafts(tally.counters, tally.tokens)
        row = {
            "method": name, "batch_size": batch_size, "temperature": temperature,
            "output_tokens": tally.tokens, "seconds": round(tally.seconds, 3), "tokens_per_s": round(tok_s, 2),
            "speedup": None if speedup is None else round(speedup, 3),
            "mean_accepted_length": mean_len, "acceptance_per_position": per_position,
            "tokens_per_step": round(tally.tokens / steps, 4) if steps > 0 else None,
            "drafting_share": round(tally.counters.get("draft_seconds", 0.0) / tally.seconds, 4) if tally.seconds else None,
            "efficiency": round(speedup / mean_len, 3) if speedup and mean_len else None,
            "identical_greedy_output": (tally.outputs == base.outputs) if (base and temperature == 0) else None,
        }
        if tally.by_category:
            row["by_category"] = {}
            for category, slot in sorted(tally.by_category.items()):
                base_slot = (base.by_category.get(category) if base else None) or {}
                cat_tok_s = slot["tokens"] / slot["seconds"] if slot["seconds"] else 0.0
                base_cat = base_slot.get("tokens", 0) / base_slot["seconds"] if base_slot.get("seconds") else None
                row["by_category"][category] = {
                    "tokens_per_s": round(cat_tok_s, 2),
                    "speedup": round(cat_tok_s / base_cat, 3) if base_cat else None,
                    "mean_accepted_length": _acceptance(slot["counters"], slot["tokens"])[0],
                }
        rows.append(row)
    order = {m.name: i for i, m in enumerate(methods)}
    rows.sort(key=lambda r: (r["temperature"], r["batch_size"], order.get(r["method"], 99)))
    return rows


def heads_memory(heads_dir: str, model_dir: str, int2_dir: str | None, *, name: str = "") -> list[dict]:
    """Bytes of the heads (and of their INT2 copy, int2_dir, where there is one) against
    the model's weights; `name` tells several heads directories apart. For parallel
    heads, untied figures add one vocab projection per head (2 bytes per weight in FP,
    2.5 bits in INT2 with group size 64), what Medusa-style heads would weigh; sequential
    heads and a draft block are tied only, so their own bytes are all there is."""
    from vllm_mtpspec.checkpoint import heads_weights_file, read_heads_config

    config = read_heads_config(heads_dir)
    model_bytes = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    own = "int2" if config.quantization is not None else "fp"
    sizes = [(own, heads_weights_file(heads_dir).stat().st_size)]
    if int2_dir and own == "fp":
        sizes.append(("int2", (Path(int2_dir) / "heads.safetensors").stat().st_size))
    projection = config.num_heads * config.hidden_size * config.vocab_size
    tag = f" [{name}]" if name else ""
    if config.kind.tied_only or config.kind.own_head_vocabulary:  # its own bytes are all there is
        rows = [(config.kind.label + tag, quant, size) for quant, size in sizes]
    else:
        bytes_per_weight = {"fp": 2, "int2": 2.5 / 8}
        rows = [row for quant, size in sizes for row in (
            ("tied" + tag, quant, size), ("untied" + tag, quant, size + int(projection * bytes_per_weight[quant])))]
    return [{"heads": kind, "quant": quant, "num_heads": config.num_heads, "bytes": size,
             "share_of_model": round(size / model_bytes, 4), "model_bytes": model_bytes}
            for kind, quant, size in rows]


def _fmt(value, pattern="{:.2f}") -> str:
    return "-" if value is None else pattern.format(value)


def markdown(rows: list[dict], methods: list[Method], memory: list[dict], header: str) -> str:
    lines = [header, ""]
    for temperature in sorted({r["temperature"] for r in rows}):
        kind = "greedy" if temperature == 0 else f"temperature {temperature}"
        lines += [f"### {kind}", "",
                  "| method | batch | tok/s | speed-up | mean accepted length | tokens a step | efficiency | drafting share "
                  "| identical output |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in (r for r in rows if r["temperature"] == temperature):
            identical = {True: "yes", False: "NO", None: "-"}[r["identical_greedy_output"]]
            lines.append(f"| {r['method']} | {r['batch_size']} | {r['tokens_per_s']:.1f} | {_fmt(r['speedup'], '{:.2f}x')} | "
                         f"{_fmt(r['mean_accepted_length'])} | {_fmt(r['tokens_per_step'])} | {_fmt(r['efficiency'])} | "
                         f"{_fmt(r['drafting_share'], '{:.1%}')} | {identical} |")
        lines.append("")
    per_category = [r for r in rows if r.get("by_category") and r["temperature"] == 0]
    if per_category:
        categories = sorted({c for r in per_category for c in r["by_category"]})
        lines += ["### per category (batch 1, greedy): speed-up / mean accepted length", "",
                  "| method | " + " | ".join(categories) + " |", "|---|" + "---|" * len(categories)]
        for r in per_category:
            cells = []
            for c in categories:
                cell = r["by_category"].get(c)
                cells.append("-" if cell is None else
                             f"{_fmt(cell['speedup'], '{:.2f}x')} / {_fmt(cell['mean_accepted_length'])}")
            lines.append(f"| {r['method']} | " + " | ".join(cells) + " |")
        lines.append("")
    if memory:
        lines += ["### heads memory", "", "| heads | quant | heads bytes | share of the model's weights |", "|---|---|---|---|"]
        for m in memory:
            lines.append(f"| {m['heads']} ({m['num_heads']}) | {m['quant']} | {m['bytes'] / 1e6:.1f} MB | {m['share_of_model']:.1%} |")
        lines.append("")
    skipped = [m for m in methods if m.unavailable]
    if skipped:
        lines += ["Not run here: " + "; ".join(f"{m.name} ({m.unavailable})" for m in skipped), ""]
    notes = [f"{m.name}: {v}" for m in methods for v in m.notes.values()]
    if notes:
        lines += ["Notes: " + "; ".join(notes), ""]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Left: speed-up against batch size per method (greedy solid, sampled dashed).
    Right: acceptance rate per draft position per method (greedy, smallest batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    methods = list(dict.fromkeys(r["method"] for r in rows if r["method"] != "none"))
    colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
    for method in methods:
        for temperature in sorted({r["temperature"] for r in rows}):
            points = sorted((r["batch_size"], r["speedup"]) for r in rows
                            if r["method"] == method and r["temperature"] == temperature and r["speedup"])
            if points:
                xs, ys = zip(*points)
                left.plot(xs, ys, marker="o", color=colors[method], linestyle="-" if temperature == 0 else "--",
                          label=f"{method}" + ("" if temperature == 0 else f" (T={temperature})"))
    left.axhline(1.0, color="grey", linewidth=1)
    left.set_xscale("log", base=2)
    batch_sizes = sorted({r["batch_size"] for r in rows})
    left.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
    left.set_xlabel("batch size")
    left.set_ylabel("speed-up over no speculation (output tok/s)")
    left.set_title("Speed-up against batch size")
    left.legend(fontsize=7)
    greedy = [r for r in rows if r["temperature"] == 0 and r["acceptance_per_position"]]
    smallest = min((r["batch_size"] for r in greedy), default=None)
    chosen = [r for r in greedy if r["batch_size"] == smallest]
    width = 0.8 / max(len(chosen), 1)
    for i, r in enumerate(chosen):
        xs = [p + 1 + (i - (len(chosen) - 1) / 2) * width for p in range(len(r["acceptance_per_position"]))]
        right.bar(xs, r["acceptance_per_position"], width=width, color=colors.get(r["method"]), label=r["method"])
    positions = max((len(r["acceptance_per_position"]) for r in chosen), default=0)
    right.set_xticks(range(1, positions + 1))
    right.set_xlabel("draft position (head)")
    right.set_ylabel("accepted drafts per verification step")
    if chosen:
        right.set_title(f"Acceptance per position (greedy, batch {smallest})")
        right.legend(fontsize=7)
    else:  # e.g. only batch sizes past the back-off, where nothing is drafted
        right.set_title("Acceptance per position (greedy)")
        right.text(0.5, 0.5, "no drafts were verified in this run", ha="center", va="center",
                   transform=right.transAxes)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
