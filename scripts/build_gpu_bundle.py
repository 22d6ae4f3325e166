"""Builds the vLLM 0.33 bundle that a lent GPU machine needs, on a CPU machine with PyPI.

A GPU call carries at most 64 MiB, the tracked tree included, and that machine has no
network and no vLLM. This fetches vLLM 0.33.0's wheel and the wheels the engine imports
that the machine lacks (Python 3.12, x86_64), unpacks them into one site folder, trims what
a Hopper run of the plugin does not load, and packs the rest as tar.xz under .cache/:

- the GPU code of every other architecture in the compiled libraries is zeroed in place
  (each library keeps its size and offsets, so it still loads, and the zeros compress away);
- the MoE, FlashMLA, deep_gemm, FlashKDA and DeepSelect libraries, the vllm-rs binary and
  the bundled cutlass headers go; so do the FlashAttention libraries (run with
  attention_backend="TRITON_ATTN"), unless --keep-flash-attention asks for Hopper's FA3.

It prints what it kept and fails when the bundle and the tracked tree together exceed the
budget. Nothing here has run on a GPU yet: whether vLLM's kernels load on the machine's
torch 2.11 is for the first device call to show.

    .venv/bin/python scripts/build_gpu_bundle.py            # -> .cache/gpu-bundle/vllm033-sm90-cp312.tar.xz
"""
from __future__ import annotations

import argparse
import shutil
import struct
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".cache" / "gpu-bundle"
BUNDLE = WORK / "vllm033-sm90-cp312.tar.xz"
CALL_LIMIT = 64 << 20          # what one device call carries, the tracked tree included
BUDGET = 60 << 20              # bundle + tracked tree: the rest is headroom for the call's own files
KEEP_ARCH = 90                 # sm_90: H100 and H200

VLLM = "vllm==0.33.0"
# What an import trace of LLM -> engine core -> GPU worker -> Llama -> custom_class proposer
# found missing on the GPU machine (Python 3.12.3, torch 2.11.0+cu130, transformers 5.17.0).
MISSING_THERE = [
    "annotated-types==0.8.0", "apache-tvm-ffi==0.1.11", "blake3==1.0.11", "cachetools==8.0.2", "cbor2==6.3.0",
    "compressed-tensors==0.17.0", "fastapi==0.136.3", "httpcore2==2.17.0", "httpx2==2.17.0", "jiter==0.19.0",
    "loguru==0.7.3", "msgspec==0.23.0", "openai==3.63.0", "oss-harmony==0.0.11", "partial-json-parser==0.2.1.1.post7",
    "pybase64==1.5.1", "pydantic==2.14.4", "pydantic-core==2.50.5", "pyzmq==27.3.0", "sniffio==1.3.1",
    "starlette==1.10.0", "truststore==0.10.5", "typing-inspection==0.4.5", "xgrammar==0.2.8",
    "typing-extensions>=4.16", "idna", "anyio", "h11",
]
DROPPED = [
    "vllm/vllm-rs", "vllm/_moe_C_stable_libtorch.abi3.so", "vllm/_flashmla_C.abi3.so", "vllm/_flashkda_C.abi3.so",
    "vllm/_deepselect_C.abi3.so", "vllm/_qutlass_C.abi3.so",  # imported under suppress(ImportError)
    "vllm/third_party/deep_gemm", "vllm/third_party/fmha_sm100",
]
FLASH_ATTENTION = ["vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"]

FATBIN_MAGIC = 0xBA55ED50
FATBIN_HEADER = struct.Struct("<IHHQ")        # magic, version, header size, payload size
FATBIN_ENTRY = struct.Struct("<HHIQIIHHI")    # kind, _, entry header size, payload size, ..., arch
CUBIN = 2


def download(work: Path) -> list[Path]:
    wheels = work / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
                    "--platform", "manylinux_2_5_x86_64", "--platform", "manylinux1_x86_64",
                    "-d", str(wheels), VLLM, *MISSING_THERE], check=True)
    return sorted(wheels.glob("*.whl"))


def fatbin_section(data: bytes) -> tuple[int, int] | None:
    """(offset, size) of the .nv_fatbin section of an ELF64 little-endian file, or None."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return None
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_offset = sections[shstrndx][4]
    for name, _, _, _, offset, size in sections:
        end = data.index(b"\0", names_offset + name)
        if data[names_offset + name:end] == b".nv_fatbin":
            return offset, size
    return None


def other_arch_cubins(section: bytes) -> list[tuple[int, int, int]]:
    """(start, length, arch) of every cubin payload in a fatbin section that is not for
    KEEP_ARCH; PTX (which a driver could compile for any arch) is kept."""
    found, i = [], 0
    while i + FATBIN_HEADER.size <= len(section):
        magic, _, header_size, payload_size = FATBIN_HEADER.unpack_from(section, i)
        if magic != FATBIN_MAGIC:
            i += 8  # fatbins are 8-byte aligned inside the section
            continue
        j, end = i + header_size, i + header_size + payload_size
        while j + FATBIN_ENTRY.size <= end:
            kind, _, entry_header, entry_size, _, _, _, _, arch = FATBIN_ENTRY.unpack_from(section, j)
            if kind == CUBIN and arch != KEEP_ARCH:
                found.append((j + entry_header, entry_size, arch))
            j += entry_header + entry_size
        i = end
    return found


def keep_one_arch(path: Path) -> int:
    """Zero the other architectures' cubins of a library in place; returns the bytes zeroed."""
    data = bytearray(path.read_bytes())
    located = fatbin_section(data)
    if located is None:
        return 0
    offset, size = located
    zeroed = 0
    for start, length, _ in other_arch_cubins(bytes(data[offset:offset + size])):
        data[offset + start:offset + start + length] = bytes(length)
        zeroed += length
    path.write_bytes(data)
    return zeroed


def tracked_file_sizes() -> dict[Path, int]:
    """Every file git tracks here, with its size: what a device call carries of the repository."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    paths = [ROOT / name for name in listed.decode().split("\0") if name]
    return {path: path.stat().st_size for path in paths if path.is_file()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep-flash-attention", action="store_true",
                        help="keep FlashAttention 3 for Hopper (large: the bundle may no longer fit a call)")
    args = parser.parse_args(argv)
    wheels = download(WORK)
    site = WORK / "site"
    shutil.rmtree(site, ignore_errors=True)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
    dropped = DROPPED + (FLASH_ATTENTION[:1] if args.keep_flash_attention else FLASH_ATTENTION)
    for relative in dropped:
        target = site / relative
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        else:
            print(f"build_gpu_bundle: {relative} is not in the wheel (vLLM's layout changed?)", file=sys.stderr)
    zeroed = sum(keep_one_arch(library) for library in site.rglob("*.so"))
    print(f"{len(wheels)} wheels unpacked; dropped {len(dropped)} paths; zeroed {zeroed / 1e6:.1f} MB of "
          f"non-sm_{KEEP_ARCH} GPU code")
    with tarfile.open(BUNDLE, "w:xz", preset=6) as tar:
        tar.add(site, arcname="site")
    bundle, tree = BUNDLE.stat().st_size, sum(tracked_file_sizes().values())
    print(f"bundle: {BUNDLE.relative_to(ROOT)} {bundle / 2**20:.1f} MiB; tracked tree {tree / 2**20:.1f} MiB; "
          f"together {(bundle + tree) / 2**20:.1f} MiB of a {BUDGET >> 20} MiB budget ({CALL_LIMIT >> 20} MiB a call)")
    if bundle + tree > BUDGET:
        print("build_gpu_bundle: too large for one device call; drop more of vLLM, or the tracked tree's weight",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
