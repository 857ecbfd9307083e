"""Export a boost-tuned SSM pool as a hub-style folder, and optionally push it to the Hub.

    python -m specboost.training.export --boost artifacts/pool --out artifacts/pool-export \\
        [--hub-repo ORG/NAME]   # or HUB_REPO=ORG/NAME; needs `hf auth login` (or HF_TOKEN)
        [--strategy pool|learned|majority|pruned|sequoia] [--chain-length L | --beam W D]
        [--length-controller minions|bass]   # the pool's decoding defaults

BOOST is the folder `specboost.training.boost` writes: `ssm-0/`, `ssm-1/`... (save_pretrained
folders with the LLM's tokenizer) and `boost_record.json`. OUT gets:

- `ssm-i/`: the SSM (safetensors, config, tokenizer) and a README.md model card stating the base
  model, the training data, the boost round and the measured held-out acceptance;
- `specboost_pool.json`: the manifest `SSMPool.from_pretrained` reads (the LLM the pool was
  trained for with its vocabulary size and tokenizer vocab hash, the SSMs, initial voting
  weights, and the predictor / hardware profile / Sequoia acceptance vectors when BOOST holds
  them), and how the pool was built: `boost_mode` ("greedy" marking or "sampled" acceptance
  weights), `loss` ("ce", "kl", "tv" or "mix") and `target_temperature` (the temperature of the
  LLM distributions it was trained on; null for CE on the LLM's tokens). Boost runs from before
  these fields were recorded were greedy CE runs and are exported as such. Its `decoding` block
  holds the decoding choices `SpeculativeDecoder.from_pretrained` and `specboost generate --pool`
  default to (`PoolDefaults`: strategy, shape, length controller), set by the options above.
  Unset, they are the learned scheduler's ("learned") when BOOST holds a match-length predictor
  and a hardware profile, else strategy "pool" with chains of 4 (the decoder's own defaults; a
  shape or length controller given without --strategy also means "pool"); the export says which
  and why. A strategy that needs a file BOOST lacks (learned: the predictor; sequoia: acceptance
  vectors and a hardware profile) is refused, naming the command that makes it;
- `README.md`: the pool's card.

OUT is written next to itself under a temporary name and renamed into place, so it exists only
complete; an earlier export at OUT is replaced, any other non-empty folder is refused.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import huggingface_hub
import torch
import transformers
from huggingface_hub import HfApi, get_token
from transformers import PreTrainedTokenizerBase

from specboost.decoder.pool import FORMAT_VERSION, MANIFEST_FILE, PoolDefaults, tokenizer_vocab_hash
from specboost.decoder.strategies import DRAFTING, StrategyInputs, check_inputs
from specboost.speculator.cost_model import PROFILE_FILE
from specboost.speculator.length_control import CONTROLLERS
from specboost.speculator.loading import load_causal_lm, load_config, load_tokenizer
from specboost.speculator.model_info import output_vocab_size
from specboost.speculator.predictor import PREDICTOR_DIR
from specboost.speculator.sequoia_acceptance import ACCEPTANCE_FILE
from specboost.speculator.shapes import BeamShape, ChainShape

RECORD_FILE = "boost_record.json"
README_FILE = "README.md"
# Optional strategy files copied into the export when BOOST holds them (first name found wins);
# the manifest names each under its key ({"path": name}, or None).
OPTIONAL_ENTRIES = {
    "predictor": (PREDICTOR_DIR,),
    "hardware_profile": (PROFILE_FILE,),
    "sequoia_acceptance": (ACCEPTANCE_FILE,),
}
# The optional entries a strategy needs to decode as a pool's default, and what makes each in BOOST.
NEEDED_ENTRIES = {"learned": ("predictor",), "sequoia": ("sequoia_acceptance", "hardware_profile")}
MAKERS = {  # entry -> (what it is, the command that writes it into BOOST)
    "predictor": (
        "the learned scheduler's match-length predictor",
        "make predictor-data predictor SCHED_POOL=",
    ),
    "sequoia_acceptance": ("the SSMs' Sequoia acceptance vectors", "make sequoia-acceptance BOOST_OUT="),
    "hardware_profile": ("a hardware profile (it sizes the tree)", "make profile SCHED_POOL="),
}
# What the learned scheduler needs to be a pool's default when no strategy is given: it decodes
# with the predictor as trained and with latencies measured on real hardware.
LEARNED_DEFAULT_NEEDS = ("predictor", "hardware_profile")
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LLMInfo:
    name_or_path: str  # as boost_record.json names it
    vocab_size: int  # rows of the output embedding: what the SSMs must predict
    tokenizer_vocab_hash: str  # `tokenizer_vocab_hash` of the LLM's tokenizer
    training_data: str  # one sentence: what the SSMs were distilled on


# ---------------------------------------------------------------- setup: record, LLM, training data


def read_record(boost: Path) -> dict[str, Any]:
    path = boost / RECORD_FILE
    if not path.is_file():
        what = "the folder does not exist" if not boost.is_dir() else f"{RECORD_FILE} is missing"
        raise FileNotFoundError(
            f"no boost run at {boost} ({what}); give the --out folder of `python -m specboost.training.boost`"
        )
    record = json.loads(path.read_text())
    if not record.get("rounds"):
        raise ValueError(f"{path} lists no boost rounds: the boost run has not finished an SSM yet")
    return record


def describe_training_data(record: dict[str, Any]) -> str:
    """'distilled from LLM on the PROMPTS prompt set', from the distillation run's metadata.json."""
    distilled = record.get("distilled")
    try:
        metadata = json.loads((Path(distilled) / "metadata.json").read_text())
        prompts = metadata["config"]["prompts"]
        kept = metadata["counts"]["kept"]
    except (TypeError, OSError, ValueError, KeyError):
        return f"continuations generated by the LLM `{record['llm']}` (distillation data `{distilled}`)"
    return (
        f"continuations generated by the LLM `{record['llm']}` for the train split of the `{prompts}` "
        f"prompt set ({kept} distilled samples, `{distilled}`)"
    )


