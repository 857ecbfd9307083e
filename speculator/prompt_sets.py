"""Prompt sets for distillation and evaluation: load, split into train / held-out, tokenize.

Every prompt set is read through `datasets.load_dataset`: a local file (or a folder of files of
one format) with the "json", "parquet", "csv" or "text" builder, picked by extension, or a hub
dataset name when the hub is reachable. Whatever the source, `load_prompts` returns one shape:
a `datasets.Dataset` with columns

    id      int   row of the record in the source (stable across runs; ids of kept rows only)
    prompt  str   the prompt text, stripped, rendered with the chat template if asked
    answer  str   reference answer (only when `answer_field` is set), e.g. GSM8K's "#### 72"

with empty prompts dropped and duplicates removed (first occurrence kept), so that a held-out
prompt can never also be a training prompt.

Example (a bundled set; data/README.md lists them all):

    >>> splits = load_prompt_splits(bundled_source("gsm8k", held_out_fraction=0.1, seed=0))
    >>> len(splits["train"]), len(splits["held_out"]), splits["held_out"].column_names
    (270, 30, ['id', 'prompt', 'answer'])
    >>> source = PromptSource("my_prompts.csv", prompt_field="instruction", chat_template=True)
"""

from __future__ import annotations

import difflib
import gzip
import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
from datasets import Dataset, DatasetDict
from transformers import PreTrainedTokenizerBase

from specboost.speculator.bundled_data import bundled_prompts_dir

logger = logging.getLogger(__name__)

# Extension -> `datasets` packaged builder. A trailing ".gz" is allowed on any of them.
FORMATS: dict[str, str] = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".txt": "text",
}
# Fields tried in order when `prompt_field` is not given ("turns": FastChat / Spec-Bench JSONL;
# "text": the column of the "text" builder, one prompt a line).
DEFAULT_PROMPT_FIELDS: tuple[str, ...] = ("prompt", "turns", "question", "instruction", "text")


