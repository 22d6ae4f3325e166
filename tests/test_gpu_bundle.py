"""The GPU bundle builder keeps one architecture's GPU code (scripts/build_gpu_bundle.py)."""
import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("build_gpu_bundle",
                                              Path(__file__).parents[1] / "scripts" / "build_gpu_bundle.py")
bundle = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bundle)

ENTRY_HEADER = 64


def entry(kind: int, arch: int, payload: bytes) -> bytes:
    header = bundle.FATBIN_ENTRY.pack(kind, 0, ENTRY_HEADER, len(payload), 0, 0, 0, 0, arch)
    return header.ljust(ENTRY_HEADER, b"\0") + payload


def fatbin(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return bundle.FATBIN_HEADER.pack(bundle.FATBIN_MAGIC, 1, bundle.FATBIN_HEADER.size, len(body)) + body


def test_only_other_architectures_cubins_are_found_and_ptx_is_kept():
    first = fatbin(entry(bundle.CUBIN, 80, b"\x01" * 32), entry(bundle.CUBIN, 90, b"\x02" * 32),
                   entry(1, 80, b"\x03" * 16))
    second = fatbin(entry(bundle.CUBIN, 100, b"\x04" * 8))
    section = first + b"\0" * 8 + second  # fatbins lie 8-byte aligned, with padding between
    found = bundle.other_arch_cubins(section)
    assert [(section[s:s + n], arch) for s, n, arch in found] == [(b"\x01" * 32, 80), (b"\x04" * 8, 100)]


def test_a_library_without_gpu_code_is_left_alone(tmp_path):
    library = tmp_path / "plain.so"
    library.write_bytes(b"not an ELF file")
    assert bundle.keep_one_arch(library) == 0 and library.read_bytes() == b"not an ELF file"
