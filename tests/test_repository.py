"""The repository stays small enough to travel: a GPU machine receives at most 64 MiB per
call, the whole tracked tree included, and a trimmed vLLM 0.33 bundle takes about 43 MiB of
that (scripts/build_gpu_bundle.py), so the tracked tree must stay within 15 MB."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACKED_TREE_BUDGET = 15_000_000  # bytes

# The bundle builder measures the tree the same way when it checks a call's budget.
spec = importlib.util.spec_from_file_location("build_gpu_bundle", ROOT / "scripts" / "build_gpu_bundle.py")
bundle = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bundle)


def test_the_tracked_tree_fits_a_gpu_call():
    sizes = bundle.tracked_file_sizes()
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda item: -item[1])[:5]
    listing = ", ".join(f"{path.relative_to(ROOT)} {size / 1e6:.2f} MB" for path, size in largest)
    print(f"tracked tree: {total / 1e6:.2f} MB of {TRACKED_TREE_BUDGET / 1e6:.0f} MB ({len(sizes)} files)")
    assert total <= TRACKED_TREE_BUDGET, (
        f"the tracked tree is {total / 1e6:.2f} MB, over its {TRACKED_TREE_BUDGET / 1e6:.0f} MB budget; "
        f"largest: {listing}. Keep results that back a current figure only, and weights that ship.")