def describe_llm(record: dict[str, Any], boost: Path) -> LLMInfo:
    """The LLM's vocabulary; every SSM must share it. The LLM's own tokenizer when its folder is
    here, else the one saved with the first SSM (boost saves the LLM's tokenizer with every SSM)."""
    llm = str(record["llm"])
    ssm_dirs = [boost / entry["path"] for entry in record["rounds"]]
    llm_local = (Path(llm) / "config.json").is_file()
    tokenizer = load_tokenizer(llm if llm_local else ssm_dirs[0])
    vocab_hash = tokenizer_vocab_hash(tokenizer)
    for ssm_dir in ssm_dirs:
        if tokenizer_vocab_hash(load_tokenizer(ssm_dir)) != vocab_hash:
            raise ValueError(
                f"the tokenizer in {ssm_dir} differs from the LLM {llm}'s: the pool is inconsistent"
            )
    config = load_config(llm if llm_local else ssm_dirs[0]).get_text_config()
    return LLMInfo(llm, int(config.vocab_size), vocab_hash, describe_training_data(record))


# ---------------------------------------------------------------- model cards


def _front_matter(base: str | None) -> str:
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation", "tags:"]
    lines += ["- speculative-decoding", "- specboost"]
    if base and _HUB_ID.match(base) and not Path(base).exists():  # a local path is no hub model
        lines.append(f"base_model: {base}")
    return "\n".join([*lines, "---", ""])


def describe_decoding(defaults: PoolDefaults) -> str:
    """The decoding defaults in words, for the cards."""
    shape = "its own DP-optimal tree" if defaults.shape is None else f"`{defaults.shape!r}`"
    if defaults.strategy == "learned":
        shape = (
            "plain decoding or one SSM's chain, the SSM and length picked every step "
            f"(`{defaults.shape!r}` without the predictor)"
        )
    controller = defaults.length_controller or "none (fixed length)"
    return f"strategy `{defaults.strategy}`, shape {shape}, length controller {controller}"