@dataclass
class PromptSource:
    """Where a prompt set comes from and how to read a prompt (and an answer) out of a record."""

    path: str = field(metadata={"help": "local file, folder of files of one format, or hub dataset id"})
    prompt_field: str | None = field(
        default=None,
        metadata={
            "help": "column holding the prompt, or a dotted path into nested records "
            "('instances.0.input'); a list value (FastChat 'turns') gives its first element; "
            f"None tries {DEFAULT_PROMPT_FIELDS} in order"
        },
    )
    prompt_template: str | None = field(
        default=None,
        metadata={
            "help": "str.format template over the record instead of prompt_field, e.g. "
            "'{instruction}\\n\\n{instances[0][input]}'"
        },
    )
    answer_field: str | None = field(
        default=None, metadata={"help": "column or dotted path of a reference answer (kept as 'answer')"}
    )
    chat_template: bool = field(
        default=False,
        metadata={"help": "render each prompt as one user turn with the tokenizer's chat template"},
    )
    split: str = field(default="train", metadata={"help": "hub split; a local file is a single split"})
    max_prompts: int | None = field(
        default=None, metadata={"help": "keep the first N distinct prompts (file order)"}
    )
    held_out_fraction: float = field(
        default=0.1, metadata={"help": "share of distinct prompts held out, in (0, 1)"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the train / held-out split"})
    cache_dir: str | None = field(
        default=None, metadata={"help": "`datasets` cache folder (None: the library's default)"}
    )

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("PromptSource.path is empty: give a prompt file, a folder or a hub dataset id")
        if self.prompt_field is not None and self.prompt_template is not None:
            raise ValueError("set prompt_field or prompt_template, not both")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ValueError(f"max_prompts must be at least 1 (or None for all), got {self.max_prompts}")
        _check_fraction(self.held_out_fraction)


@dataclass
class TokenizedPrompts:
    """Prompts with token ids, after truncation to the prompt budget."""

    dataset: Dataset  # the input columns plus input_ids (list[int]) and truncated (bool)
    num_truncated: int  # prompts longer than max_prompt_tokens, cut to their last tokens
    max_prompt_tokens: int


# ---------------------------------------------------------------------------------------------
# Reading raw records


def _check_fraction(fraction: float) -> None:
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"held_out_fraction must be strictly between 0 and 1, got {fraction}")


def file_format(path: str | os.PathLike[str]) -> str:
    """The `datasets` builder for a file name: "json", "parquet", "csv" or "text"."""
    suffixes = [s.lower() for s in Path(path).suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    if not suffixes or suffixes[-1] not in FORMATS:
        raise ValueError(
            f"unsupported prompt file {str(path)!r}: expected one of {', '.join(FORMATS)} (optionally .gz)"
        )
    return FORMATS[suffixes[-1]]


def _open_text(path: Path) -> Any:
    if path.suffix.lower() == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _has_records(path: Path, builder: str) -> bool:
    """Whether a file holds at least one record (a CSV needs a row beyond its header).

    `datasets` fails on empty files with errors that do not say so (StopIteration for JSON,
    "corresponds to no data" for CSV), hence this check before loading.
    """
    if builder == "parquet":
        import pyarrow.parquet as pq

        return pq.read_metadata(path).num_rows > 0
    needed = 2 if builder == "csv" else 1
    with _open_text(path) as f:
        for line in f:
            if line.strip():
                needed -= 1
                if needed == 0:
                    return True
    return False


def _local_files(path: Path) -> tuple[str, list[str]]:
    """The builder and the non-empty data files of a local file or folder."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
        builders = {}
        for p in files:
            try:
                builders[p] = file_format(p)
            except ValueError:
                continue  # licences, notes and the like
        if not builders:
            raise FileNotFoundError(f"no prompt files ({', '.join(FORMATS)}) in folder {str(path)!r}")
        kinds = set(builders.values())
        if len(kinds) > 1:
            raise ValueError(f"folder {str(path)!r} mixes formats {sorted(kinds)}: keep one format a folder")
        builder, candidates = kinds.pop(), list(builders)
    else:
        builder, candidates = file_format(path), [path]
    files = [str(p) for p in candidates if _has_records(p, builder)]
    if not files:
        raise ValueError(f"prompt dataset {str(path)!r} is empty: no records found")
    return builder, files


def _looks_local(path: str) -> bool:
    """A string meant as a file (not a hub id): a known extension or an explicit path prefix."""
    if path.startswith(("/", "./", "../", "~")) or path.endswith(os.sep):
        return True
    try:
        file_format(path)
    except ValueError:
        return False
    return True


def _bad_json_line(files: list[str]) -> str | None:
    """'FILE:LINE: what is wrong' for the first line of JSON Lines files that is no JSON object."""
    for file in files:
        with open(file, encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line.strip())
                except json.JSONDecodeError as error:
                    return (
                        f"{file}:{number}: not valid JSON ({error.msg} at column {error.colno}); fix the line"
                    )
                if not isinstance(record, dict):
                    return (
                        f"{file}:{number}: a JSON Lines prompt must be an object, got {type(record).__name__}"
                    )
    return None


def load_records(source: PromptSource) -> Dataset:
    """The source's raw records, as `datasets` reads them (one column per field)."""
    path = Path(source.path).expanduser()
    if path.exists():
        builder, files = _local_files(path)
        try:
            ds = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=source.cache_dir)
        except Exception as e:  # datasets raises many kinds; say which file (and line) could not be read
            where = _bad_json_line(files) if builder == "json" else None
            raise ValueError(where or f"could not read {source.path!r} as {builder}: {e}") from e
    elif _looks_local(source.path):
        raise FileNotFoundError(f"prompt file {source.path!r} does not exist")
    else:
        try:
            ds = datasets.load_dataset(source.path, split=source.split, cache_dir=source.cache_dir)
        except Exception as e:  # offline this is a ConnectionError after retries
            raise FileNotFoundError(
                f"{source.path!r} is not a local file, and loading it as a Hugging Face hub dataset "
                f"failed ({type(e).__name__}: {e}). The hub may be unreachable from this machine "
                f"(set HF_HUB_OFFLINE=1 to fail at once): pass a local {'/'.join(FORMATS)} file instead."
            ) from e
    if len(ds) == 0:
        raise ValueError(f"prompt dataset {source.path!r} is empty: no records found")
    return ds


# ---------------------------------------------------------------------------------------------
# Records -> prompt text


def _follow(value: Any, parts: Sequence[str], name: str, row: int) -> Any:
    for part in parts:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise ValueError(f"field {name!r}: row {row} has no {part!r} (got {type(value).__name__})")
    return value


def _column(ds: Dataset, name: str, what: str, path: str) -> list[Any]:
    """Values of a column or of a dotted path into a column (a literal column name wins)."""
    if name in ds.column_names:
        return list(ds[name])
    head, *rest = name.split(".")
    if rest and head in ds.column_names:
        return [_follow(value, rest, name, row) for row, value in enumerate(ds[head])]
    raise ValueError(
        f"{what} {name!r} not found in {path!r}; available columns: {', '.join(ds.column_names)}"
    )


def _as_text(value: Any) -> str:
    """A prompt or answer value as text; a list (FastChat 'turns') gives its first element."""
    if isinstance(value, list):
        value = value[0] if value else ""
    return "" if value is None else str(value).strip()


def _templated(ds: Dataset, template: str, path: str) -> list[str]:
    texts = []
    for row, record in enumerate(ds):
        try:
            texts.append(template.format_map(record))
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise ValueError(
                f"prompt_template {template!r} does not fit row {row} of {path!r} ({type(e).__name__}: "
                f"{e}); available columns: {', '.join(ds.column_names)}"
            ) from e
    return texts


def _prompt_values(ds: Dataset, source: PromptSource) -> list[Any]:
    if source.prompt_template is not None:
        return _templated(ds, source.prompt_template, source.path)
    if source.prompt_field is not None:
        return _column(ds, source.prompt_field, "prompt field", source.path)
    for name in DEFAULT_PROMPT_FIELDS:
        if name in ds.column_names:
            return list(ds[name])
    raise ValueError(
        f"no prompt field given and none of {', '.join(DEFAULT_PROMPT_FIELDS)} is a column of "
        f"{source.path!r}; set prompt_field to one of: {', '.join(ds.column_names)}"
    )


def render_chat(prompts: Iterable[str], tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Each prompt as a single user turn, followed by the template's generation prompt."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "chat_template=True but the tokenizer has no chat_template: set tokenizer.chat_template "
            "or load the prompts with chat_template=False"
        )
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]


