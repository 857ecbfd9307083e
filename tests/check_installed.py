"""Checks the *installed* specboost, as a user gets it from a wheel (`make check-wheel`).

Run by the interpreter of a fresh virtual environment that has only the wheel installed (its
dependencies come from the project's .venv through a .pth file), from a folder outside the
checkout, so nothing of the checkout can be imported by accident:

    VENV/bin/python CHECKOUT/tests/check_installed.py --checkout CHECKOUT --work DIR

It fails (exit 1, naming what) unless, from that folder:
1. every module of training/, speculator/ and decoder/ imports, from the installed package;
2. `specboost.__version__` and `specboost --version` give the package's metadata version, and
   every dependency the metadata declares is installed at an allowed version;
3. the bundled prompt files (with their licence and source notes) are the checkout's, every set
   loads by name, and the training configs are there;
4. `specboost --help` and every subcommand's `--help` exit 0;
5. a greedy `specboost generate` on tiny float64 models prints the LLM's own greedy text;
6. `specboost serve` answers one greedy completion with that same text, and exits on SIGTERM.
Not collected by pytest (no test_ prefix): it needs the wheel's environment.
"""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

PROMPT, NEW_TOKENS = "Once upon a time", 24
CODE_FOLDERS = ("training", "speculator", "decoder")
SERVER_START_S, SERVER_STOP_S = 180, 30


class CheckFailed(Exception):
    pass


