"""Fresh heads for a model: shapes, fingerprint and embedding scale taken from the model."""
from __future__ import annotations

from pathlib import Path

import torch

from vllm_mtpspec.checkpoint import model_fingerprint
from vllm_mtpspec.config import ConfigError, HeadsConfig, layers_beyond
from vllm_mtpspec.heads import MTPHeads
from vllm_mtpspec.model_profile import profile_of_hf_config


def model_display_name(model_dir: str | Path) -> str:
    name = Path(model_dir).name
    for suffix in ("-bf16", "-fp32"):  # cache folders carry their dtype; heads serve both
        name = name.removesuffix(suffix)
    return name


def embedding_scale(model) -> float:
    """How much larger the final hidden state is than a token embedding, on average.
    After the final RMSNorm, |h| ~ |norm weight|; token-conditioned heads multiply the
    embedding by this ratio so that neither input drowns the other."""
    profile = profile_of_hf_config(model.config)
    norm = getattr(getattr(model, "model", model), "norm", None)
    # The rows the model feeds its first layer, as the heads read them (Gemma scales them).
    embed = model.get_input_embeddings().weight.detach().float() * profile.embed_scale
    hidden_norm = (profile.norm_gain(norm.weight.detach().float()).norm() if norm is not None
                   else embed.shape[1] ** 0.5)
    return float(hidden_norm / embed.norm(dim=-1).mean().clamp_min(1e-6))


def init_heads(
    model,
    model_dir: str | Path,
    *,
    num_heads: int,
    tied: bool = True,
    head_input: str = "hidden",
    mlp_size: int = 0,
    init_std: float = 0.0,
    seed: int = 0,
    head_kind: str = "parallel",
) -> MTPHeads:
    """Parallel or sequential heads that start as the model's LM head: their last matrix
    is zero (Medusa; init_std > 0 draws it at random) and, when untied, their projections
    are copies of the LM head."""
    cfg = model.config
    config = HeadsConfig(
        num_heads=num_heads,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        tied=tied,
        head_kind=head_kind,
        head_input=head_input,
        mlp_size=mlp_size,
        embed_scale=embedding_scale(model) if head_input == "hidden+token" else 1.0,
        base_model_fingerprint=model_fingerprint(model_dir),
        base_model_name=model_display_name(model_dir),
        base_model_num_params=sum(p.numel() for p in model.parameters()),
    )
    with torch.random.fork_rng():  # the hidden layer's random init: same seed, same heads
        torch.manual_seed(seed)
        heads = config.kind.build(config)
    if init_std > 0:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for last in heads.last_layers():
                last.weight.normal_(0.0, init_std, generator=generator)
    heads.init_projections_from(model.get_output_embeddings().weight.detach().float())
    return heads


def _layer_config(model, model_dir: str | Path, *, num_heads: int, head_kind: str, block, tied: bool = True):
    """The heads config of a drafter shaped like one of the model's decoder layers (it reads
    the sampled token), made for this model."""
    cfg = model.config
    return HeadsConfig(num_heads=num_heads, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, tied=tied,
                       head_kind=head_kind, head_input="hidden+token", block=block,
                       base_model_fingerprint=model_fingerprint(model_dir),
                       base_model_name=model_display_name(model_dir),
                       base_model_num_params=sum(p.numel() for p in model.parameters()))


