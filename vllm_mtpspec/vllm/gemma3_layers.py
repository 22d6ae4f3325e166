"""Gemma3Model.forward (vllm/model_executor/models/gemma3.py, the same in vLLM 0.32 and
0.33) with LlamaModel's collection of the states entering chosen layers (llama.py's
forward): what vLLM's EAGLE-3 interface asks of a model. Installed by
hooks.install_layer_states_for, which also gives the model class that interface.

A module of its own, importing vLLM at the top, because vLLM compiles the model's forward
as a plain function of a file (support_torch_compile): it must have no closure."""
from itertools import islice

import torch
from vllm.distributed import get_pp_group
from vllm.sequence import IntermediateTensors


def gemma3_forward_with_layer_states(
    self,
    input_ids: torch.Tensor | None,
    positions: torch.Tensor,
    intermediate_tensors: IntermediateTensors | None = None,
    inputs_embeds: torch.Tensor | None = None,
    **kwargs,
):
    if get_pp_group().is_first_rank:
        hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        residual = None
    else:
        assert intermediate_tensors is not None
        hidden_states = intermediate_tensors["hidden_states"]
        residual = intermediate_tensors["residual"]
    aux_hidden_states: list[torch.Tensor] = []
    if get_pp_group().is_first_rank:
        # The state entering layer 0: the scaled token embedding.
        self._maybe_add_hidden_state(aux_hidden_states, self.start_layer, hidden_states, residual)
    for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer), start=self.start_layer):
        hidden_states, residual = layer(positions, hidden_states, residual, **kwargs)
        # A Gemma 3 layer returns its output split as (hidden, residual), as Llama's does.
        self._maybe_add_hidden_state(aux_hidden_states, idx + 1, hidden_states, residual)
    if not get_pp_group().is_last_rank:
        return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
    hidden_states, _ = self.norm(hidden_states, residual)
    if len(aux_hidden_states) > 0:
        return hidden_states, aux_hidden_states
    return hidden_states
