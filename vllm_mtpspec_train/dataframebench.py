"""Code prompts from DataFrameBench's training split (the `dataframebench` PyPI package,
CC-BY-4.0): 709 data-processing tasks rewritten from BigCodeBench, each a function
description and a starter stub to complete. The self-distilled ShareGPT answers hold
little code, and code is where the heads fall furthest behind copying the prompt.

Only `data/train.jsonl` is read: the package's CANARY.txt keeps `test` and `val` out of
any training corpus and names `train` as the split that may be trained on. None of it is
HumanEval, which the bench uses.

The wheel declares Python >= 3.12, so it is not installed: it is downloaded once (pip,
no dependencies) into the cache and read as the zip it is.
"""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

from vllm_mtpspec.models import cache_root
from vllm_mtpspec.prompts import Prompt, PromptsError

VERSION = "0.1.1"
WHEEL = f"dataframebench-{VERSION}-py3-none-any.whl"
TRAIN_SPLIT = "dataframebench/data/train.jsonl"
# A prompt pins its data library through two placeholders (the package's prompt.py);
# SmolLM2 knows pandas, so every task asks for it, in the package's own words.
PLACEHOLDERS = {
    "{library_import}": "import pandas as pd",
    "{library_instruction}": "Use pandas as the data processing library in your solution.",
}


def wheel_path() -> Path:
    """The wheel in the cache, downloaded on first use."""
    folder = cache_root() / "wheels"
    path = folder / WHEEL
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", f"dataframebench=={VERSION}",
                   "--python-version", "3.12", "--only-binary=:all:", "-d", str(folder)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 or not path.is_file():
            raise PromptsError(f"could not download {WHEEL} into {folder} ({done.stderr.strip()[-300:]}); "
                               f"put the wheel there by hand (pip download --no-deps dataframebench=={VERSION} "
                               "--python-version 3.12 --only-binary=:all:)")
    return path


def dataframebench_prompts(path: str | Path | None = None) -> list[Prompt]:
    """The training split's tasks, placeholders filled, category "code", ids the task ids
    ("DFB/T0001"; the held-out split hashes them like any other source's)."""
    path = Path(path) if path is not None else wheel_path()
    try:
        with zipfile.ZipFile(path) as wheel:
            lines = wheel.read(TRAIN_SPLIT).decode("utf-8").splitlines()
    except (zipfile.BadZipFile, KeyError, OSError) as err:
        raise PromptsError(f"{path}: not a dataframebench wheel with {TRAIN_SPLIT} ({err}); delete it so that it is "
                           "downloaded again") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            task = json.loads(line)
            text, task_id = task["prompt"], task["task_id"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise PromptsError(f"{path}:{TRAIN_SPLIT} line {number}: not a task with 'prompt' and 'task_id' "
                               f"({err})") from None
        for placeholder, fill in PLACEHOLDERS.items():
            text = text.replace(placeholder, fill)  # never str.format: stubs hold literal braces
        prompts.append(Prompt(text, "code", str(task_id)))
    return prompts