def _usage(location: str, llm: str, subfolder: str, defaults: PoolDefaults) -> str:
    return f"""## How to use

With specboost (lossless: greedy output equals `llm.generate`'s):

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
from specboost.decoder import SpeculativeDecoder

llm = AutoModelForCausalLM.from_pretrained("{llm}")
tokenizer = AutoTokenizer.from_pretrained("{llm}")
decoder = SpeculativeDecoder.from_pretrained(llm, "{location}", tokenizer)  # checks the LLM and tokenizer
ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
print(tokenizer.decode(decoder.generate(ids, max_new_tokens=64).sequences[0]))
```

Decoding defaults (the `decoding` block of `{MANIFEST_FILE}`): {describe_decoding(defaults)}. Any
keyword of `SpeculativeDecoder` overrides them, e.g. `from_pretrained(llm, "{location}", tokenizer,
shape=ChainShape(6))`; an explicit `strategy=` replaces them all, e.g. `strategy="pool",
shape=ChainShape(4)` for a fixed chain of 4. On the command line: `specboost generate --llm LLM_DIR
--pool {location} --prompt "..."` (`--strategy pool --length 4`: a fixed chain).

As a Hugging Face assistant model (assisted generation, one SSM):

```python
assistant = AutoModelForCausalLM.from_pretrained("{location}", subfolder="{subfolder}")
out = llm.generate(ids, assistant_model=assistant, max_new_tokens=64)
```
"""


def build_info(record: dict[str, Any]) -> dict[str, Any]:
    """boost_mode, loss and target_temperature of the run (a record without them: greedy CE)."""
    return {
        "boost_mode": record.get("boost_mode") or "greedy",
        "loss": record.get("loss") or "ce",
        "target_temperature": record.get("target_temperature"),
    }


def describe_training(record: dict[str, Any]) -> str:
    """One sentence: the loss and what it was computed against."""
    info = build_info(record)
    if info["loss"] == "ce":
        return "cross-entropy on the LLM's output tokens"
    against = f"the LLM's stored top-K next-token distributions at temperature {info['target_temperature']}"
    loss = {
        "kl": "forward KL(p || q)",
        "tv": "total variation TV(p, q)",
        "mix": f"cross-entropy + {record.get('mix_weight')} x KL(p || q)",
    }.get(info["loss"], info["loss"])
    return f"{loss} against {against} (tail as one bucket)"


def _round_line(entry: dict[str, Any], index: int, record: dict[str, Any]) -> str:
    rounds = len(record["rounds"])
    done = f"({entry.get('steps')} steps, final loss {_number(entry.get('final_loss'), 4)})"
    if build_info(record)["boost_mode"] == "sampled":
        return (
            f"{index + 1} of {rounds}; trained on {entry.get('train_samples')} samples {done}, each "
            "position weighted by how often the earlier SSMs' sampled drafts are rejected there "
            "(sampled boost mode); pool acceptance on the training data after this round "
            f"{_number(entry.get('train_pool_sampled_acceptance'), 3)}"
        )
    return (
        f"{index + 1} of {rounds}; trained on {entry.get('train_samples')} samples left by earlier\n"
        f"  rounds {done}, then marked\n"
        f"  {entry.get('marked')} {record.get('marked_unit', 'samples')} it reproduces "
        f"({record.get('marking')} marking)"
    )


def _sampled_note(entry: dict[str, Any]) -> str:
    return (
        "; sampled: one draft token's acceptance"
        if entry.get("held_out_sampled_acceptance") is not None
        else ""
    )


def _sampled_rows(entry: dict[str, Any], record: dict[str, Any]) -> str:
    if entry.get("held_out_sampled_acceptance") is None:
        return ""
    at = f"T = {record.get('sampled_scoring_temperature')}"
    alone, pool = entry.get("held_out_sampled_acceptance"), entry.get("pool_sampled_acceptance")
    return (
        f"| held-out sampled acceptance, 1 - TV ({at}) | {_number(alone, 3)} |\n"
        f"| pool sampled acceptance after this round | {_number(pool, 3)} |\n"
    )


def ssm_card(
    entry: dict[str, Any],
    index: int,
    record: dict[str, Any],
    llm: LLMInfo,
    location: str,
    defaults: PoolDefaults,
) -> str:
    """README.md of one SSM: what it is, what it was trained on, how well it drafts."""
    rounds, held_out = len(record["rounds"]), len(record.get("held_out_ids") or [])
    return f"""{_front_matter(record.get("base"))}
# SSM {entry["ssm"]} of a specboost pool for `{llm.name_or_path}`

A small speculative model (SSM) that drafts tokens for the LLM `{llm.name_or_path}` in lossless
speculative decoding; one of {rounds} SSMs boost-tuned together (SpecInfer's collective
boost-tuning) so that their union covers the LLM's outputs.

## Training

- Base model: {describe_base(record.get("base"))}
- Training data: {llm.training_data}
- Loss: {describe_training(record)}
- Boost round: {_round_line(entry, index, record)}
- Vocabulary: the LLM's ({llm.vocab_size} tokens, tokenizer vocab hash `{llm.tokenizer_vocab_hash}`)

## Measured against the LLM ({held_out} held-out prompts; greedy{_chain(record)}{_sampled_note(entry)})

| metric | value |
|---|---|
| held-out acceptance rate | {_number(entry.get("held_out_acceptance"), 3)} |
| held-out mean match length | {_number(entry.get("held_out_mean_match_length"), 2)} |
| pool coverage after this round | {_number(entry.get("pool_coverage"), 3)} |
{_sampled_rows(entry, record)}
{_usage(location, llm.name_or_path, f"ssm-{entry['ssm']}", defaults)}"""


