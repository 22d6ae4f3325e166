"""Running a Triton check script on the CPU: TRITON_INTERPRET must be set before Triton
is first imported, so each check runs in a fresh interpreter."""
import os
import subprocess
import sys


def run_under_triton_interpreter(script: str, done_marker: str, timeout: int = 900) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert done_marker in proc.stdout