def dedupe_prompts(ds: Dataset) -> Dataset:
    """Drop repeated prompts (same text), keeping the first occurrence."""
    seen: set[str] = set()
    keep = []
    for i, prompt in enumerate(ds["prompt"]):
        if prompt not in seen:
            seen.add(prompt)
            keep.append(i)
    if len(keep) < len(ds):
        logger.info("dropped %d duplicate prompts of %d", len(ds) - len(keep), len(ds))
        ds = ds.select(keep)
    return ds


def load_prompts(source: PromptSource, tokenizer: PreTrainedTokenizerBase | None = None) -> Dataset:
    """Distinct, non-empty prompts of a source as columns id, prompt (and answer).

    `tokenizer` is needed only with `source.chat_template`.
    """
    if source.chat_template and tokenizer is None:
        raise ValueError("chat_template=True needs a tokenizer: pass load_prompts(source, tokenizer)")
    records = load_records(source)
    columns: dict[str, list[Any]] = {
        "id": list(range(len(records))),
        "prompt": [_as_text(v) for v in _prompt_values(records, source)],
    }
    if source.answer_field is not None:
        columns["answer"] = [
            _as_text(v) for v in _column(records, source.answer_field, "answer field", source.path)
        ]

    num_records = len(records)
    keep = [i for i, prompt in enumerate(columns["prompt"]) if prompt]
    if not keep:
        raise ValueError(
            f"prompt dataset {source.path!r} has {num_records} records but every prompt is empty"
        )
    if len(keep) < num_records:
        logger.warning(
            "dropped %d empty prompts of %d in %s", num_records - len(keep), num_records, source.path
        )
    ds = dedupe_prompts(
        Dataset.from_dict({name: [values[i] for i in keep] for name, values in columns.items()})
    )
    if source.max_prompts is not None and len(ds) > source.max_prompts:
        ds = ds.select(range(source.max_prompts))
    if source.chat_template:
        assert tokenizer is not None  # checked above
        rendered = render_chat(ds["prompt"], tokenizer)
        ds = ds.remove_columns("prompt").add_column("prompt", rendered).select_columns(list(columns))
    return ds