def pool_card(manifest: dict[str, Any], record: dict[str, Any], llm: LLMInfo, location: str) -> str:
    rows = "\n".join(
        f"| `{s['path']}` | {s['round']} | {_number(s['held_out_acceptance'], 3)} | "
        f"{_number(s['held_out_mean_match_length'], 2)} | {_number(s['pool_coverage'], 3)} |"
        for s in manifest["ssms"]
    )
    return f"""{_front_matter(record.get("base"))}
# specboost SSM pool for `{llm.name_or_path}`

{len(manifest["ssms"])} small speculative models boost-tuned for lossless speculative decoding of
`{llm.name_or_path}` (vocabulary {llm.vocab_size} tokens). Base model: {describe_base(record.get("base"))}.
Training data: {llm.training_data}. Loss: {describe_training(record)}; boost mode
`{manifest["boost_mode"]}`. The manifest `{MANIFEST_FILE}` names the LLM (with a tokenizer
vocab hash, so a mismatch is detected), the SSMs, their initial voting weights and the decoding
defaults.

| SSM | boost round | held-out acceptance | mean match length | pool coverage |
|---|---|---|---|---|
{rows}

{_usage(location, llm.name_or_path, "ssm-0", PoolDefaults.from_manifest(manifest))}"""


def describe_base(base: str | None) -> str:
    """boost's "config:PRESET" is a fresh Llama; anything else is the model the SSMs started from."""
    if not base:
        return "unknown"
    if base.startswith("config:"):
        return f"none (a fresh Llama with the LLM's vocabulary, size preset `{base.removeprefix('config:')}`)"
    return f"`{base}`"


def _chain(record: dict[str, Any]) -> str:
    return f", chains of {record['chain']} draft tokens" if record.get("chain") else ""


def _number(value: Any, digits: int) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) else "n/a"


# ---------------------------------------------------------------- export


def build_manifest(
    record: dict[str, Any], llm: LLMInfo, extras: dict[str, str | None], defaults: PoolDefaults
) -> dict[str, Any]:
    ssms = [
        {
            "path": f"ssm-{entry['ssm']}",
            "round": index + 1,
            "held_out_acceptance": entry.get("held_out_acceptance"),
            "held_out_mean_match_length": entry.get("held_out_mean_match_length"),
            "pool_coverage": entry.get("pool_coverage"),
            "held_out_sampled_acceptance": entry.get("held_out_sampled_acceptance"),
            "pool_sampled_acceptance": entry.get("pool_sampled_acceptance"),
        }
        for index, entry in enumerate(record["rounds"])
    ]
    return {
        "format_version": FORMAT_VERSION,
        "llm": {
            "name_or_path": llm.name_or_path,
            "vocab_size": llm.vocab_size,
            "tokenizer_vocab_hash": llm.tokenizer_vocab_hash,
        },
        "base": record.get("base"),
        "training_data": llm.training_data,
        "marking": record.get("marking"),
        **build_info(record),
        "ssms": ssms,
        "weights": [1.0 / len(ssms)] * len(ssms),  # equal until the pool votes (ALGORITHMS.md 6)
        **{key: None if name is None else {"path": name} for key, name in extras.items()},
        "decoding": defaults.to_manifest(),
        "seed": record.get("seed"),
        "versions": {
            "boost": record.get("versions"),
            "export": {"torch": torch.__version__, "transformers": transformers.__version__},
        },
    }


def find_optional(boost: Path) -> dict[str, str | None]:
    """The optional entries BOOST holds: manifest key -> file name, else None."""
    return {
        key: next((n for n in names if (boost / n).exists()), None) for key, names in OPTIONAL_ENTRIES.items()
    }


