"""A training config run twice with Ray Train: whole, and with a worker killed mid-run.

    python benchmarks/ray_resume.py --config vllm_mtpspec_train/configs/ray-two-workers.json --fail-at-step 7 \
        --json benchmarks/results/ray_two_workers_resume.json --markdown benchmarks/results/ray_two_workers_resume.md

Both runs take the config as written (its num_workers, seed and schedule), in their own run
folders under the config's storage_path. In the second, one worker raises at --fail-at-step;
Ray Train restarts the workers from the last checkpoint (max_failures 1). The report lists
every step's loss of both runs side by side: a run that resumes as it should takes the same
steps again and reaches the same losses.
"""
import argparse
import dataclasses
import json
import time
from pathlib import Path

from vllm_mtpspec.bench.stamp import describe, stamp
from vllm_mtpspec_train.config import TrainConfig
from vllm_mtpspec_train.train import METRICS_FILE, run_training


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a training config (JSON or YAML)")
    parser.add_argument("--fail-at-step", type=int, required=True, help="the step at which a worker dies")
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    config = TrainConfig.from_file(args.config)
    if not 0 < args.fail_at_step <= (config.max_steps or 0) or args.fail_at_step <= config.checkpoint_every:
        parser.error(f"--fail-at-step {args.fail_at_step}: choose a step after the config's first checkpoint "
                     f"(checkpoint_every {config.checkpoint_every}) and no later than its max_steps {config.max_steps}")
    results = {"stamp": stamp(), "config": config.to_dict(), "fail_at_step": args.fail_at_step, "runs": {}}
    for run, fields in (("whole", {}), ("killed", {"fail_at_step": args.fail_at_step, "max_failures": 1})):
        name = f"{config.name}-{run}"
        started = time.time()
        summary = run_training(dataclasses.replace(config, name=name, out=f"{config.out}-{run}", **fields))
        rows = _rows(Path(config.storage_path).absolute() / name)
        results["runs"][run] = {"seconds": round(time.time() - started, 1), "steps": summary["steps"],
                                "resumed_from": [r["step"] for r in rows if r.get("event") == "resumed"],
                                "losses": [[r["step"], r["loss"]] for r in rows if "loss" in r]}
    whole = dict(map(tuple, results["runs"]["whole"]["losses"]))
    again = results["runs"]["killed"]["losses"]
    results["same_losses"] = all(whole.get(step) == loss for step, loss in again)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    text = markdown(results)
    if args.markdown:
        Path(args.markdown).write_text(text)
    print(text)


def markdown(results: dict) -> str:
    config, runs = results["config"], results["runs"]
    lines = [f"## {config['name']}: {config['num_workers']} Ray Train workers, whole and with a worker killed "
             f"at step {results['fail_at_step']}", "", describe(results["stamp"]), "",
             f"`{results['stamp']['command']}`", "",
             f"{config['head_kind']} drafter, {config['mode']}, data_source {config['data_source']}, "
             f"{config['max_steps']} steps, a checkpoint every {config['checkpoint_every']}.", "",
             "| run | wall-clock | resumed from the checkpoint of step |", "|---|---|---|"]
    for run, r in runs.items():
        lines.append(f"| {run} | {r['seconds'] / 60:.1f} min | {', '.join(map(str, r['resumed_from'])) or '-'} |")
    lines += ["", "Loss at each step (the killed run takes the steps after its checkpoint again):", "",
              "| step | whole | killed, as logged |", "|---|---|---|"]
    whole = dict(map(tuple, runs["whole"]["losses"]))
    last = 0
    for step, loss in runs["killed"]["losses"]:
        if step <= last:  # the losses were logged in order: a step again is where the workers came back
            lines.append("| *a worker died; back from the last checkpoint* | | |")
        lines.append(f"| {step} | {whole.get(step, float('nan')):.6f} | {loss:.6f} |")
        last = step
    lines += ["", f"Every logged loss of the killed run equals the whole run's at that step: "
              f"**{'yes' if results['same_losses'] else 'no'}**.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
