"""`--json` writes only JSON to stdout. vLLM logs to stdout, its engine processes inherit
file descriptor 1, and progress bars and warnings come from every library, so while a JSON
command runs, descriptor 1 points at stderr and only `print_json` writes to the real stdout."""
from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any, Iterator, TextIO

_json_stream: TextIO | None = None


@contextlib.contextmanager
def stdout_for_json_only() -> Iterator[None]:
    """Sends everything written to stdout (Python's and descriptor 1 alike, child processes
    included) to stderr until it exits; `print_json` still reaches the real stdout."""
    global _json_stream
    sys.stdout.flush()
    saved_stream = sys.stdout
    real_stdout = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # Where Python's stdout is not descriptor 1 (a caller capturing it), the JSON goes there.
    _json_stream = os.fdopen(real_stdout, "w") if _writes_to_descriptor_1(saved_stream) else saved_stream
    try:
        yield
    finally:
        _json_stream.flush()
        os.dup2(real_stdout, 1)
        if _json_stream is not saved_stream:
            _json_stream.close()
        else:
            os.close(real_stdout)
        _json_stream = None
        sys.stdout = saved_stream


def _writes_to_descriptor_1(stream: TextIO) -> bool:
    try:
        return stream.fileno() == 1
    except (AttributeError, OSError, ValueError):
        return False


def print_json(payload: Any, **dumps_options) -> None:
    """The command's JSON, on the real stdout even inside `stdout_for_json_only`."""
    stream = _json_stream or sys.stdout
    stream.write(json.dumps(payload, **dumps_options) + "\n")
    stream.flush()