def copy_optional(boost: Path, tmp: Path, found: dict[str, str | None]) -> None:
    for name in filter(None, found.values()):
        if (boost / name).is_dir():
            shutil.copytree(boost / name, tmp / name)
        else:
            shutil.copy2(boost / name, tmp / name)


def recommend_decoding(found: dict[str, str | None], boost: Path) -> tuple[PoolDefaults, str]:
    """The decoding defaults an export recommends when none are given, and why: the learned
    scheduler when BOOST holds its predictor and a hardware profile, else strategy "pool" with
    chains of 4 (no file needed, any device)."""
    missing = [key for key in LEARNED_DEFAULT_NEEDS if found[key] is None]
    if not missing:
        return PoolDefaults("learned"), (
            "the boost run holds a match-length predictor and a hardware profile, so the learned "
            'scheduler picks each step\'s drafts; decode with strategy="pool", shape=ChainShape(4) '
            "(--strategy pool) for a fixed chain, or export with --strategy pool to recommend one"
        )
    what = {"predictor": "match-length predictor", "hardware_profile": "hardware profile"}
    makes = " and ".join(f"`{MAKERS[key][1]}{boost}`" for key in missing)
    return PoolDefaults(), (
        "the learned scheduler is the default only with a match-length predictor and a hardware "
        f"profile, and the boost run has no {' and no '.join(what[key] for key in missing)}: {makes} "
        f"{'writes it' if len(missing) == 1 else 'write them'} there, then export again"
    )


def check_decoding(defaults: PoolDefaults, found: dict[str, str | None], boost: Path) -> None:
    """Refuse decoding defaults the decoder would refuse, or that need a file BOOST lacks (saying
    which command makes it): a pool's defaults must decode as they are."""
    strategy = defaults.strategy
    if strategy not in DRAFTING:
        raise ValueError(f"a pool's strategy must be one of {', '.join(DRAFTING)}, got {strategy!r}")
    check_inputs(strategy, StrategyInputs(defaults.shape, length_controller=defaults.length_controller))
    for key in NEEDED_ENTRIES.get(strategy, ()):
        if found[key] is None:
            what, command = MAKERS[key]
            raise ValueError(
                f"--strategy {strategy} needs {what}, and the boost run {boost} has none: "
                f"`{command}{boost}` writes it there; then export again"
            )


def export_ssm(boost: Path, tmp: Path, entry: dict[str, Any], index: int, card: str, vocab_size: int) -> None:
    """Reload the SSM and save it (safetensors) with its tokenizer and model card."""
    source, target = boost / entry["path"], tmp / f"ssm-{entry['ssm']}"
    if not (source / "config.json").is_file():
        raise FileNotFoundError(
            f"boost round {index + 1} names {source}, which holds no model (no config.json)"
        )
    model = load_causal_lm(source)
    if output_vocab_size(model) != vocab_size:
        raise ValueError(
            f"SSM {source} predicts {output_vocab_size(model)} tokens but the LLM has {vocab_size}: "
            "the pool does not match its LLM"
        )
    model.save_pretrained(target)
    tokenizer: PreTrainedTokenizerBase = load_tokenizer(source)
    tokenizer.save_pretrained(target)
    (target / README_FILE).write_text(card)


