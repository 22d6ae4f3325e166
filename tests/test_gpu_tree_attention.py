"""The tree path inside vLLM 0.33's GPU attention backends, checked on the CPU: tree rows
recomputed over a cache in FlashAttention's and Triton's layout (the Triton kernel under
TRITON_INTERPRET=1) against the PyTorch path, through the same forward wrapper the hooks
install; KV compaction in that layout; the engine checks that refuse what the wrapper
cannot serve; and CUDA graphs kept away from the recomputation."""
import pytest
import torch

from tests.interpreter import run_under_triton_interpreter
from tests.paged_trees import backend_cache
from tests.proposers import cpu_proposer
from vllm_mtpspec.checkpoint import save_heads
from vllm_mtpspec.config import ConfigError
from vllm_mtpspec.heads_init import init_heads
from vllm_mtpspec.vllm import hooks, platform_defaults
from vllm_mtpspec.vllm.gpu_tree_attention import move_paged_kv, paged_keys_and_values

NUM_KV_HEADS, HEAD_SIZE = 2, 64

# Run under TRITON_INTERPRET=1 here, and on CUDA tensors by benchmarks/gpu_check.py (which
# makes torch's default device the GPU): imports nothing but torch and the project.
CHECK = r"""
import math
from types import SimpleNamespace
import torch
from tests.paged_trees import backend_cache, random_tree
from vllm_mtpspec.vllm import hooks
from vllm_mtpspec.vllm.attention import masked_attention
from vllm_mtpspec.vllm.gpu_tree_attention import move_paged_kv, paged_keys_and_values
from vllm_mtpspec.vllm.tree_step import ScheduledTree, TreeStep

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 6, 2, 64
SCALE = 1 / math.sqrt(HEAD_SIZE)

class StockImpl:
    # Stands in for FlashAttentionImpl / TritonAttentionImpl: the attributes the wrapper
    # reads, and a forward that leaves its own (here: arbitrary) causal rows in output.
    attn_type = "decoder"
    head_size, scale = HEAD_SIZE, SCALE
    sliding_window, logits_soft_cap, sinks, alibi_slopes, kv_cache_dtype = (-1, -1), 0.0, None, None, "auto"
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        output.fill_(7.0)
        return output

StockImpl.forward = hooks._with_tree_rows(StockImpl.forward, hooks._gpu_tree_rows)

def check(block_size, physical, plan, seed):
    gen = torch.Generator(torch.get_default_device()).manual_seed(seed)
    kv_cache = backend_cache(64, block_size, NUM_KV_HEADS, HEAD_SIZE, physical, gen)
    key_cache, value_cache = paged_keys_and_values(kv_cache, HEAD_SIZE)
    free = torch.randperm(64, generator=gen).tolist()
    trees, rows, seq_lens, starts, expected, queries = [], [], [], [0], [], []
    for i, (prefix_len, num_nodes) in enumerate(plan):
        n = 1 + (num_nodes or 3)
        seq_len = prefix_len + n
        blocks = torch.tensor([free.pop() for _ in range(-(-seq_len // block_size))])
        positions = torch.arange(seq_len)
        # What vLLM wrote for this request, in order: [1, H_kv, seq_len, D].
        keys = key_cache[blocks[positions // block_size], positions % block_size].transpose(0, 1)[None]
        values = value_cache[blocks[positions // block_size], positions % block_size].transpose(0, 1)[None]
        query = torch.randn(n, NUM_HEADS, HEAD_SIZE, generator=gen)
        queries.append(query)
        rows.append(blocks)
        seq_lens.append(seq_len)
        starts.append(starts[-1] + n)
        if num_nodes is None:
            expected.append(None)
            continue
        shape = random_tree(num_nodes, torch.Generator().manual_seed(seed + i))
        trees.append(ScheduledTree(i, shape, tuple(range(num_nodes))))
        mask = torch.zeros(1, n, seq_len, dtype=torch.bool)
        mask[0, :, :prefix_len] = True
        mask[0, :, prefix_len:] = shape.ancestor_mask(include_root=True)
        expected.append(masked_attention(query[None], keys, values, mask, SCALE)[0])
    width = max(len(b) for b in rows) + 2
    metadata = SimpleNamespace(
        block_table=torch.stack([torch.cat([b, b.new_zeros(width - len(b))]) for b in rows]).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32))
    query = torch.cat(queries + [torch.zeros(3, NUM_HEADS, HEAD_SIZE)])  # the runner pads the step
    output = torch.zeros(query.shape[0], NUM_HEADS, HEAD_SIZE)
    impl = StockImpl()
    hooks._active_tree_step = None        # no tree step: the stock rows stay
    impl.forward(None, query, None, None, kv_cache, metadata, output=output)
    assert torch.all(output == 7.0)
    hooks._active_tree_step, hooks._tree_query_starts = TreeStep(tuple(trees)), starts
    hooks._tree_attention_plan = hooks._move_tree_kv = None
    for _ in range(2):                    # two layers: the second reuses the step's plan
        impl.forward(None, query, None, None, kv_cache, metadata, output=output, output_scale=None)
    assert hooks._move_tree_kv is move_paged_kv
    for i, want in enumerate(expected):
        got = output[starts[i]: starts[i + 1]]
        if want is None:
            assert torch.all(got == 7.0), "a request off the tree path keeps the stock rows"
        else:
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.all(output[starts[-1]:] == 7.0), "padding rows are left alone"
    try:
        impl.forward(None, query, None, None, kv_cache, metadata, output=output, output_scale=torch.ones(1))
    except NotImplementedError as error:
        assert "quantized attention outputs" in str(error)
    else:
        raise AssertionError("a fused output quantization was not refused")
    hooks._active_tree_step = None

# (cached prefix, tree nodes; None: a request verified as a chain by vLLM)
check(16, "NHD", [(5, 1), (37, 7), (15, 20), (0, 3), (70, None)], seed=0)
check(32, "HND", [(40, None), (100, 12), (31, 1)], seed=1)
print("gpu-tree-rows-ok")
"""


