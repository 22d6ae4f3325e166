"""Training prompts from the text that installed Python packages ship: their project
descriptions (the README in each distribution's metadata) and their documented functions.

ShareGPT is nearly all the chat data PyPI offers, and a drafter trained on it alone keeps 90%
of its held-out figure on other kinds of use. This source adds other kinds: summarizing,
explaining and answering questions about technical prose, and writing and explaining code,
in many projects' own words. The target answers them (vllm_mtpspec_train.data), so the labels
are its own.

It never reads what the held-out sources read (vllm_mtpspec.held_out_sources): no standard-library
module, no package of a held-out source. Each prompt's id names its distribution and
version; the order is fixed by a hash of the id, so the first N prompts are the same N on
every machine with the same packages (scripts/setup.sh pins them).
"""
from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
from pathlib import Path

from vllm_mtpspec.held_out_sources import SOURCES, _ordered
from vllm_mtpspec.prompts import Prompt

README_TEMPLATES = (
    "Summarize what this project does and who it is for, in a few sentences:\n\n{text}",
    "Here is the description of a Python package.\n\n{text}\n\nExplain to a beginner how they would start using it.",
    "{text}\n\nList the main features of this package as bullet points, one line each.",
    "Read this project description and write three questions a new user might ask about it, "
    "each with a short answer.\n\n{text}",
)
FUNCTION_TEMPLATES = (
    "Write a Python function `{signature}` that does the following:\n\n{doc}",
    "Explain, step by step, what this Python function does:\n\n```python\n{source}```",
    "Here is a Python function:\n\n```python\n{source}```\n\nSuggest how to test it, and write two unit tests.",
)
# Installed third-party packages whose Python source holds many documented functions. Read
# with ast, never imported: nothing runs, and a package that fails to import still counts.
FUNCTION_PACKAGES = ("sympy", "networkx", "jinja2", "requests", "click", "aiohttp", "fsspec", "huggingface_hub",
                     "pydantic", "more_itertools", "transformers", "ray", "torch", "numpy", "yaml", "psutil",
                     "tqdm", "packaging", "pandas", "scipy", "mpmath", "pygments", "rich", "urllib3", "attr")
FUNCTIONS_PER_PACKAGE = 80
README_CHARS = (800, 3000)     # descriptions shorter say too little; longer ones are cut here
FUNCTION_SOURCE_CHARS = 1800


def _held_out_distributions() -> set[str]:
    return {source.package.split("==")[0].lower() for source in SOURCES.values()}


def _template(templates: tuple[str, ...], key: str) -> str:
    return templates[int(hashlib.sha1(key.encode()).hexdigest(), 16) % len(templates)]


def _readmes() -> list[tuple[str, str, str]]:
    """(name, version, description) of every installed distribution that may be read."""
    held_out = _held_out_distributions() | {"vllm-mtpspec"}
    seen, found = set(), []
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        text = (dist.metadata.get_payload() or dist.metadata.get("Description") or "").strip()
        if not name or name in seen or name in held_out or len(text) < README_CHARS[0]:
            continue
        seen.add(name)
        text = text[:README_CHARS[1]].rsplit("\n", 1)[0] if len(text) > README_CHARS[1] else text
        found.append((name, dist.version, text))
    return found


def _functions() -> list[tuple[str, ast.FunctionDef, str, str]]:
    """(id, node, docstring, source) of FUNCTIONS_PER_PACKAGE documented functions per package."""
    chosen = []
    for package in FUNCTION_PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.origin:
            continue  # not installed here: its functions are left out
        root = Path(spec.origin).parent
        found = []
        # Files in a fixed order that is not the tree's, read until enough functions turned up:
        # a spread over the package without parsing all of it.
        files = sorted(root.rglob("*.py"), key=lambda f: hashlib.sha1(f.relative_to(root).as_posix().encode()).digest())
        for file in files:
            if len(found) >= 3 * FUNCTIONS_PER_PACKAGE:
                break
            if "test" in file.relative_to(root).as_posix().lower():
                continue
            try:
                source = file.read_text(encoding="utf-8")
                tree = ast.parse(source)
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            module = f"{package}.{file.relative_to(root).with_suffix('').as_posix().replace('/', '.')}"
            for node in tree.body:
                if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                    continue
                doc = ast.get_docstring(node) or ""
                text = ast.get_source_segment(source, node) or ""
                if len(doc) < 40 or not text or len(text) > FUNCTION_SOURCE_CHARS:
                    continue
                found.append((f"{module}.{node.name}", node, doc, text))
        found.sort(key=lambda item: hashlib.sha1(f"package-function:{item[0]}".encode()).hexdigest())
        chosen += found[:FUNCTIONS_PER_PACKAGE]
    return chosen


def _signature(node: ast.FunctionDef) -> str:
    return f"{node.name}({ast.unparse(node.args)})"


def readme_prompts() -> list[Prompt]:
    prompts = []
    for name, version, text in _readmes():
        pid = f"package-readme:{name}=={version}"
        prompts.append(Prompt(_template(README_TEMPLATES, pid).format(text=text), "package-docs", pid))
    return prompts


def function_prompts() -> list[Prompt]:
    prompts = []
    for key, node, doc, source in _functions():
        pid = f"package-function:{key}"
        prompts.append(Prompt(_template(FUNCTION_TEMPLATES, pid).format(
            signature=_signature(node), doc=doc.split("\n\n")[0], source=source + "\n"), "package-code", pid))
    return prompts


def package_texts() -> list[tuple[Prompt, str]]:
    """The same projects' and functions' own words as answers: each description answers a
    request to describe the project, each function's source a request to write it from its
    docstring. Human-written text for the target to label (answer files with labels
    "target"), against which its own answers to package_prompts can be compared token for token."""
    texts = []
    for name, version, text in _readmes():
        texts.append((Prompt(f"Describe the Python package `{name}`: what it does and how to start using it.",
                             "package-docs", f"package-readme-text:{name}=={version}"), text))
    for key, node, doc, source in _functions():
        texts.append((Prompt(FUNCTION_TEMPLATES[0].format(signature=_signature(node), doc=doc.split("\n\n")[0]),
                             "package-code", f"package-function-text:{key}"), f"```python\n{source}\n```"))
    return sorted(texts, key=lambda pair: hashlib.sha1(pair[0].id.encode()).hexdigest())


def package_prompts() -> list[Prompt]:
    """Every prompt of both kinds, in the fixed order."""
    return _ordered(readme_prompts() + function_prompts())
