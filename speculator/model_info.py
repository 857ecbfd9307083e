"""What a model's config says about it: context length and output vocabulary."""

from __future__ import annotations

from transformers import PreTrainedModel


def output_vocab_size(model: PreTrainedModel) -> int:
    return model.get_output_embeddings().weight.shape[0]


def context_length(model: PreTrainedModel) -> int | None:
    """The model's maximum number of positions, where its config states one."""
    config = model.config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
