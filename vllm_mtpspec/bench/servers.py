"""OpenAI-compatible servers started for a measurement or a test, on 127.0.0.1.

`mtpspec serve` with heads, or with `--heads none` (vLLM alone, through the same version
shim, so both sides run the same vLLM), each in its own process group so that stopping it
stops the engine core too. A server that exits or does not become healthy in time is an
error that quotes the end of its log."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


class ServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    label: str
    base_url: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def healthy(self, timeout: float = 5.0) -> bool:
        import requests

        try:
            return requests.get(f"{self.base_url}/health", timeout=timeout).status_code == 200
        except requests.RequestException:
            return False

    def metrics(self) -> dict[str, float]:
        return server_metrics(self.base_url)

    def stop(self, timeout: float = 60.0) -> None:
        if self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=timeout)


def server_metrics(base_url: str, timeout: float = 30.0) -> dict[str, float]:
    """A server's Prometheus samples named vllm:* (counters and gauges), each summed over
    its labels."""
    import requests

    found: dict[str, float] = {}
    for line in requests.get(f"{base_url}/metrics", timeout=timeout).text.splitlines():
        if line.startswith("vllm:"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0]
            found[key] = found.get(key, 0.0) + float(value)
    return found


def serve_command(model: str, heads: str | None, port: int, vllm_args: list[str]) -> list[str]:
    """The `mtpspec serve` command line: heads None serves without speculation."""
    return [sys.executable, "-m", "vllm_mtpspec.cli", "serve", model, "--heads", heads or "none",
            "--host", "127.0.0.1", "--port", str(port), *vllm_args]


def start_server(label: str, model: str, heads: str | None, log_path: Path, vllm_args: list[str], *,
                 port: int | None = None, ready_timeout: float = 600.0, env: dict | None = None) -> Server:
    port = port or free_port()
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(serve_command(model, heads, port, vllm_args), stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, **(env or {})})
    server = Server(label, f"http://127.0.0.1:{port}", process, log_path)
    wait_until_healthy(server, ready_timeout)
    return server


def wait_until_healthy(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise ServerError(f"the {server.label} server exited with {server.process.returncode} before it was "
                              f"ready; the end of {server.log_path}:\n{server.log_tail()}")
        if server.healthy(timeout=2):
            return
        time.sleep(1)
    server.stop()
    raise ServerError(f"the {server.label} server was not healthy after {timeout:.0f} s; the end of "
                      f"{server.log_path}:\n{server.log_tail()}")


@contextmanager
def running_server(label: str, model: str, heads: str | None, log_path: Path, vllm_args: list[str], **kwargs):
    server = start_server(label, model, heads, log_path, vllm_args, **kwargs)
    try:
        yield server
    finally:
        server.stop()
