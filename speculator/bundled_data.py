"""Where the data shipped with specboost lies: the `specboost.data` package (the repository's
`data/` folder), found through `importlib.resources` so that a wheel and a checkout read the
same files.

The prompt sets (`data/prompts/`) ship in the wheel. The corpus (`data/corpus/`, ~6 MB) only
builds the reference LLM and the benchmark fixtures, so it is only in a source checkout:
`bundled_corpus()` says so when it is missing.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

DATA_PACKAGE = "specboost.data"


def bundled_path(*parts: str) -> Path:
    """The file-system path of `parts` inside the bundled data (it may not exist)."""
    return Path(str(files(DATA_PACKAGE).joinpath(*parts)))


def bundled_prompts_dir() -> Path:
    """The folder of the bundled prompt sets (`data/prompts/`; shipped in the wheel)."""
    return bundled_path("prompts")


def bundled_corpus() -> Path:
    """The bundled corpus folder (`data/corpus/`), which exists only in a source checkout."""
    corpus = bundled_path("corpus")
    if not corpus.is_dir():
        raise FileNotFoundError(
            "the bundled corpus (data/corpus/) ships only with a source checkout of specboost, not "
            "with the installed package: clone the repository and run from it (`make install`), or "
            "pass --corpus DIR with a folder of train.jsonl[.gz] / valid.jsonl[.gz] files"
        )
    return corpus