def test_the_gpu_backends_tree_rows_equal_dense_attention_under_the_interpreter():
    pytest.importorskip("triton")
    run_under_triton_interpreter(CHECK, "gpu-tree-rows-ok")


@pytest.mark.parametrize("physical", ["NHD", "HND"])
def test_accepted_nodes_kv_moves_to_their_final_slots_in_the_backends_layout(physical):
    block_size = 16
    layers = [backend_cache(12, block_size, NUM_KV_HEADS, HEAD_SIZE, physical) for _ in range(2)]
    before = [layer.clone() for layer in layers]
    # The step's tokens: 3 of another request, then a tree request's root and 7 nodes at
    # positions 44..51, across a block boundary (blocks 2 and 5 of its table).
    block_row = torch.tensor([0, 1, 2, 5])
    positions = torch.arange(44, 52)
    slot_mapping = torch.cat([torch.tensor([100, 101, 102]),
                              block_row[positions // block_size] * block_size + positions % block_size])
    # Accepted path: nodes 1, 4 and 6 (tokens 5, 8, 10) to depths 1-3 (tokens 4, 5, 6), listed deepest
    # first so that token 5 is written before it is read: every source must be read before any write.
    sources, destinations = [10, 8, 5], [6, 5, 4]
    move_paged_kv(layers, slot_mapping, sources, destinations)
    for layer, old in zip(layers, before):
        def entry(cache, token):
            slot = int(slot_mapping[token])
            return cache.transpose(1, 2)[slot // block_size, slot % block_size]
        for src, dst in zip(sources, destinations):
            assert torch.equal(entry(layer, dst), entry(old, src))
        moved_slots = {int(slot_mapping[t]) for t in destinations}
        flat_new, flat_old = layer.transpose(1, 2).reshape(-1, NUM_KV_HEADS, 2 * HEAD_SIZE), \
            old.transpose(1, 2).reshape(-1, NUM_KV_HEADS, 2 * HEAD_SIZE)
        others = [s for s in range(flat_new.shape[0]) if s not in moved_slots]
        assert torch.equal(flat_new[others], flat_old[others])


def test_paged_views_are_the_halves_of_each_tokens_entry():
    kv_cache = backend_cache(4, 16, NUM_KV_HEADS, HEAD_SIZE, "NHD")
    key_cache, value_cache = paged_keys_and_values(kv_cache, HEAD_SIZE)
    assert key_cache.shape == (4, 16, NUM_KV_HEADS, HEAD_SIZE)
    assert torch.equal(key_cache[2, 5, 1], kv_cache[2, 1, 5, :HEAD_SIZE])
    assert torch.equal(value_cache[2, 5, 1], kv_cache[2, 1, 5, HEAD_SIZE:])


class Attention(torch.nn.Module):
    def __init__(self, impl):
        super().__init__()
        self.impl = impl


class PatchedImpl:
    attn_type = "decoder"
    sliding_window, logits_soft_cap, sinks, alibi_slopes, kv_cache_dtype = (-1, -1), 0.0, None, None, "auto"

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        return output


PatchedImpl.forward = hooks._with_tree_rows(PatchedImpl.forward, hooks._gpu_tree_rows)


class FlashInferImpl(PatchedImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):  # not wrapped
        return output


def impl_with(**attributes):
    impl = PatchedImpl()
    for name, value in attributes.items():
        setattr(impl, name, value)
    return impl


def model_of(*impls):
    return torch.nn.Sequential(*(Attention(impl) for impl in impls))


def test_an_engine_whose_attention_cannot_recompute_tree_rows_is_named():
    assert hooks.tree_attention_blocker(model_of(PatchedImpl(), PatchedImpl())) is None
    reason = hooks.tree_attention_blocker(model_of(PatchedImpl(), FlashInferImpl()))
    assert "FlashInferImpl" in reason and "--attention-backend FLASH_ATTN" in reason
    encoder = impl_with(attn_type="encoder_only")  # not a decoder layer: never on the tree path
    encoder.__class__ = FlashInferImpl
    assert hooks.tree_attention_blocker(model_of(PatchedImpl(), encoder)) is None
    for attributes, named in (({"sliding_window": (4095, 0)}, "a sliding window"),
                              ({"logits_soft_cap": 30.0}, "a logits soft cap"),
                              ({"sinks": torch.zeros(2)}, "attention sinks"),
                              ({"kv_cache_dtype": "fp8_e4m3"}, "a quantized KV cache"),
                              ({"dcp_world_size": 2}, "decode context parallelism")):
        assert named in hooks.tree_attention_blocker(model_of(PatchedImpl(), impl_with(**attributes)))
    mrope = type("ModelConfig", (), {"uses_mrope": True})()
    assert "M-RoPE" in hooks.tree_attention_blocker(model_of(PatchedImpl()), mrope)


def test_a_proposer_asked_for_trees_refuses_such_an_engine_at_load(tiny_model, tiny_model_dir, tmp_path):
    heads_dir = save_heads(init_heads(tiny_model, tiny_model_dir, num_heads=3, seed=3), tmp_path / "heads")
    proposer = cpu_proposer(tiny_model, tiny_model_dir, {"heads": str(heads_dir), "tree": "dynamic"})
    with pytest.raises(ConfigError, match=r"tree='dynamic' was asked, and this engine cannot verify trees: .*"
                                          r"FlashInferImpl.*Use tree='chain'"):
        proposer.load_model(model_of(FlashInferImpl()))


@pytest.fixture
def on_a_gpu(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)


def test_trees_on_a_gpu_keep_attention_out_of_cuda_graphs(on_a_gpu):
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CUDAGraphMode

    unset = CompilationConfig()
    platform_defaults.run_tree_attention_eagerly(unset, "dynamic")
    assert unset.cudagraph_mode == CUDAGraphMode.PIECEWISE
    given = {}
    platform_defaults.run_tree_attention_eagerly(given, "dynamic")
    assert given == {"cudagraph_mode": "PIECEWISE"}
    for mode in ("PIECEWISE", "NONE", CUDAGraphMode.NONE):
        config = CompilationConfig(cudagraph_mode=mode)
        platform_defaults.run_tree_attention_eagerly(config, "dynamic")
        assert config.cudagraph_mode == CUDAGraphMode[str(getattr(mode, "name", mode))]
    for mode in ("FULL_AND_PIECEWISE", "FULL", "FULL_DECODE_ONLY"):
        with pytest.raises(ConfigError, match=rf"cudagraph_mode is {mode}: give cudagraph_mode PIECEWISE or NONE"):
            platform_defaults.run_tree_attention_eagerly(CompilationConfig(cudagraph_mode=mode), "static")
        with pytest.raises(ConfigError, match="full CUDA graph"):
            platform_defaults.run_tree_attention_eagerly({"cudagraph_mode": mode.lower()}, "static")


def test_on_a_cpu_the_compilation_config_is_left_alone():
    from vllm.config import CompilationConfig

    config = CompilationConfig()
    platform_defaults.run_tree_attention_eagerly(config, "dynamic")
    assert config.cudagraph_mode is None


def test_which_gpus_verify_trees(on_a_gpu, monkeypatch):
    from vllm.platforms import current_platform

    from vllm_mtpspec.vllm import version

    monkeypatch.setattr(version, "vllm_version", lambda: "0.33.0")
    assert platform_defaults.platform_blocker() is None
    monkeypatch.setattr(version, "vllm_version", lambda: "0.32.0")
    assert "vLLM 0.33's attention backends" in platform_defaults.platform_blocker()
    monkeypatch.setattr(version, "vllm_version", lambda: "0.33.0")
    monkeypatch.setattr("vllm_mtpspec.triton_support.triton", None)
    assert "Triton is not installed" in platform_defaults.platform_blocker()
    monkeypatch.setattr(current_platform, "is_cuda", lambda: False)
    assert "CPU backend and for CUDA GPUs only" in platform_defaults.platform_blocker()


GPU_CHECK = r"""
import sys, torch
sys.path.insert(0, "benchmarks")
import gpu_check
gpu_check.run_test_check("test_gpu_tree_attention.py", torch.device("cpu"))
report = {"tree rows": {}}
gpu_check.time_tree_rows(torch.device("cpu"), report, shapes={"tiny": (4, 2, 16)}, sizes=((1, 3, 20),),
                         dtype=torch.float32)
(timing,) = report["tree rows"].values()
assert timing["per_layer_ms"] > 0 and timing["plan_per_step_ms"] > 0, timing
print("gpu-check-tree-parts-ok")
"""


def test_the_gpu_check_scripts_tree_parts_run_under_the_interpreter():
    """What benchmarks/gpu_check.py runs on a lent GPU (no pytest there): the check above
    read from this file, and the tree rows' timing, on tiny shapes."""
    pytest.importorskip("triton")
    run_under_triton_interpreter(GPU_CHECK, "gpu-check-tree-parts-ok")
