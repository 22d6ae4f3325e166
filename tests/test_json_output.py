"""`--json` prints only JSON on stdout: whatever else is written there while the command
runs (vLLM's log lines, warnings, child processes writing to descriptor 1) goes to stderr."""
import json
import subprocess
import sys

NOISY_COMMAND = """
import os, subprocess, sys
from vllm_mtpspec.json_output import print_json, stdout_for_json_only
with stdout_for_json_only():
    print("INFO a log line through Python's stdout")
    os.write(1, b"INFO a log line straight to descriptor 1\\n")
    subprocess.run([sys.executable, "-c", "print('INFO a child process logging')"], check=True)
    print_json({"answer": 42}, indent=2)
print("after the command, stdout is stdout again")
"""


def test_only_the_json_reaches_stdout_and_the_rest_goes_to_stderr():
    out = subprocess.run([sys.executable, "-c", NOISY_COMMAND], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    json_text, _, after = out.stdout.partition("}\n")
    assert json.loads(json_text + "}") == {"answer": 42}
    assert after == "after the command, stdout is stdout again\n"
    for line in ("through Python's stdout", "straight to descriptor 1", "a child process logging"):
        assert line in out.stderr


def test_heads_info_json_parses_as_it_is(tmp_path):
    from vllm_mtpspec.shipped import shipped_heads_dir

    out = subprocess.run([sys.executable, "-m", "vllm_mtpspec.cli", "heads", "info", str(shipped_heads_dir()), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["head_kind"] == "attention"
