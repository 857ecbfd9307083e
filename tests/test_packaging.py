"""The wheel is the product: it holds every module and every data file the code reads, and the
code finds its data through the package, never through the checkout's layout. (`make
check-wheel` goes further: it installs the wheel outside the checkout and runs it.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

import specboost
import specboost.data
from specboost.speculator import bundled_data
from specboost.speculator.prompt_sets import BUNDLED_PROMPT_SETS, bundled_source
from specboost.training import reference_llm

ROOT = Path(__file__).resolve().parents[1]
CODE_FOLDERS = {
    "training": "specboost/training",
    "speculator": "specboost/speculator",
    "decoder": "specboost/decoder",
}
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "specboost", "data", *CODE_FOLDERS)


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """The file names in a wheel built from a copy of the checkout (the build writes build/ there)."""
    src, dist = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            ".",
        ],
        cwd=src,
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("specboost-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def test_the_wheel_holds_every_module_of_the_code_folders(wheel_files: set[str]) -> None:
    expected = {
        f"{package}/{path.relative_to(ROOT / folder).as_posix()}"
        for folder, package in CODE_FOLDERS.items()
        for path in (ROOT / folder).rglob("*.py")
    }
    assert expected - wheel_files == set()
    assert "specboost/decoder/serve/app.py" in wheel_files  # the subpackage a hand-made list once missed
    assert "specboost/__init__.py" in wheel_files


def test_the_wheel_holds_the_prompt_sets_with_their_notes_and_the_training_configs(
    wheel_files: set[str],
) -> None:
    prompts = {f"specboost/data/prompts/{p.name}" for p in (ROOT / "data" / "prompts").iterdir()}
    configs = {f"specboost/training/configs/{p.name}" for p in (ROOT / "training" / "configs").iterdir()}
    assert prompts - wheel_files == set() and configs - wheel_files == set()
    assert not any(name.startswith("specboost/data/corpus") for name in wheel_files)  # checkout only
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in wheel_files)


def test_bundled_data_is_found_through_the_package() -> None:
    folder = bundled_data.bundled_prompts_dir()
    assert folder == Path(specboost.data.__file__).parent / "prompts"
    for name in BUNDLED_PROMPT_SETS:
        assert Path(bundled_source(name).path).parent == folder
        assert Path(bundled_source(name).path).is_file()


def test_a_missing_corpus_says_it_needs_a_checkout(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(bundled_data, "bundled_path", lambda *parts: tmp_path.joinpath(*parts))
    with pytest.raises(FileNotFoundError, match=r"source checkout.*--corpus DIR"):
        reference_llm.train_reference_llm(reference_llm.PRESETS["tiny"], tmp_path / "run")
    assert reference_llm.main(["--out", str(tmp_path / "run")]) == 2


def test_the_version_comes_from_the_package_metadata() -> None:
    assert specboost.__version__ == metadata.version("specboost")
