"""The co-training student: the teacher cut to fewer layers, initialized from its own."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from vllm_mtpspec_train.student import StudentError, kept_layers, make_student


def test_a_student_keeps_the_teachers_first_third_and_its_last_layers():
    assert kept_layers(30, 15) == [0, 1, 2, 3, 4, *range(20, 30)]
    assert kept_layers(2, 1) == [1]
    assert kept_layers(6, 3) == [0, 4, 5]
    for asked in (0, 30, 31):
        with pytest.raises(StudentError, match=f"--layers {asked}: a student keeps between 1 and 29"):
            kept_layers(30, asked)


def test_the_student_folder_computes_what_the_teacher_does_with_those_layers(tiny_smol_teacher, tmp_path):
    out = make_student(tiny_smol_teacher, tmp_path / "student", layers=1)
    student = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    teacher = AutoModelForCausalLM.from_pretrained(str(tiny_smol_teacher), dtype=torch.float32).eval()
    assert student.config.num_hidden_layers == 1
    assert json.loads((out / "student.json").read_text())["kept_layers"] == [1]
    assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").is_file()
    ids = torch.tensor([[1, 200, 3000, 45, 9, 17]])
    with torch.no_grad():
        full = teacher(ids).logits
        teacher.model.layers = torch.nn.ModuleList([teacher.model.layers[1]])
        teacher.model.layers[0].self_attn.layer_idx = 0
        cut = teacher(ids).logits
        assert not torch.allclose(full, cut)
        torch.testing.assert_close(student(ids).logits, cut)
        # Decoding with a KV cache reads every kept layer's own cache slot.
        greedy = student.generate(ids, max_new_tokens=4, do_sample=False)
        step = ids
        for _ in range(4):
            step = torch.cat([step, student(step).logits[:, -1:].argmax(-1)], 1)
        assert torch.equal(greedy, step)