# ---------------------------------------------------------------------------------------------
# Bundled prompt sets (data/prompts/, described in data/README.md)

# data/prompts/: package data of specboost.data, so the same files from a wheel and a checkout.
BUNDLED_PROMPTS_DIR = bundled_prompts_dir()
# name -> (file, how to read a prompt / answer from it)
BUNDLED_PROMPT_SETS: dict[str, tuple[str, dict[str, str]]] = {
    "bench": ("bench_prompts.txt", {}),
    "vicuna_bench": ("vicuna_bench.jsonl", {"prompt_field": "turns"}),
    "eagle_alpaca": ("eagle_alpaca.jsonl", {"prompt_field": "turns"}),
    "eagle_gsm8k": ("eagle_gsm8k.jsonl", {"prompt_field": "turns", "answer_field": "reference"}),
    "eagle_qa": ("eagle_qa.jsonl", {"prompt_field": "turns"}),
    "eagle_sum": ("eagle_sum.jsonl", {"prompt_field": "turns"}),
    "gsm8k": ("gsm8k_train_300.jsonl", {"prompt_field": "question", "answer_field": "answer"}),
    "self_instruct": (
        "self_instruct_user_oriented.jsonl",
        {"prompt_template": "{instruction}\n\n{instances[0][input]}"},
    ),
    "self_instruct_seed": (
        "self_instruct_seed_tasks.jsonl",
        {"prompt_template": "{instruction}\n\n{instances[0][input]}"},
    ),
    "tinystories_openings": ("tinystories_openings.txt", {}),
    "tinystories_train_openings": ("tinystories_train_openings.txt", {}),
    "gutenberg_openings": ("gutenberg_openings.txt", {}),
}


def bundled_source(
    name: str, data_dir: str | os.PathLike[str] | None = None, **overrides: Any
) -> PromptSource:
    """A `PromptSource` for a bundled prompt set by name, e.g. bundled_source("gsm8k", max_prompts=50)."""
    if name not in BUNDLED_PROMPT_SETS:
        raise ValueError(
            f"unknown bundled prompt set {name!r}; choose one of: {', '.join(BUNDLED_PROMPT_SETS)}"
        )
    file, fields = BUNDLED_PROMPT_SETS[name]
    folder = Path(data_dir) if data_dir is not None else BUNDLED_PROMPTS_DIR
    return PromptSource(str(folder / file), **{**fields, **overrides})


def named_source(name_or_path: str, **overrides: Any) -> PromptSource:
    """A bundled set by name, else a local file / folder or a hub dataset id.

    A bare word close to a bundled name (a misspelling, most likely) that is no file is refused
    here, naming that set, rather than failing later as an unreachable hub dataset; any other bare
    word is a hub id (hub datasets without an organisation exist, e.g. "squad")."""
    if name_or_path in BUNDLED_PROMPT_SETS:
        return bundled_source(name_or_path, **overrides)
    bare = not (Path(name_or_path).expanduser().exists() or _looks_local(name_or_path) or "/" in name_or_path)
    close = difflib.get_close_matches(name_or_path, BUNDLED_PROMPT_SETS, n=1) if bare else []
    if close:
        raise ValueError(
            f"unknown prompt set {name_or_path!r} (did you mean {close[0]!r}?): not a bundled set "
            f"({', '.join(BUNDLED_PROMPT_SETS)}), an existing file or a hub dataset id"
        )
    return PromptSource(name_or_path, **overrides)