def export_pool(
    boost: str | Path,
    out: str | Path,
    hub_repo: str | None = None,
    defaults: PoolDefaults | None = None,
) -> dict[str, Any]:
    """Write the hub-style pool folder OUT from the boost run BOOST; returns the manifest.
    `defaults`: the decoding choices the manifest recommends. Unset (`recommend_decoding`), they
    are the learned scheduler's when BOOST holds its match-length predictor and a hardware
    profile, else the decoder's own (strategy "pool", chains of 4: no file to ship, any device);
    `main` prints the choice and its reason."""
    boost, out = Path(boost), Path(out)
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST_FILE).is_file():
        raise ValueError(f"{out} exists and is not an exported SSM pool: choose another --out or remove it")
    # 1. Setup: the record, the optional files and the defaults they allow, the LLM's vocabulary.
    record = read_record(boost)
    found = find_optional(boost)
    if defaults is None:
        defaults, reason = recommend_decoding(found, boost)
        logger.info("decoding defaults: %s; %s", describe_decoding(defaults), reason)
    check_decoding(defaults, found, boost)
    llm = describe_llm(record, boost)
    location = hub_repo or str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed export with our pid
    tmp.mkdir()
    try:
        # 2. Every SSM with its model card.
        for index, entry in enumerate(record["rounds"]):
            card = ssm_card(entry, index, record, llm, location, defaults)
            export_ssm(boost, tmp, entry, index, card, llm.vocab_size)
        # 3. Predictor / hardware profile, manifest, pool card.
        copy_optional(boost, tmp, found)
        manifest = build_manifest(record, llm, found, defaults)
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
        (tmp / README_FILE).write_text(pool_card(manifest, record, llm, location))
        # 4. Swap into place.
        replace_folder(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def replace_folder(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`; an existing `out` is moved aside first and deleted after."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- push


def require_token() -> str:
    token = get_token()
    if token is None:
        raise RuntimeError(
            "pushing to the Hugging Face Hub needs a token: run `hf auth login` (or "
            "`huggingface-cli login`), or set HF_TOKEN; or drop --hub-repo / HUB_REPO to export locally only"
        )
    return token


def push_to_hub(folder: str | Path, repo_id: str, token: str, private: bool = False) -> str:
    """Create the model repo if needed and upload the folder as one commit; returns the repo URL."""
    api = HfApi(token=token)
    url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    api.upload_folder(
        folder_path=str(folder),
        repo_id=repo_id,
        repo_type="model",
        commit_message=f"Upload specboost SSM pool (huggingface_hub {huggingface_hub.__version__})",
    )
    return str(url)


# ---------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m specboost.training.export",
        description="Export a boost-tuned SSM pool as a hub-style folder (models, cards, manifest).",
    )
    p.add_argument(
        "--boost", required=True, type=Path, help="the boost run folder (ssm-i/, boost_record.json)"
    )
    p.add_argument("--out", required=True, type=Path, help="the export folder (replaced atomically)")
    p.add_argument("--hub-repo", default=None, help="push to this hub repo ORG/NAME (default: $HUB_REPO)")
    p.add_argument("--private", action="store_true", help="create the hub repo as private")
    decoding = p.add_argument_group(
        "decoding defaults",
        "what SpeculativeDecoder.from_pretrained and `specboost generate/serve --pool` use unless told "
        "otherwise (default: the learned scheduler when BOOST holds a match-length predictor and a "
        "hardware profile, else strategy pool, chains of 4, a fixed length: the decoder's own defaults)",
    )
    decoding.add_argument(
        "--strategy",
        choices=DRAFTING,
        help="(default: learned with a predictor and a profile in BOOST, else pool; pool when only "
        "--chain-length, --beam or --length-controller is given)",
    )
    shape = decoding.add_mutually_exclusive_group()
    shape.add_argument("--chain-length", type=int, metavar="L", help="every SSM drafts a chain of L tokens")
    shape.add_argument(
        "--beam", type=int, nargs=2, metavar=("WIDTH", "DEPTH"), help="every SSM drafts a beam search"
    )
    decoding.add_argument(
        "--length-controller", choices=sorted(CONTROLLERS), help="adapt the chain length every step"
    )
    return p.parse_args(argv)


def decoding_defaults(args: argparse.Namespace) -> PoolDefaults | None:
    """The --strategy, --chain-length / --beam and --length-controller options as `PoolDefaults`;
    None when none is given (`export_pool` then recommends, `recommend_decoding`). A shape or
    length controller without --strategy is a fixed-shape choice: strategy "pool"."""
    shape = None if args.beam is None else BeamShape(*args.beam)
    if args.chain_length is not None:
        shape = ChainShape(args.chain_length)
    if args.strategy is None and shape is None and args.length_controller is None:
        return None
    return PoolDefaults(args.strategy or "pool", shape, args.length_controller)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hub_repo = args.hub_repo or os.environ.get("HUB_REPO") or None
    try:
        token = require_token() if hub_repo else None  # before the work, not after it
        defaults, reason = decoding_defaults(args), "as given by the options"
        if defaults is None:
            defaults, reason = recommend_decoding(find_optional(args.boost), args.boost)
        manifest = export_pool(args.boost, args.out, hub_repo, defaults)
        print(f"[export] {len(manifest['ssms'])} SSMs for {manifest['llm']['name_or_path']}: {args.out}")
        print(f"[export] decoding defaults: {describe_decoding(defaults)}\n[export] {reason}")
        if hub_repo and token:
            print(f"[export] pushed to {push_to_hub(args.out, hub_repo, token, args.private)}")
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
