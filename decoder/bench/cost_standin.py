"""A cost stand-in for a large LLM: a trained small LLM widened to a large model's shapes with
zero-weight channels, heads, neurons and layers (results.md, "A third GPU lease").

Each pass of the stand-in reads and multiplies a large model's weights, so on an accelerator it
costs what a model of that shape costs, while it computes the small LLM's function: the residual
stream's new channels stay exactly zero, the new heads, neurons and layers add exact zeros, and the
RMSNorm weights and epsilon are rescaled so that a norm over the wider state gives what it gave
over the original one. A pool trained on the small LLM therefore keeps its acceptance on the
stand-in. That lets a machine without downloads (or a short GPU lease) measure speculation's
economics at real model sizes with real drafts. Its text is the small LLM's; it is a yardstick,
not a model to serve.

Only rounding changes: some sums run over a longer, zero-padded inner dimension, and transformers
computes RMSNorm's variance in float32, so logits agree to about 1e-7 (the tests check that and the
greedy output, token for token). The stand-in is built in host memory at the LLM's dtype (or
`dtype`): about 4 bytes a parameter in float32.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from specboost.decoder.pool import MANIFEST_FILE
from specboost.speculator.cost_model import FORMAT_VERSION
from specboost.speculator.loading import load_causal_lm, load_tokenizer
from specboost.speculator.predictor import PREDICTOR_DIR, MatchLengthPredictor

# Decoder-only families whose weights are the Llama layout (q/k/v/o projections, gate/up/down
# MLP, RMSNorm before each block and at the end).
WIDENABLE = frozenset({"llama", "mistral", "qwen2"})


@dataclass(frozen=True)
class StandinShape:
    """The large model's shapes. `hidden_size` must be a multiple of the LLM's (the heads scale with
    it, each keeping the LLM's head size); the other two at least the LLM's."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int


def widen_llm(model: PreTrainedModel, shape: StandinShape) -> PreTrainedModel:
    """`model` widened to `shape` (same dtype and device), computing the same function."""
    config = model.config
    _check_shape(config, shape)
    d, factor = config.hidden_size, shape.hidden_size // config.hidden_size
    wide_config = copy.deepcopy(config)
    wide_config.hidden_size = shape.hidden_size
    wide_config.intermediate_size = shape.intermediate_size
    wide_config.num_hidden_layers = shape.num_hidden_layers
    wide_config.head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    wide_config.num_attention_heads = config.num_attention_heads * factor
    wide_config.num_key_value_heads = (config.num_key_value_heads or config.num_attention_heads) * factor
    wide_config.rms_norm_eps = config.rms_norm_eps / factor  # mean over `factor` x the channels
    if layer_types := getattr(config, "layer_types", None):
        extra = shape.num_hidden_layers - config.num_hidden_layers
        wide_config.layer_types = [*layer_types, *[layer_types[-1]] * extra]
    with torch.device("meta"):
        wide = AutoModelForCausalLM.from_config(wide_config, dtype=model.dtype)
    original = model.state_dict()
    state = {}
    for name, target in wide.state_dict().items():
        source = original.get(name)  # None: a new layer's, all zero (its norms too): it adds nothing
        if source is not None and name.endswith("norm.weight") and source.shape == (d,):
            source = source / math.sqrt(factor)  # the norm of the wider state is sqrt(factor) x smaller
        state[name] = _embedded(source, target.shape, 0.0, model.dtype, model.device)
    wide.load_state_dict(state, strict=True, assign=True)
    _copy_buffers(model, wide)
    if config.tie_word_embeddings:
        wide.tie_weights()
    wide.generation_config = copy.deepcopy(model.generation_config)
    return wide.eval()


def widen_predictor(predictor: MatchLengthPredictor, hidden_size: int) -> MatchLengthPredictor:
    """The match-length predictor for the stand-in's hidden states: the new channels (always zero)
    are standardised to zero and read by zero weights, so its estimates are the original's."""
    wide = MatchLengthPredictor(replace(predictor.config, input_size=hidden_size))
    original, state = predictor.state_dict(), {}
    for name, target in wide.state_dict().items():
        fill = 1.0 if name == "input_std" else 0.0  # the new channels: mean 0, std 1
        state[name] = _embedded(original[name], target.shape, fill, target.dtype, target.device)
    wide.load_state_dict(state)
    return wide.eval()


def write_standin(
    llm: str | Path, pool: str | Path, shape: StandinShape, out: str | Path, dtype: torch.dtype | None = None
) -> tuple[Path, Path]:
    """The stand-in of the LLM folder `llm` into OUT/llm and a copy of the exported `pool` for it
    into OUT/pool (its predictor widened; its hardware profile emptied, as it timed another LLM:
    `specboost profile` measures the stand-in's). Returns the two folders."""
    pool = Path(pool)
    if not (pool / MANIFEST_FILE).is_file():
        raise FileNotFoundError(
            f"no exported pool in {pool} ({MANIFEST_FILE} is missing): export one with `make export`"
        )
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists: remove it or choose another --out")
    model = load_causal_lm(str(llm), dtype, "cpu")
    wide = widen_llm(model, shape)
    # written beside OUT and renamed when complete: a killed run leaves no half-written OUT, and the
    # next run clears what it left (a stand-in can be gigabytes)
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    wide.save_pretrained(staging / "llm")
    load_tokenizer(str(llm)).save_pretrained(staging / "llm")
    shutil.copytree(pool, staging / "pool")
    manifest = json.loads((pool / MANIFEST_FILE).read_text())
    if manifest.get("predictor"):
        folder = staging / "pool" / manifest["predictor"].get("path", PREDICTOR_DIR)
        predictor = MatchLengthPredictor.from_pretrained(folder)
        widen_predictor(predictor, shape.hidden_size).save_pretrained(folder)
    if manifest.get("hardware_profile"):
        empty = json.dumps({"format_version": FORMAT_VERSION, "profiles": {}}, indent=2)
        (staging / "pool" / manifest["hardware_profile"]["path"]).write_text(empty + "\n")
    os.replace(staging, out)
    return out / "llm", out / "pool"


def _check_shape(config: PretrainedConfig, shape: StandinShape) -> None:
    if config.model_type not in WIDENABLE:
        raise ValueError(
            f"a cost stand-in widens Llama-layout models ({', '.join(sorted(WIDENABLE))}), "
            f"not {config.model_type!r}: train the reference LLM with one of those"
        )
    d = config.hidden_size
    problems = []
    if shape.hidden_size < d or shape.hidden_size % d:
        problems.append(f"hidden_size must be a multiple of the LLM's {d}, got {shape.hidden_size}")
    if shape.intermediate_size < config.intermediate_size:
        problems.append(f"intermediate_size must be at least the LLM's {config.intermediate_size}")
    if shape.num_hidden_layers < config.num_hidden_layers:
        problems.append(f"num_hidden_layers must be at least the LLM's {config.num_hidden_layers}")
    if problems:
        raise ValueError("; ".join(problems))


def _embedded(
    source: torch.Tensor | None, shape: torch.Size, fill: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A tensor of `shape` filled with `fill`, with `source` (if any) in its leading corner."""
    tensor = torch.full(shape, fill, dtype=dtype, device=device)
    if source is not None:
        tensor[tuple(slice(0, n) for n in source.shape)] = source
    return tensor


def _copy_buffers(model: PreTrainedModel, wide: PreTrainedModel) -> None:
    """Non-persistent buffers (the rotary embedding's frequencies: the head size is unchanged) are
    not in a state dict: the stand-in takes the LLM's."""
    buffers = dict(model.named_buffers())
    for name, buffer in list(wide.named_buffers()):
        if buffer.is_meta:
            module, _, attribute = name.rpartition(".")
            if name not in buffers:
                raise ValueError(f"cannot widen {type(model).__name__}: no source for its buffer {name}")
            wide.get_submodule(module).register_buffer(attribute, buffers[name].clone(), persistent=False)
