"""`specboost` options checked at the command line: numbers out of range end in one usage line
(never a traceback from torch or uvicorn), `--version`, the served model's default name, no
transformers deprecation noise on `generate`, and `serve` exiting within its shutdown timeout
on SIGTERM with a stream still open."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import httpx
import pytest

from specboost import __version__
from specboost.decoder.cli import build_parser, main
from specboost.decoder.serve.command import server_config
from specboost.decoder.tiny_models import TinyModelsConfig, build_tiny_models

MODELS = ["--llm", "models/llm", "--ssm", "models/ssm"]
STARTUP_S = 90.0  # a fresh interpreter importing torch and transformers on a loaded 2-core machine


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["generate", *MODELS, "--prompt", "a", "--threads", "-1"], "--threads"),
        (["generate", *MODELS, "--prompt", "a", "--threads", "0"], "--threads"),
        (["serve", *MODELS, "--threads", "-1"], "--threads"),
        (["profile", *MODELS, "--out", "p.json", "--threads", "0"], "--threads"),
        (["bench", "--suite", "quick", "--threads", "0"], "--threads"),
        (["serve", *MODELS, "--port", "70000"], "--port"),
        (["serve", *MODELS, "--port", "0"], "--port"),
        (["serve", *MODELS, "--request-timeout", "nan"], "--request-timeout"),
        (["serve", *MODELS, "--max-prompt-tokens", "0"], "--max-prompt-tokens"),
        (["serve", *MODELS, "--batch-size", "0"], "--batch-size"),
        (["serve", *MODELS, "--shutdown-timeout", "0"], "--shutdown-timeout"),
        (["generate", *MODELS, "--prompt", "a", "--seed", str(2**70)], "--seed"),
        (["generate", *MODELS, "--prompt", "a", "--seed", "-1"], "--seed"),
        (["generate", *MODELS, "--prompt", "a", "--temperature", "inf"], "--temperature"),
        (["generate", *MODELS, "--prompt", "a", "--top-p", "nan"], "--top-p"),
    ],
)
def test_numbers_out_of_range_are_one_usage_line(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("specboost ") and option in error and "expected" in error


def test_numbers_in_range_are_taken() -> None:
    args = build_parser().parse_args(
        ["serve", *MODELS, "--threads", "1", "--port", "65535", "--request-timeout", "0.5"]
    )
    assert (args.threads, args.port, args.request_timeout) == (1, 65535, 0.5)
    seed = build_parser().parse_args(["generate", *MODELS, "--prompt", "a", "--seed", str(2**63 - 1)]).seed
    assert seed == 2**63 - 1


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"specboost {__version__}\n"


# Every command but `serve` runs without the web stack: on a GPU machine whose environment lacked
# fastapi's dependencies, `specboost profile` failed on an import of the server it never used.
WITHOUT_WEB_STACK = """
import sys
from importlib.abc import MetaPathFinder
WEB = {"fastapi", "uvicorn", "starlette", "pydantic", "opentelemetry"}
class Missing(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in WEB:
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Missing())
from specboost.decoder.cli import main
for command in ("generate", "profile", "bench"):
    try:
        main([command, "--help"])
    except SystemExit as exit_:
        assert exit_.code == 0, (command, exit_.code)
"""


def test_commands_but_serve_need_no_web_stack() -> None:
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_WEB_STACK], capture_output=True, text=True, timeout=STARTUP_S
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage: specboost profile" in done.stdout


@pytest.mark.parametrize(
    ("llm", "name"),
    [
        ("artifacts/reference-llm/tiny/model", "reference-llm/tiny"),
        ("models/my-llm", "my-llm"),
        ("out/llama-7b/checkpoints/final", "out/llama-7b"),
        ("models/llama-3/model", "llama-3"),
    ],
)
def test_the_served_name_says_which_model(llm: str, name: str) -> None:
    args = build_parser().parse_args(["serve", "--llm", llm, "--pool", "pools/p"])
    assert server_config(args).model_name == name
    named = build_parser().parse_args(["serve", "--llm", llm, "--pool", "p", "--served-model-name", "x"])
    assert server_config(named).model_name == "x"


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny models, with room for a stream that outlasts the shutdown test (8000 tokens take
    tens of seconds)."""
    out = tmp_path_factory.mktemp("tiny-models")
    build_tiny_models(out, TinyModelsConfig(max_position_embeddings=8192))
    return out


def test_generate_prints_no_deprecation_warning(models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--llm", str(models_dir / "llm"), "--ssm", str(models_dir / "ssm-0")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main([*argv, "--prompt", "Once", "--max-new-tokens", "8"]) == 0
    assert not [w for w in caught if "past_key_values" in str(w.message)]
    assert "past_key_values" not in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sigterm_with_a_stream_open_exits_within_the_shutdown_timeout(
    models_dir: Path, tmp_path: Path
) -> None:
    port, shutdown_s = _free_port(), 2
    command = [
        *(sys.executable, "-m", "specboost.decoder.cli", "serve"),
        *("--llm", str(models_dir / "llm"), "--ssm", str(models_dir / "ssm-0"), "--threads", "1"),
        *("--port", str(port), "--max-tokens-limit", "8000", "--shutdown-timeout", str(shutdown_s)),
    ]
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=os.environ | {"HF_HUB_OFFLINE": "1"}
        )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert server.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Once", "max_tokens": 8000, "temperature": 0, "stream": True}
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", f"{base}/v1/completions", json=body) as stream,
        ):
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # the request is generating
            sent = time.monotonic()
            server.send_signal(signal.SIGTERM)
            server.wait(shutdown_s + 10)
            assert time.monotonic() - sent < shutdown_s + 10
        # uvicorn re-raises the signal once it has shut down cleanly: the exit status says SIGTERM.
        assert server.returncode in (0, -signal.SIGTERM), log.read_text()
        assert "Application shutdown complete" in log.read_text()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
