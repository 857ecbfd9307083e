"""`SSMPool`: a pool of SSMs exported by `python -m specboost.training.export`, loaded in one call.

    pool = SSMPool.from_pretrained("artifacts/pool-export")  # or a hub id, "org/name"
    pool.check_llm(llm, tokenizer)
    decoder = SpeculativeDecoder(llm, ssms=pool, tokenizer=tokenizer)
    # or in one call, with the manifest's decoding choices as defaults:
    decoder = SpeculativeDecoder.from_pretrained(llm, "artifacts/pool-export")

An exported pool folder holds `specboost_pool.json` (the manifest: the LLM the pool was trained
for, the SSM subfolders, their voting weights, the decoding choices it recommends (`PoolDefaults`))
and one `save_pretrained` folder per SSM, each with the LLM's tokenizer; optionally the learned
scheduler's predictor, the hardware profile and the SSMs' Sequoia acceptance vectors, which the
manifest names.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, TypeVar

import torch
from huggingface_hub import snapshot_download
from safetensors import SafetensorError
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specboost.decoder.validation import check_shape, model_name, output_vocab_size
from specboost.speculator.cost_model import CostModel, device_key, load_cost_model
from specboost.speculator.length_control import CONTROLLERS
from specboost.speculator.loading import LoadError, load_causal_lm, load_tokenizer, resolve_device
from specboost.speculator.predictor import MatchLengthPredictor
from specboost.speculator.sampling import SamplingConfig
from specboost.speculator.sequoia_acceptance import AcceptanceVector, load_acceptance_file
from specboost.speculator.shapes import BeamShape, ChainShape, DraftShape, TopologyShape

logger = logging.getLogger(__name__)

MANIFEST_FILE = "specboost_pool.json"
FORMAT_VERSION = 1  # bump when the manifest changes incompatibly
SHAPE_KINDS: dict[str, type[DraftShape]] = {"chain": ChainShape, "beam": BeamShape, "topology": TopologyShape}
T = TypeVar("T")


OWN_TREE = ("sequoia", "plain")  # strategies that take no draft shape: Sequoia's own tree, or none
FIXED_SHAPE_OPTIONS = ("shape", "length_controller")  # given over a learned default: strategy "pool"


@dataclass(frozen=True)
class PoolDefaults:
    """The decoding choices a pool recommends: its manifest's "decoding" block, the defaults of
    `SpeculativeDecoder.from_pretrained` and `specboost generate --pool`. A manifest without the
    block (exported before it existed) gives the decoder's own defaults.

    There is no verification rule among them: a decoder's rule is fixed when it is built, a
    sampling rule refuses greedy calls and "greedy" refuses sampled ones, so the rule is left to
    each call (rule=None picks it from do_sample and the tree kind). Which strategy takes which
    shape is `strategies.check_inputs`'s to say; that module imports this one, so the export and
    the decoder run it, not this class."""

    strategy: str = "pool"
    shape: DraftShape | None = None  # None: a chain of 4 (the decoder's default); OWN_TREE: none
    length_controller: str | None = None  # "minions" | "bass" | None: a fixed length

    def __post_init__(self) -> None:
        if self.shape is None and self.strategy not in OWN_TREE:  # written out, so that the manifest says it
            object.__setattr__(self, "shape", ChainShape())
        check_shape(self.shape)
        controller = self.length_controller
        if controller is not None and controller not in CONTROLLERS:
            raise ValueError(
                f"length_controller must be one of {sorted(CONTROLLERS)} or None, got {controller!r}"
            )
        if controller is not None and not isinstance(self.shape, ChainShape):
            raise ValueError(f"a length controller sets chain lengths; use a chain shape, not {self.shape!r}")

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any]) -> PoolDefaults:
        """The manifest's "decoding" block; keys it does not know are ignored (a newer specboost
        may recommend more; `read_manifest` warns about them)."""
        block = manifest.get("decoding")
        if block is None:
            return cls()
        shape = block.get("shape")
        return cls(
            block.get("strategy", "pool"),
            None if shape is None else _shape_from_json(shape),
            block.get("length_controller"),
        )

    def to_manifest(self) -> dict[str, Any]:
        """The "decoding" block `from_manifest` reads, e.g. {"strategy": "pool", "shape":
        {"kind": "chain", "length": 4, "samples": 1}, "length_controller": null}."""
        shape = None
        if self.shape is not None:
            kind = next(name for name, cls in SHAPE_KINDS.items() if isinstance(self.shape, cls))
            shape = {"kind": kind, **asdict(self.shape)}
        return {"strategy": self.strategy, "shape": shape, "length_controller": self.length_controller}

    def decoder_options(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """`SpeculativeDecoder`'s keywords: `overrides` over these defaults. An explicit strategy=
        or speculator= replaces all of them: the shape and length controller were chosen for this
        strategy, and another may refuse them. Over "learned", which drafts no fixed shape (its
        shape is only the fallback without a predictor), a shape= or length_controller= given
        without strategy= asks for a fixed shape: strategy "pool" with what is given."""
        if "strategy" in overrides or "speculator" in overrides:
            return dict(overrides)
        if self.strategy == "learned" and any(overrides.get(k) is not None for k in FIXED_SHAPE_OPTIONS):
            logger.info(
                "a shape or length controller given over the pool's learned scheduler: strategy 'pool'"
            )
            return {"strategy": "pool"} | dict(overrides)
        chosen = {"strategy": self.strategy, "shape": self.shape, "length_controller": self.length_controller}
        return chosen | dict(overrides)


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


def _shape_from_json(entry: Mapping[str, Any]) -> DraftShape:
    """{"kind": "chain", "length": 4, "samples": 1} -> ChainShape(4); lists become tuples (parents)."""
    kind = SHAPE_KINDS.get(entry.get("kind"))
    if kind is None:
        raise ValueError(f"shape kind must be one of {sorted(SHAPE_KINDS)}, got {entry.get('kind')!r}")
    params = {k: tuple(v) if isinstance(v, list) else v for k, v in entry.items() if k != "kind"}
    names = {f.name for f in fields(kind)}
    if not set(params) <= names:
        raise ValueError(f"a {entry['kind']} shape takes {sorted(names)}, got {sorted(params)}")
    return kind(**params)


def _not_a_pool(folder: Path) -> str:
    """What a folder without a manifest is instead, and what to do."""
    if (folder / "config.json").is_file():
        return "it holds one model: pass model folders as SSMs (`--ssm` on the command line)"
    if any(folder.glob("*/config.json")):
        return (
            "it holds model folders, e.g. a boost run: export it first with "
            f"`python -m specboost.training.export --boost {folder} --out OUT`"
        )
    return "export one with `python -m specboost.training.export --boost BOOST_DIR --out OUT`"


def _repair_hint(location: str | Path, folder: Path) -> str:
    """How to get a damaged pool whole again: download a hub pool again, export a local one again."""
    if folder != Path(str(location)).expanduser():  # a hub snapshot
        return f"download it again (`hf download {location} --force-download`)"
    return (
        f"export it again (`python -m specboost.training.export --boost BOOST_DIR --out {folder}`) "
        "or download it again"
    )


def _read_part(path: Path, hint: str, load: Callable[[], T]) -> T:
    """`load()`, with a file of the pool that cannot be read reported as a LoadError naming it
    (a LoadError of the loading helpers names it already) and how to repair the pool."""
    try:
        return load()
    except (OSError, ValueError, SafetensorError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        what = first_line if isinstance(error, LoadError) else f"{path} cannot be read ({first_line})"
        raise LoadError(f"the SSM pool is damaged: {what}. Repair the pool: {hint}") from None


def read_manifest(folder: Path, hint: str = "export or download it again") -> dict[str, Any]:
    """The manifest, its format version and decoding block checked (`hint`: how to repair the pool)."""
    path = folder / MANIFEST_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder} is not an exported SSM pool ({MANIFEST_FILE} is missing); {_not_a_pool(folder)}"
        )
    manifest = _read_part(path, hint, lambda: json.loads(path.read_text()))
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{path} has format_version {version!r}; this specboost reads version {FORMAT_VERSION}: "
            "re-export the pool or upgrade specboost"
        )
    try:
        defaults = PoolDefaults.from_manifest(manifest)
    except (ValueError, TypeError, AttributeError) as error:
        raise ValueError(
            f'{path}: the "decoding" block is invalid ({error}). Repair the pool: {hint}'
        ) from None
    if unknown := sorted(set(manifest.get("decoding") or {}) - set(defaults.to_manifest())):
        logger.warning("%s: ignoring the decoding choices %s (unknown to this specboost)", path, unknown)
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
    def defaults(self) -> PoolDefaults:
        """The decoding choices the manifest recommends (the decoder's defaults if it has none)."""
        return PoolDefaults.from_manifest(self.manifest)

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
        """Load the manifest and every SSM of an exported pool (local folder or hub id). A file of
        the pool that is missing, truncated or corrupt raises a LoadError that names it and says
        how to repair the pool (export or download it again)."""
        target = None if device is None else resolve_device(device)  # a bad device is no damaged pool
        folder = _local_folder(folder_or_repo_id)
        hint = _repair_hint(folder_or_repo_id, folder)
        manifest = read_manifest(folder, hint)
        models = []
        for entry in manifest["ssms"]:
            ssm_dir = folder / entry["path"]
            if not (ssm_dir / "config.json").is_file():
                raise FileNotFoundError(
                    f"the pool {folder} lists SSM {entry['path']!r} but {ssm_dir} holds no model "
                    f"(config.json is missing). Repair the pool: {hint}"
                )
            models.append(_read_part(ssm_dir, hint, lambda d=ssm_dir: load_causal_lm(d, dtype, target)))
        first = folder / manifest["ssms"][0]["path"] if manifest["ssms"] else None
        tokenizer = _read_part(first, hint, lambda: load_tokenizer(first)) if first is not None else None
        weights = [float(w) for w in manifest.get("weights") or [1.0 / len(models)] * len(models)]
        predictor = None
        if manifest.get("predictor"):
            path = folder / manifest["predictor"]["path"]
            predictor = _read_part(path, hint, lambda: MatchLengthPredictor.from_pretrained(path))
        acceptance = None
        if manifest.get("sequoia_acceptance"):
            path = folder / manifest["sequoia_acceptance"]["path"]
            acceptance = _read_part(path, hint, lambda: load_acceptance_file(path))
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

    def for_recommended_learned(self, device: torch.device | str, dtype: torch.dtype) -> SSMPool:
        """The pool the learned scheduler decodes with when the pool recommends it (its defaults,
        not an explicit strategy="learned"): this pool, or, when its hardware profile holds no
        latencies for this device and dtype (other hardware, or another CPU thread count), a copy
        without the profile, so that the scheduler measures this machine's (with a warning), as
        for a pool without one, where an explicit strategy="learned" refuses a foreign profile."""
        entry = self.manifest.get("hardware_profile")
        if not entry or self.folder is None:
            return self
        path = self.folder / entry["path"]
        try:
            measured = list(json.loads(path.read_text())["profiles"])
        except (OSError, ValueError, KeyError, TypeError):
            return self  # damaged: loading it says so
        key = device_key(device, dtype)
        if key in measured:
            return self
        logger.warning(
            "the pool's hardware profile %s holds latencies measured on %s, not on this machine (%s): "
            "the learned scheduler the pool recommends measures them here instead. To skip that, run with "
            "the thread count it was measured at (torch.set_num_threads, --threads), add this machine's "
            "(`specboost profile --llm LLM --ssm %s/ssm-* --out %s`), or use the pool's "
            "(force_profile=True, --force-profile)",
            path,
            ", ".join(measured) or "no device",
            key,
            self.folder,
            path,
        )
        return replace(self, manifest={**self.manifest, "hardware_profile": None})

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
                    f"tokenizer mismatch: the SSM pool was exported for the tokenizer of the LLM {name} "
                    f"(vocab hash {expected['tokenizer_vocab_hash']}) but the tokenizer given with "
                    f"{model_name(llm)} has vocab hash {actual_hash}; use the pool with the LLM and "
                    "tokenizer it was trained for, or train and export a pool for this one"
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
