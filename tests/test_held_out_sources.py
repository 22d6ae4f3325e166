"""The held-out sources read real text from the packages that ship it."""
import re
from pathlib import Path

import pytest

from vllm_mtpspec.held_out_sources import SOURCES, held_out_prompts
from vllm_mtpspec.prompts import PromptsError

KINDS_OF_USE = {"code", "math", "summarization", "qa", "translation", "long-document", "multi-turn-chat"}


def test_every_kind_of_use_has_a_source_with_real_prompts_in_a_fixed_order():
    assert KINDS_OF_USE <= {s.kind for s in SOURCES.values()}
    first = held_out_prompts(per_source=4)
    assert [p.id for p in first] == [p.id for p in held_out_prompts(per_source=4)]
    assert [p.category for p in first] == [name for name in SOURCES for _ in range(4)]
    assert len({p.id for p in first}) == len(first) and all(p.text.strip() for p in first)
    chats = [p for p in first if p.category == "chitchat"]
    assert all(len(p.history) >= 2 and p.history[0][0] == "user" and p.history[-1][0] == "assistant" for p in chats)


def test_every_source_package_is_installed_by_setup():
    setup = (Path(__file__).parents[1] / "scripts" / "setup.sh").read_text()
    for source in SOURCES.values():
        if "==" in source.package:
            assert source.package in setup, f"{source.name}: {source.package} is not pinned in scripts/setup.sh"


def test_an_unknown_source_is_named():
    with pytest.raises(PromptsError, match=re.escape("unknown held-out source(s) ['wiki']")):
        held_out_prompts(["wiki"], per_source=1)


def test_the_code_source_shares_nothing_with_humaneval():
    """HumanEval is the bench's code prompts: the held-out code source must not repeat it."""
    from vllm_mtpspec.bench.prompts import humaneval_prompts

    names = {re.search(r"def (\w+)", p.text).group(1) for p in humaneval_prompts()}
    code = SOURCES["stdlib-code"].read()
    assert code and not {re.search(r"`(\w+)\(", p.text).group(1) for p in code} & names
