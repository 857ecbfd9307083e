"""Command lines that start a training module under `accelerate launch` with this Python: the
DeepSpeed check and the multi-process tests run several processes on one machine."""

from __future__ import annotations

import socket
import sys


def free_port() -> int:
    """A TCP port free right now, for the processes' rendezvous: with accelerate's fixed default
    (29500), two launches at once on one machine (a test beside a check) would meet each other."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(options: list[str], module: str, args: list[str]) -> list[str]:
    """`accelerate launch OPTIONS --main_process_port PORT -m MODULE ARGS`, run by this interpreter
    (so by this virtual environment, whichever `accelerate` is first on PATH)."""
    launcher = [sys.executable, "-m", "accelerate.commands.launch", *options]
    return [*launcher, "--main_process_port", str(free_port()), "-m", module, *args]
