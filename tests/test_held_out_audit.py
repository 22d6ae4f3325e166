import json
import random

from vllm_mtpspec.answers import list_answer_files, read_answers, write_answers
from vllm_mtpspec_train.held_out_audit import audit_held_out, request_tokens, write_clean

TEMPLATE_HEAD = [1, 9, 8, 7, 6, 5, 4, 3, 2]  # the system turn every prompt starts with
TEMPLATE_TAIL = [2, 1, 10]                     # the assistant's header every prompt ends with


def prompt(words):
    return TEMPLATE_HEAD + words + TEMPLATE_TAIL


def write(folder, ids, prompts):
    return write_answers(folder / "answers-00000.npz", ids, ["general"] * len(ids), prompts,
                         [[11, 12, 13]] * len(ids), fingerprint="f", vocab_size=50_000)


def test_the_audit_removes_parts_of_trained_conversations_and_near_duplicates(tmp_path):
    rng = random.Random(0)
    words = [[rng.randrange(100, 50_000) for _ in range(40)] for _ in range(6)]
    write(tmp_path / "train", ["a_0", "b_0", "e_2#1"], [prompt(words[0]), prompt(words[1]), prompt(words[4])])
    reworded = list(words[1])
    reworded[20] = 99
    write(tmp_path / "held", ["a_3", "c_0", "d_0", "e_0#2", "f_0"],
          [prompt(words[2]), prompt(reworded), prompt(words[3]), prompt(words[5]), [5, 5, 5] + words[3][:30]])
    audit = audit_held_out([str(tmp_path / "train")], [str(tmp_path / "held")])
    # a_3 is a part, e_0#2 a later turn, of conversations whose other parts were trained on.
    assert audit.same_conversation == ["a_3", "e_0#2"]
    assert [(m["id"], m["train_id"]) for m in audit.near_duplicate] == [("c_0", "b_0")]
    assert (audit.held_out, audit.kept) == (5, 2)
    written = write_clean([str(tmp_path / "held")], audit, tmp_path / "clean", train_dirs=[str(tmp_path / "train")])
    clean = read_answers(list_answer_files(tmp_path / "clean")[0])
    assert clean["ids"] == ["d_0", "f_0"] and clean["prompt_ids"][0] == prompt(words[3])
    assert clean["meta"]["audited_against"]["removed"] == 3
    assert json.loads(written[-1].read_text())["kept"] == 2


def test_requests_lose_the_template_that_nearly_every_prompt_shares():
    prompts = [prompt([100 + i, 200 + i]) for i in range(19)] + [[7, 7, 300]]  # one made another way
    requests = request_tokens(prompts)
    assert requests[:19] == [[100 + i, 200 + i] for i in range(19)]
    assert requests[19] == [7, 7, 300]


def test_a_training_prompt_made_from_a_conversations_text_counts_as_that_conversation(tmp_path):
    """A 'tasks' prompt wraps a ShareGPT text (to translate, to summarize) and names it as
    <kind>:sharegpt:<conversation id>:<turn>: a held-out turn of that conversation is not held out."""
    from vllm_mtpspec.sharegpt import conversation_of

    assert conversation_of("summarize:sharegpt:YwTudDR_0:3") == "YwTudDR"
    assert conversation_of("translate:sharegpt:48DLSiF_13:0") == "48DLSiF"
    assert conversation_of("translate:chatterbot:french/food.yml:3:1") == "translate:chatterbot:french/food.yml:3:1"
    rng = random.Random(1)
    words = [[rng.randrange(100, 50_000) for _ in range(40)] for _ in range(3)]
    write(tmp_path / "train", ["summarize:sharegpt:YwTudDR_0:3"], [prompt(words[0])])
    write(tmp_path / "held", ["YwTudDR_0", "YwTudDR_1#2", "other_0"], [prompt(w) for w in words])
    audit = audit_held_out([str(tmp_path / "train")], [str(tmp_path / "held")])
    assert audit.same_conversation == ["YwTudDR_0", "YwTudDR_1#2"] and audit.kept == 1