def check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def run(*args: str, timeout: float = 300) -> str:
    """stdout of a command that must exit 0."""
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    check(done.returncode == 0, f"`{' '.join(args)}` exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout


def source_modules(checkout: Path) -> list[str]:
    """Every module the checkout's code folders hold, by its installed name."""
    names = ["specboost", "specboost.data"]
    for folder in CODE_FOLDERS:
        for path in sorted((checkout / folder).rglob("*.py")):
            parts = path.relative_to(checkout).with_suffix("").parts
            names.append(".".join(("specboost", *parts[: -1 if parts[-1] == "__init__" else None])))
    return names


def installed_file(name: str) -> Path | None:
    """The file module `name` was imported from, or None when it does not import."""
    try:
        return Path(importlib.import_module(name).__file__ or "").resolve()
    except ImportError as error:
        print(f"cannot import {name}: {error}", file=sys.stderr)
        return None


def check_modules(checkout: Path) -> int:
    names = source_modules(checkout)
    files = {name: installed_file(name) for name in names}
    missing = [name for name, file in files.items() if file is None]
    check(not missing, f"modules missing from the installed package: {missing}")
    outside = [name for name, file in files.items() if not file.is_relative_to(Path(sys.prefix))]
    check(not outside, f"imported from outside the installed package: {outside}")
    return len(names)


def check_metadata(script: Path) -> str:
    from packaging.requirements import Requirement

    import specboost

    version = metadata.version("specboost")
    check(specboost.__version__ == version, f"specboost.__version__ {specboost.__version__} != {version}")
    printed = run(str(script), "--version").strip()
    check(printed == f"specboost {version}", f"`specboost --version` printed {printed!r}")
    for line in metadata.requires("specboost") or []:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # an optional extra
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            raise CheckFailed(f"dependency {requirement} is not installed") from None
        check(
            requirement.specifier.contains(installed, prereleases=True),
            f"dependency {requirement}: {installed} installed",
        )
    return version


def check_data(checkout: Path) -> int:
    from specboost.speculator.bundled_data import bundled_prompts_dir
    from specboost.speculator.prompt_sets import BUNDLED_PROMPT_SETS, bundled_source, load_prompts
    from specboost.training.check_deepspeed import CONFIGS

    shipped = {p.name: p.read_bytes() for p in bundled_prompts_dir().iterdir()}
    wanted = {p.name: p.read_bytes() for p in (checkout / "data" / "prompts").iterdir()}
    check(
        shipped == wanted,
        f"bundled prompt files differ from the checkout's: {sorted(set(wanted) ^ set(shipped))}",
    )
    for name in BUNDLED_PROMPT_SETS:
        check(len(load_prompts(bundled_source(name))) > 0, f"bundled prompt set {name} loads empty")
    check(len(list(CONFIGS.glob("*.yaml"))) == 4, f"training configs missing from {CONFIGS}")
    return len(BUNDLED_PROMPT_SETS)


def check_help(script: Path) -> list[str]:
    from specboost.decoder.cli import build_parser

    run(str(script), "--help")
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for command in commands:
        run(str(script), command, "--help")
    return list(commands)


def greedy_text(llm_dir: Path) -> str:
    """The LLM's own greedy continuation of PROMPT, as transformers generates it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llm = AutoModelForCausalLM.from_pretrained(llm_dir, dtype=torch.float64).eval()
    tokenizer = AutoTokenizer.from_pretrained(llm_dir)
    ids = tokenizer(PROMPT, return_tensors="pt")
    out = llm.generate(**ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, ids.input_ids.shape[1] :], skip_special_tokens=True)


def check_generate(script: Path, models: list[str], expected: str) -> None:
    printed = run(
        str(script), "generate", *models, "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--json"
    )
    text = json.loads(printed)["text"]
    check(text == expected, f"specboost generate printed {text!r}, the LLM's greedy text is {expected!r}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(url: str, body: dict | None = None) -> dict:
    """The JSON answer to a GET (no body) or POST; an error status fails the check with its body."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise CheckFailed(f"{url} answered {error.code}: {error.read().decode(errors='replace')}") from None


def wait_healthy(server: subprocess.Popen, base: str) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        check(server.poll() is None, f"specboost serve exited {server.returncode} before answering")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    raise CheckFailed(f"specboost serve did not answer /health within {SERVER_START_S} s")


def check_serve(script: Path, models: list[str], expected: str, log: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        server = subprocess.Popen(
            [str(script), "serve", *models, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_healthy(server, base)
        model = call(f"{base}/v1/models")["data"][0]["id"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0}
        text = call(f"{base}/v1/completions", body)["choices"][0]["text"]
        check(text == expected, f"specboost serve answered {text!r}, the LLM's greedy text is {expected!r}")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(SERVER_STOP_S)
        except subprocess.TimeoutExpired:
            server.kill()
            raise CheckFailed(f"specboost serve did not exit within {SERVER_STOP_S} s of SIGTERM") from None
    # uvicorn re-raises the signal once it has shut down cleanly: -SIGTERM is a clean exit too.
    clean = server.returncode in (0, -signal.SIGTERM) and "shutdown complete" in log.read_text()
    check(clean, f"specboost serve exited {server.returncode} on SIGTERM (log: {log})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", type=Path, required=True, help="the source checkout (its file list)")
    parser.add_argument("--work", type=Path, required=True, help="an empty folder outside the checkout")
    args = parser.parse_args(argv)
    checkout, work = args.checkout.resolve(), args.work.resolve()
    script = Path(sys.prefix) / "bin" / "specboost"
    try:
        check(
            not Path.cwd().resolve().is_relative_to(checkout), "run this from a folder outside the checkout"
        )
        print(f"modules: {check_modules(checkout)} import from {sys.prefix}")
        print(f"version: {check_metadata(script)}, dependencies satisfied")
        print(f"data: {check_data(checkout)} bundled prompt sets load by name; training configs present")
        print(f"help: specboost and its commands {', '.join(check_help(script))}")
        from specboost.decoder.tiny_models import build_tiny_models

        llm_dir, ssm_dirs = build_tiny_models(work / "tiny-models")
        models = ["--llm", str(llm_dir), "--ssm", *map(str, ssm_dirs), "--dtype", "float64"]
        expected = greedy_text(llm_dir)
        check_generate(script, models, expected)
        print(f"generate: greedy output equals the LLM's ({NEW_TOKENS} tokens)")
        check_serve(script, models, expected, work / "serve.log")
        print("serve: one greedy completion equals the LLM's; clean exit on SIGTERM")
    except (CheckFailed, subprocess.TimeoutExpired) as error:
        print(f"check-wheel: FAILED: {error}", file=sys.stderr)
        return 1
    print("check-wheel: the installed package works outside the checkout")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
