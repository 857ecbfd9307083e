"""What a model's config says about it: context length and output vocabulary."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path

import transformers
from packaging.version import Version
from transformers import PreTrainedModel

# The forward argument that takes a KV cache: transformers 5.24 renamed `past_key_values` to
# `cache` (the old name still works there but warns on every call, FutureWarning); earlier 5.x
# releases, which this package also allows, know only the old one.
CACHE_ARGUMENT = "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"


@functools.cache
def _forward_takes_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def keeps_logits(model: PreTrainedModel) -> bool:
    """Whether `model`'s forward computes logits only at the positions it is given
    (`logits_to_keep`, a tensor of positions: every causal LM of transformers 5)."""
    return _forward_takes_logits_to_keep(type(model))


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


def check_model_location(name_or_path: str | Path) -> str:
    """A local folder written by `save_pretrained`, or a hub id; a path that names no model
    raises a FileNotFoundError that says so (instead of a confusing hub lookup error)."""
    text = str(name_or_path)
    path = Path(text).expanduser()
    looks_local = path.exists() or text.startswith((".", "~", "/")) or text.count("/") > 1
    if looks_local and not (path / "config.json").is_file():
        what = "config.json is missing" if path.is_dir() else "the folder does not exist"
        raise FileNotFoundError(
            f"no model found at {text} ({what}); give a folder written by save_pretrained "
            "(e.g. `make reference-llm` writes artifacts/reference-llm/tiny/model) or a hub id"
        )
    return str(path) if looks_local else text
