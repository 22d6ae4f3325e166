"""The co-training step's layout: a draft block on the student's states, chains run from the
answer rows only, must see what it would see run over every row."""
import pytest
import torch

from vllm_mtpspec.heads_init import init_draft_block
from vllm_mtpspec.target import load_target
from vllm_mtpspec_train.modules import CotrainModule, _cotrain_answers


def _shard(path, prompts, answers, k=8):
    tokens = torch.tensor([t for a in answers for t in a], dtype=torch.int32)
    n = tokens.numel()
    torch.save({"prompt_ids": prompts, "tokens": tokens, "offsets": torch.tensor([0, *torch.tensor(
        [len(a) for a in answers]).cumsum(0).tolist()]), "topk_ids": torch.randint(0, 49152, (n, k), dtype=torch.int32),
        "topk_logprobs": torch.randn(n, k).half(), "hidden": torch.zeros(n, 4).half()}, path)
    return path


def test_block_chains_from_the_answer_rows_equal_those_run_from_every_row(tiny_smol_student, tmp_path):
    student = load_target(str(tiny_smol_student), dtype="fp32").model
    block = init_draft_block(student, tiny_smol_student, num_heads=3, seed=0)
    torch.nn.init.normal_(block.o_proj.weight, std=0.05)  # an untrained block's attention adds nothing
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (5, 17)]
    answers = [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (9, 6)]
    path = str(_shard(tmp_path / "shard-00000.pt", prompts, answers))
    batch = {"path": [path, path], "answer": [0, 1]}
    module = CotrainModule(student, block, num_negatives=64, kl_weight=1.0, mtp_weight=1.0)
    laid = _cotrain_answers(batch, block.num_heads)
    with torch.no_grad():
        states = student.model(input_ids=laid["input_ids"], attention_mask=laid["mask"]).last_hidden_state
        embed = student.get_input_embeddings().weight
        picked = module._block_states(states, laid, embed)[laid["row_b"], laid["row_q"]]
        t = states.shape[1] - 1
        tokens = torch.nn.functional.pad(laid["input_ids"][:, 1:], (0, block.num_heads - 1))
        every_row = torch.stack(block.unrolled(states[:, :-1], [embed[tokens[:, i:i + t]] for i in range(3)],
                                               torch.arange(t).expand(2, t), laid["mask"][:, 1:].bool()), 2)
    assert picked.shape[0] == (9 - 1) + (6 - 1)  # the rows with at least one depth's target
    torch.testing.assert_close(picked, every_row[laid["row_b"], laid["row_p"]])
    # The rows are the answers': sequence 1's first kept row predicts its answer's first token.
    assert laid["row_p"][laid["row_b"] == 1][0] == len(prompts[1]) - 1


def test_gradient_checkpointing_reaches_the_student_and_keeps_its_gradients(tiny_smol_student, tmp_path):
    from vllm_mtpspec.checkpoint import save_heads
    from vllm_mtpspec_train.config import TrainConfig, TrainConfigError
    from vllm_mtpspec_train.train import _build_module

    student = load_target(str(tiny_smol_student), dtype="fp32").model
    save_heads(init_draft_block(student, tiny_smol_student, num_heads=2, seed=0), tmp_path / "block")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (7, 4)]
    answers = [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (6, 9)]
    path = str(_shard(tmp_path / "shard-00000.pt", prompts, answers))
    grads = []
    for checkpointing in (False, True):
        config = TrainConfig(mode="cotrain", student=str(tiny_smol_student), gradient_checkpointing=checkpointing)
        module = _build_module({**config.to_dict(), "init_heads": str(tmp_path / "block")})
        assert module.student.is_gradient_checkpointing == checkpointing
        loss, _ = module({"path": [path, path], "answer": [0, 1]}, torch.Generator().manual_seed(0))
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in module.student.model.layers.parameters()]))
    torch.testing.assert_close(grads[0], grads[1])
    with pytest.raises(TrainConfigError, match="gradient_checkpointing with mode='posthoc'"):
        TrainConfig(gradient_checkpointing=True)
