"""What a proposer that drafts in INT8 holds of the heads' matrices, inside a real vLLM
engine: the bytes of floating-point weights and of INT8 codes in every Int8Linear (the
heads' matrices, an attention block's side-by-side drafting products, the draft
vocabulary's LM-head rows) and the rest of the heads (norms, biases). (The process's
resident memory moved by more than these between runs of the same commit.)

    python benchmarks/int8_held_memory.py --heads vllm_mtpspec/shipped_heads/smollm2-135m-instruct

Run it once per heads directory, and from an older commit's checkout to compare. draft_dtype "int8" (what "auto" gives on
a CPU without native bf16, and for INT2 heads on any CPU).
"""
import argparse
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, to be measured
sys.path.insert(0, ".")

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--heads", required=True)
args = parser.parse_args()


def held_bytes(worker) -> dict:
    """For LLM.collective_rpc: the proposer's heads, by what holds the bytes."""
    import torch

    from vllm_mtpspec.quant.int8_dynamic import Int8Linear

    drafter = worker.model_runner.drafter
    int8 = [m for m in drafter.heads.modules() if isinstance(m, Int8Linear)]
    form = getattr(drafter.heads, "_drafting", None)
    if form is not None:
        int8 += [p for p in (form.qkv, form.gate_up, form.feature_fuse) if isinstance(p, Int8Linear)]
    if isinstance(drafter._lm_head, Int8Linear):
        int8.append(drafter._lm_head)
    seen, floating, codes = set(), 0, 0
    for module in int8:
        codes += torch.ops.quantized.linear_unpack(module._int8)[0].numel()
        if not module.weight.is_meta and module.weight.data_ptr() not in seen:
            seen.add(module.weight.data_ptr())
            floating += module.weight.numel() * module.weight.element_size()
    inside = {id(p) for m in int8 for p in m.parameters()}
    rest = sum(p.numel() * p.element_size() for p in drafter.heads.parameters()
               if id(p) not in inside and not p.is_meta)
    return {"int8_matrices": len(int8), "float_weights": floating, "int8_codes": codes, "rest_of_heads": rest}


from vllm import LLM  # noqa: E402

from vllm_mtpspec.models import resolve_model  # noqa: E402

llm = LLM(str(resolve_model("smollm2-135m-instruct", dtype="fp32")), dtype="float32", max_model_len=640,
          enforce_eager=True, max_num_seqs=4, kv_cache_memory_bytes=64 << 20, seed=0,
          speculative_config={"method": "mtpspec", "model": args.heads, "num_speculative_tokens": 4,
                              "draft_dtype": "int8"})
held = llm.collective_rpc(held_bytes)[0]
mb = lambda n: f"{n / 1e6:.1f} MB"  # noqa: E731
print(f"# python benchmarks/int8_held_memory.py --heads {args.heads}")
print(f"{held['int8_matrices']} INT8 matrices: floating-point weights {mb(held['float_weights'])}, INT8 codes "
      f"{mb(held['int8_codes'])}; the rest of the heads {mb(held['rest_of_heads'])}")
