"""Loading models, tokenizers and configs by folder or hub id, and choosing a device, with errors
that say what to do (a `ValueError` subclass, which every command reports as `error: ...`, exit 2);
`load_models` loads an LLM and its SSMs from `save_pretrained` folders in one call.

Every command of the project loads through here, so a bare name that is no folder and cannot
be fetched, a truncated or corrupt checkpoint, an unknown device or a device this torch build
cannot use all end in one clear line instead of a traceback.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from specboost.speculator.model_info import check_model_location

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class LoadError(ValueError):
    """A model, tokenizer or device that cannot be used, with what to do about it."""


def resolve_device(name: str | torch.device | None) -> torch.device:
    """`name` as a torch device this machine can use; LoadError otherwise (None: the CPU)."""
    if name is None:
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise LoadError(f"unknown device {str(name)!r}: use cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise LoadError(f"device {str(name)!r} is not available ({why}): use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise LoadError(
                f"device {str(name)!r} does not exist: this machine has {torch.cuda.device_count()} CUDA "
                "device(s), cuda:0 .. cuda:N-1"
            )
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise LoadError(f"device {str(name)!r} is not available on this machine: use --device cpu")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise LoadError(f"device {str(name)!r} is not supported: use cpu, cuda, cuda:N or mps")
    return device


def _fetch(what: str, location: str | Path, load: Any, **kwargs: Any) -> Any:
    """`load(location, **kwargs)`, with the errors a user can cause turned into a LoadError."""
    source = check_model_location(location)
    try:
        return load(source, **kwargs)
    except (SafetensorError, pickle.UnpicklingError, EOFError) as error:
        files = ", ".join(sorted(p.name for p in Path(source).glob("*.safetensors"))) or "its weight files"
        raise LoadError(
            f"the {what} at {source} could not be read ({type(error).__name__}: {error}): {files} may be "
            "truncated or corrupt; copy, download or save the checkpoint again"
        ) from None
    except OSError as error:
        local = Path(source).exists()
        hint = (
            "the folder is incomplete; save it again with save_pretrained"
            if local
            else "it is neither a local folder nor reachable on the Hugging Face Hub (offline?); give the "
            "folder written by save_pretrained"
        )
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise LoadError(f"cannot load the {what} {str(location)!r}: {hint} ({first_line})") from None


def load_causal_lm(
    location: str | Path,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
) -> PreTrainedModel:
    """A causal LM from a save_pretrained folder or hub id, in eval mode, on `device`."""
    target = resolve_device(device) if device is not None else None
    kwargs = {} if dtype is None else {"dtype": dtype}
    model = _fetch("model", location, AutoModelForCausalLM.from_pretrained, **kwargs)
    return (model if target is None else model.to(target)).eval()


def load_tokenizer(location: str | Path) -> PreTrainedTokenizerBase:
    return _fetch("tokenizer", location, AutoTokenizer.from_pretrained)


def load_config(location: str | Path) -> PretrainedConfig:
    return _fetch("model config", location, AutoConfig.from_pretrained)


def check_model_path(path: str | Path) -> Path:
    """A folder written by `save_pretrained`, or a FileNotFoundError that says what is missing."""
    path = Path(path)
    if not (path / "config.json").is_file():
        what = "config.json is missing" if path.is_dir() else "the folder does not exist"
        raise FileNotFoundError(
            f"no model found at {path} ({what}); give a folder written by save_pretrained, "
            "e.g. one built by `python -m specboost.decoder.tiny_models --out DIR`"
        )
    return path


def has_tokenizer(path: Path) -> bool:
    return any(
        (path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )


@dataclass
class LoadedModels:
    llm: PreTrainedModel
    ssms: list[PreTrainedModel]
    tokenizer: PreTrainedTokenizerBase
    ssm_tokenizers: list[PreTrainedTokenizerBase | None]  # each SSM folder's own, where it has one


def load_models(
    llm_path: str | Path,
    ssm_paths: list[str] | list[Path],
    tokenizer_path: str | Path | None = None,
    dtype: str = "float32",
    device: str = "cpu",
) -> LoadedModels:
    """Load the LLM, the SSMs and the tokenizer (from `tokenizer_path`, else the LLM folder) from disk."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if not ssm_paths:
        raise ValueError("give at least one SSM")
    llm_dir, ssm_dirs = check_model_path(llm_path), [check_model_path(p) for p in ssm_paths]
    tok_dir = Path(tokenizer_path) if tokenizer_path is not None else llm_dir
    if not has_tokenizer(tok_dir):
        raise FileNotFoundError(
            f"no tokenizer found at {tok_dir}; pass the tokenizer's folder with --tokenizer"
        )
    target = resolve_device(device)  # before anything loads
    return LoadedModels(
        llm=load_causal_lm(llm_dir, DTYPES[dtype], target),
        ssms=[load_causal_lm(p, DTYPES[dtype], target) for p in ssm_dirs],
        tokenizer=load_tokenizer(tok_dir),
        ssm_tokenizers=[load_tokenizer(p) if has_tokenizer(p) else None for p in ssm_dirs],
    )