# ---------------------------------------------------------------------------------------------
# Held-out split


def train_heldout_split(ds: Dataset, fraction: float, seed: int) -> DatasetDict:
    """Split distinct prompts into "train" and "held_out", the same way for the same seed.

    Duplicates are removed first, so no prompt text is in both splits. The held-out part has
    round(fraction * n) prompts, at least one; the train part must keep at least one.
    """
    _check_fraction(fraction)
    if "prompt" not in ds.column_names:
        raise ValueError(f"dataset has no 'prompt' column (columns: {', '.join(ds.column_names)})")
    ds = dedupe_prompts(ds)
    num_held_out = max(1, round(fraction * len(ds)))
    if len(ds) - num_held_out < 1:
        raise ValueError(
            f"cannot hold out {fraction:.0%} of {len(ds)} distinct prompts and keep any for training: "
            "use more prompts or a smaller held_out_fraction"
        )
    parts = ds.train_test_split(test_size=num_held_out, seed=seed, shuffle=True)
    return DatasetDict(train=parts["train"], held_out=parts["test"])


def load_prompt_splits(source: PromptSource, tokenizer: PreTrainedTokenizerBase | None = None) -> DatasetDict:
    """`load_prompts` then `train_heldout_split` with the source's fraction and seed."""
    return train_heldout_split(load_prompts(source, tokenizer), source.held_out_fraction, source.seed)


# ---------------------------------------------------------------------------------------------
# Tokenization with a prompt budget


def _truncate(ids: list[int], limit: int, bos: int | None) -> list[int]:
    """The last `limit` tokens, keeping a leading BOS in front so the model still sees one."""
    if len(ids) <= limit:
        return ids
    if bos is not None and limit > 1 and ids[0] == bos:
        return [bos, *ids[len(ids) - limit + 1 :]]
    return ids[len(ids) - limit :]


def tokenize_prompts(
    ds: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_tokens: int,
    *,
    add_special_tokens: bool = True,
) -> TokenizedPrompts:
    """Token ids of each prompt, cut to at most `max_prompt_tokens`; over-long prompts are counted.

    A prompt that is too long keeps its *end* (and a leading BOS): generation continues from
    the last tokens, and a chat-rendered prompt ends with the assistant header that must stay.
    The budget is the model's context minus the tokens to generate. Pass
    `add_special_tokens=False` for prompts already rendered with a chat template (the template
    writes its own BOS).
    """
    if max_prompt_tokens < 1:
        raise ValueError(
            f"max_prompt_tokens must be at least 1, got {max_prompt_tokens}: the context is too "
            "short for the tokens to generate"
        )
    # verbose=False: the library's own "longer than model_max_length" warning would be noise here.
    encoded = tokenizer(list(ds["prompt"]), add_special_tokens=add_special_tokens, verbose=False)["input_ids"]
    bos = tokenizer.bos_token_id
    input_ids = [_truncate(ids, max_prompt_tokens, bos) for ids in encoded]
    truncated = [len(ids) > max_prompt_tokens for ids in encoded]
    num_truncated = sum(truncated)
    if num_truncated:
        logger.warning(
            "%d of %d prompts were longer than %d tokens and were truncated to their last %d tokens",
            num_truncated,
            len(ds),
            max_prompt_tokens,
            max_prompt_tokens,
        )
    out = ds.add_column("input_ids", input_ids).add_column("truncated", truncated)
    return TokenizedPrompts(dataset=out, num_truncated=num_truncated, max_prompt_tokens=max_prompt_tokens)
