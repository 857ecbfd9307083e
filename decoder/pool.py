"""`SSMPool`: a pool of SSMs exported by `python -m specboost.training.export`, loaded in one call.

    pool = SSMPool.from_pretrained("artifacts/pool-export")  # or a hub id, "org/name"
    pool.check_llm(llm, tokenizer)
    decoder = SpeculativeDecoder(llm, ssms=pool, tokenizer=tokenizer)

An exported pool folder holds `specboost_pool.json` (the manifest: the LLM the pool was trained
for, the SSM subfolders, their voting weights) and one `save_pretrained` folder per SSM, each with
the LLM's tokenizer; optionally the learned scheduler's predictor, the hardware profile and the
SSMs' Sequoia acceptance vectors, which the manifest names.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import snapshot_download
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specboost.decoder.validation import model_name, output_vocab_size
from specboost.speculator.cost_model import CostModel, device_key, load_cost_model
from specboost.speculator.loading import LoadError, load_causal_lm, load_tokenizer
from specboost.speculator.predictor import MatchLengthPredictor
from specboost.speculator.sampling import SamplingConfig
from specboost.speculator.sequoia_acceptance import AcceptanceVector, load_acceptance_file

logger = logging.getLogger(__name__)

MANIFEST_FILE = "specboost_pool.json"
FORMAT_VERSION = 1  # bump when the manifest changes incompatibly


def tokenizer_vocab_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of the token -> id table: equal hashes mean the same vocabulary."""
    table = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(table.encode()).hexdigest()


def _local_folder(location: str | Path) -> Path:
    """A local pool folder, or a hub snapshot of one (`snapshot_download`, cached)."""
    text = str(location)
    path = Path(text).expanduser()
    if path.exists() or text.startswith((".", "~", "/")) or text.count("/") != 1:
        if not path.is_dir():
            raise FileNotFoundError(
                f"no SSM pool at {text} (the folder does not exist); give a folder written by "
                "`python -m specboost.training.export` (`make export`) or a hub id 'org/name'"
            )
        return path
    try:
        return Path(snapshot_download(text))
    except Exception as error:  # offline, unknown repo, no access: all say the same to a user
        raise LoadError(
            f"could not download the SSM pool {text!r} from the Hugging Face Hub ({type(error).__name__}: "
            f"{error}); check the id and your connection (HF_HUB_OFFLINE=1 forbids downloads), "
            "or give a local folder"
        ) from error


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder} is not an exported SSM pool ({MANIFEST_FILE} is missing); "
            "export one with `python -m specboost.training.export --boost BOOST_DIR --out OUT`"
        )
    manifest = json.loads(path.read_text())
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{path} has format_version {version!r}; this specboost reads version {FORMAT_VERSION}: "
            "re-export the pool or upgrade specboost"
        )
    return manifest