def init_draft_block(model, model_dir: str | Path, *, num_heads: int, window: int = 1024, seed: int = 0,
                     feature_layers: list[int] | tuple[int, ...] = (), mlp_size: int = 0):
    """A fresh attention draft block shaped like one of the model's decoder layers that
    starts by passing the feature through: its fusion reads the feature alone, attention
    and MLP add nothing yet (their output matrices are zero) and its norms take the final
    norm's gain out and put it back, so an untrained block drafts what the LM head says on h,
    as untrained parallel heads do, rather than noise. feature_layers: target layers
    whose input states it reads too (their fusion starts at zero). mlp_size: its MLP's
    width (0: the layer's); a narrower one keeps a large model's drafter small."""
    from vllm_mtpspec.draft_block import DraftBlock, block_config_for

    cfg = model.config
    check_feature_layers(feature_layers, cfg.num_hidden_layers, where="feature_layers")
    config = _layer_config(model, model_dir, num_heads=num_heads, head_kind="attention",
                           block=block_config_for(cfg, window=window, feature_layers=feature_layers,
                                                  mlp_size=mlp_size))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        block = DraftBlock(config)
    d = cfg.hidden_size
    norm = getattr(getattr(model, "model", model), "norm", None)
    gain = profile_of_hf_config(cfg).norm_gain(norm.weight.detach().float()) if norm is not None else None
    with torch.no_grad():
        block.fuse.weight.zero_()
        block.fuse.weight[:, :d].copy_(torch.eye(d))
        block.o_proj.weight.zero_()
        block.down_proj.weight.zero_()
        if gain is not None and bool((gain.abs() > 1e-3).all()):
            # h = n * gain for a unit-RMS n. Divided out at the feature norm (leaving n, at about
            # unit RMS for the layer's residual stream) and put back at the output norm, the
            # gain passes h through exactly, however unequal it is (Gemma 3 270M's final gains
            # run from 0.19 to 301).
            block.feature_norm.weight.copy_(gain.pow(2).mean().sqrt() / gain)
            block.output_norm.weight.copy_(gain)
        elif gain is not None:  # a gain near zero cannot be divided out: h's scale at least
            block.output_norm.weight.fill_(float(gain.pow(2).mean().sqrt()))
    return block


def init_eagle3_layer(model, model_dir: str | Path, *, num_heads: int, seed: int = 0,
                      feature_layers: list[int] | tuple[int, ...] = (), tied: bool = True,
                      window: int | None = None):
    """A fresh EAGLE-3 layer (random weights, as EAGLE-3 training starts) shaped like one
    of the model's decoder layers, reading feature_layers (default: vLLM's three). Tied: it
    drafts through the target's LM head; else through its own, a copy of it."""
    from vllm_mtpspec.draft_block import block_config_for
    from vllm_mtpspec.eagle3_layer import Eagle3Layer
    from vllm_mtpspec.model_profile import eagle3_default_layers

    cfg = model.config
    feature_layers = list(feature_layers) or eagle3_default_layers(cfg.num_hidden_layers)
    check_feature_layers(feature_layers, cfg.num_hidden_layers, where="feature_layers")
    block = block_config_for(cfg, window=window or cfg.max_position_embeddings, feature_layers=feature_layers)
    block.norm_before_residual = True
    config = _layer_config(model, model_dir, num_heads=num_heads, tied=tied, head_kind="eagle3", block=block)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layer = Eagle3Layer(config)
    if not tied:
        with torch.no_grad():
            layer.lm_head.weight.copy_(model.get_output_embeddings().weight.detach().float())
    return layer


def check_feature_layers(feature_layers, num_layers: int, *, where: str) -> None:
    """Refuses layer indices the target does not have (its layers are 0 .. num_layers - 1)."""
    beyond = layers_beyond(feature_layers, num_layers)
    if beyond:
        raise ConfigError(f"{where}={list(feature_layers)}: layers {beyond} are not among the target's "
                          f"{num_layers} layers (0 .. {num_layers - 1})")


def grown_block(block, feature_layers: list[int]):
    """An attention draft block like `block` that also reads the states entering
    feature_layers: every weight it had is kept and the new fusion starts at zero, so it
    drafts exactly what `block` drafts until it trains."""
    import copy

    from vllm_mtpspec.draft_block import DraftBlock

    if block.feature_layers:
        raise ConfigError(f"init_from: the block already reads layers {block.feature_layers}; "
                          "feature_layers can only be added to a block that reads none")
    config = copy.deepcopy(block.config)
    config.block.feature_layers = list(feature_layers)
    like = next(block.parameters())
    grown = DraftBlock(config).to(like.device, like.dtype)
    # Strict but for the new fusion's weights, which keep their initial values.
    missing, unexpected = grown.load_state_dict(block.state_dict(), strict=False)
    if unexpected or not all(name.startswith(("layer_norms.", "layer_fuse.")) for name in missing):
        raise RuntimeError(f"growing the block: weights {unexpected or missing} do not match")
    return grown
