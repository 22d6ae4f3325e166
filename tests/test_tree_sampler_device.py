"""The tree sampler as a GPU would run it: every tensor on the logits' device, seeded
requests drawing from generators on their own device, and one read back per step.

There is no GPU here, so the logits live on the meta device: a tensor the sampler built
on the host would meet them in an operation and fail (or show up in the recorder), as
it would meet CUDA logits on a GPU."""
from types import SimpleNamespace

import torch
from torch.overrides import TorchFunctionMode

from vllm_mtpspec.tree import chain_tree, tree_from_paths
from vllm_mtpspec.vllm import tree_sampler
from vllm_mtpspec.vllm.tree_step import ScheduledTree, TreeStep

HOST_READS = {"tolist", "item", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy"}


class TensorRecorder(TorchFunctionMode):
    """Devices of every tensor an operation returns, and each read back to the host."""

    def __init__(self):
        super().__init__()
        self.devices: list[tuple[str, torch.device]] = []
        self.host_reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in HOST_READS:
            self.host_reads.append(name)
        result = func(*args, **(kwargs or {}))
        for value in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(value, torch.Tensor):
                self.devices.append((name, value.device))
        return result


def step_of_three_requests():
    tree = tree_from_paths([(0,), (1,), (0, 0), (1, 0)])
    return TreeStep((ScheduledTree(0, tree, (1, 2, 3, 4)), ScheduledTree(2, chain_tree(3), (5, 6, 7)))), [4, 1, 3]


def metadata(device, *, generators=None, temperature=(0.7, 0.0, 1.1)):
    return SimpleNamespace(
        all_greedy=False,
        temperature=torch.tensor(temperature, device=device),
        top_k=torch.tensor([5, 50, 3], dtype=torch.int32, device=device),
        top_p=torch.tensor([0.9, 1.0, 0.8], device=device),
        generators=generators or {},
    )


def test_every_tensor_the_sampler_makes_follows_the_logits_device(monkeypatch):
    step, num_drafts = step_of_three_requests()
    device = torch.device("meta")
    logits = torch.randn(sum(n + 1 for n in num_drafts), 32, device=device)
    sampled = torch.full((3, 5), -1, device=device)
    handed_to_vllm = []
    import vllm.v1.sample.ops.topk_topp_sampler as topk_topp

    original = topk_topp.apply_top_k_top_p

    def spy(logits, k, p, *args, **kwargs):
        handed_to_vllm.append((logits.device, None if k is None else k.device, None if p is None else p.device))
        return original(logits, k, p, *args, **kwargs)

    monkeypatch.setattr(topk_topp, "apply_top_k_top_p", spy)
    # Meta tensors hold no values: stop where the verdicts are read back to the host.
    monkeypatch.setattr(tree_sampler, "read_verdicts", lambda batch, emitted, walked: [])
    with TensorRecorder() as recorder:
        tree_sampler.verify_tree_requests(step, logits, num_drafts, metadata(device), sampled)
    assert handed_to_vllm == [(device, device, device)]
    elsewhere = sorted({name for name, d in recorder.devices if d != device})
    assert not elsewhere, f"tensors made off the logits' device by: {elsewhere}"


def test_seeded_requests_draw_on_their_generators_device(monkeypatch):
    """Here the generator is a CPU one while the logits and torch's default device are
    elsewhere (meta): the draw must happen on the generator's own device, as vLLM's CUDA
    generators need on a GPU whose host default is the CPU."""
    step, num_drafts = step_of_three_requests()
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    monkeypatch.setattr(tree_sampler, "read_verdicts", lambda batch, emitted, walked: [])
    with torch.device("meta"):
        logits = torch.randn(sum(n + 1 for n in num_drafts), 32)
        sampled = torch.full((3, 5), -1)
        tree_sampler.verify_tree_requests(step, logits, num_drafts, metadata("meta", generators={2: generator}), sampled)
    assert not torch.equal(generator.get_state(), state), "the request's own generator did not draw"


def test_seeded_requests_repeat_and_every_request_is_read_back_once():
    step, num_drafts = step_of_three_requests()
    logits = torch.randn(sum(n + 1 for n in num_drafts), 32, generator=torch.Generator().manual_seed(3))
    outcomes = []
    for _ in range(2):
        sampled = torch.full((3, 5), -1)
        generators = {0: torch.Generator().manual_seed(9), 2: torch.Generator().manual_seed(10)}
        with TensorRecorder() as recorder:
            verdicts = tree_sampler.verify_tree_requests(step, logits, num_drafts, metadata("cpu", generators=generators),
                                                         sampled)
        assert recorder.host_reads == ["tolist"], "the verdicts of a whole step come back in one read"
        outcomes.append((sampled.clone(), {i: v.emitted for i, v in verdicts.items()}))
        for i, verdict in verdicts.items():
            assert sampled[i, : len(verdict.emitted)].tolist() == verdict.emitted
            assert (sampled[i, len(verdict.emitted):] == -1).all()
        assert (sampled[1] == -1).all()  # not a tree request: vLLM's row stays
    assert torch.equal(outcomes[0][0], outcomes[1][0]) and outcomes[0][1] == outcomes[1][1]