@dataclass
class SSMPool:
    """The SSMs of one pool, their shared tokenizer (the LLM's), the manifest and voting weights."""

    models: list[PreTrainedModel]
    tokenizer: PreTrainedTokenizerBase | None
    manifest: dict[str, Any]
    weights: list[float]  # initial voting weights, one per SSM (ALGORITHMS.md section 6)
    predictor: MatchLengthPredictor | None = None  # the learned scheduler's (ALGORITHMS.md section 5)
    folder: Path | None = None
    acceptance: list[AcceptanceVector] | None = None  # per SSM, for Sequoia trees (ALGORITHMS.md 8)

    def __post_init__(self) -> None:
        if len(self.weights) != len(self.models):
            raise ValueError(f"{len(self.weights)} weights for {len(self.models)} SSMs: give one per SSM")
        if self.acceptance is not None and len(self.acceptance) != len(self.models):
            raise ValueError(
                f"{len(self.acceptance)} acceptance vectors for {len(self.models)} SSMs: measure one per "
                "SSM (`make sequoia-acceptance`) and export again"
            )

    def __len__(self) -> int:
        return len(self.models)

    @property
    def target_temperature(self) -> float | None:
        """The temperature the SSMs were fitted to the LLM's distributions at (the manifest's
        `target_temperature`, ALGORITHMS.md section 15); None for a pool trained on greedy text."""
        value = self.manifest.get("target_temperature")
        return None if value is None else float(value)

    def __iter__(self) -> Iterator[PreTrainedModel]:
        return iter(self.models)

    @classmethod
    def from_pretrained(
        cls,
        folder_or_repo_id: str | Path,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
    ) -> SSMPool:
        """Load the manifest and every SSM of an exported pool (local folder or hub id)."""
        folder = _local_folder(folder_or_repo_id)
        manifest = read_manifest(folder)
        models = []
        for entry in manifest["ssms"]:
            ssm_dir = folder / entry["path"]
            if not (ssm_dir / "config.json").is_file():
                raise FileNotFoundError(
                    f"the pool {folder} lists SSM {entry['path']!r} but {ssm_dir} holds no model "
                    "(config.json is missing); re-export or re-download the pool"
                )
            models.append(load_causal_lm(ssm_dir, dtype, device))
        first = folder / manifest["ssms"][0]["path"] if manifest["ssms"] else None
        tokenizer = load_tokenizer(first) if first is not None else None
        weights = [float(w) for w in manifest.get("weights") or [1.0 / len(models)] * len(models)]
        predictor = None
        if manifest.get("predictor"):
            predictor = MatchLengthPredictor.from_pretrained(folder / manifest["predictor"]["path"])
        acceptance = None
        if manifest.get("sequoia_acceptance"):
            acceptance = load_acceptance_file(folder / manifest["sequoia_acceptance"]["path"])
        return cls(models, tokenizer, manifest, weights, predictor, folder, acceptance)

    def cost_model(
        self, device: torch.device | str, dtype: torch.dtype, force: bool = False
    ) -> CostModel | None:
        """The pool's hardware profile for this device and dtype (None when the pool has none);
        a profile of other hardware raises unless `force` (see `load_cost_model`)."""
        entry = self.manifest.get("hardware_profile")
        if not entry or self.folder is None:
            return None
        return load_cost_model(self.folder / entry["path"], device_key(device, dtype), force)

    def check_llm(self, llm: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        """Raise a ValueError when `llm` (and `tokenizer`) is not the LLM the pool was trained for."""
        expected = self.manifest["llm"]
        name = expected.get("name_or_path")
        actual = output_vocab_size(llm)
        if actual != expected["vocab_size"]:
            raise ValueError(
                f"vocabulary mismatch: the SSM pool was trained for the LLM {name} ({expected['vocab_size']} "
                f"tokens) but {model_name(llm)} predicts {actual}; use the pool with that LLM"
            )
        if tokenizer is not None and expected.get("tokenizer_vocab_hash") is not None:
            actual_hash = tokenizer_vocab_hash(tokenizer)
            if actual_hash != expected["tokenizer_vocab_hash"]:
                raise ValueError(
                    f"tokenizer mismatch: the SSM pool was trained for the tokenizer of the LLM {name} "
                    f"(vocab hash {expected['tokenizer_vocab_hash']}) but the given tokenizer of "
                    f"{model_name(llm)} has vocab hash {actual_hash}; use the LLM's own tokenizer"
                )


@dataclass
class TemperatureNotice:
    """Warns once when sampling runs at another temperature than the pool's SSMs were fitted at:
    still lossless, but their q then matches a different p, so fewer drafts are accepted."""

    target: float | None  # the pool's target_temperature (None: no notice)
    given: bool = False

    def check(self, sampling: SamplingConfig) -> None:
        if self.given or self.target is None or not sampling.do_sample:
            return
        if abs(sampling.temperature - self.target) > 1e-6:
            self.given = True
            logger.warning(
                "sampling at temperature %g, but this pool's SSMs were distilled at temperature %g "
                "(its target_temperature): the output stays lossless, acceptance may be lower",
                sampling.temperature,
                self.target,
            )
