"""The documented check that boost-tuning runs under DeepSpeed ZeRO-2 and ZeRO-3.

    make check-deepspeed   # .venv-deepspeed (CPU torch + specboost + deepspeed), then this check
    python -m specboost.training.check_deepspeed --out artifacts/deepspeed-check [--stages 2 3]

It needs the optional `deepspeed` extra. It builds the tiny stand-in LLM (decoder/tiny_models.py),
distils a few prompts with it, then for each stage runs, from scratch, the shipped configuration:

    accelerate launch --config_file training/configs/deepspeed_zero<stage>.yaml \\
        -m specboost.training.boost --num-ssms 2 --max-steps 8 ...      # 2 processes

and checks that
- the launch exits 0 and boost_record.json has both rounds with all their steps;
- DeepSpeed really trained, at that stage: every round's checkpoint holds DeepSpeed's ZeRO optimizer
  shards, one per process, each recording the stage (a launch that fell back to plain data
  parallelism would save no such shards);
- every saved SSM loads with `from_pretrained` and predicts the distilled outputs better than the
  same SSM before training: its loss fell, and under ZeRO-3 the sharded weights were gathered
  whole when saved.

Without a GPU, DeepSpeed picks its CPU accelerator and torch's gloo backend (oneCCL is not needed)
and compiles its small shared-memory op with ninja and the C++ compiler on first use. The results
(times, losses, versions) go to OUT/check.json; the exit status is 0 if every check holds, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from importlib import metadata
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from specboost.decoder.tiny_models import build_tiny_models
from specboost.training import boost
from specboost.training.boost_data import PadCollator, training_examples
from specboost.training.distill import DistillConfig, distill
from specboost.training.launch import accelerate_launch
from specboost.training.run_files import library_versions, write_json_atomic
from specboost.training.ssm_setup import build_ssm, context_of

CONFIGS = Path(str(files("specboost.training") / "configs"))  # package data
PROCESSES = 2  # num_processes of the shipped DeepSpeed configs
SSMS, STEPS = 2, 8  # boost rounds, and optimizer steps in each


class CheckFailed(Exception):
    """One of the check's conditions does not hold (the message says which)."""


def fixtures(out: Path) -> tuple[Path, Path]:
    """The tiny LLM and its distillation data (both reused when already there)."""
    llm = build_tiny_models(out / "models")[0]
    config = DistillConfig(
        llm=str(llm), prompts="tinystories_openings", max_prompts=48, max_new_tokens=16, batch_size=8
    )
    distill(config, out / "distill")
    return llm, out / "distill"


def boost_args(llm: Path, distilled: Path, pool: Path) -> list[str]:
    return [
        *("--distilled", str(distilled), "--llm", str(llm), "--out", str(pool)),
        *("--num-ssms", str(SSMS), "--max-steps", str(STEPS), "--batch-size", "4", "--save-steps", "4"),
        *("--warmup-steps", "0", "--threads", "1"),
    ]


def run_stage(stage: int, args: list[str], pool: Path) -> float:
    """Boost from scratch under the stage's shipped accelerate config; returns the wall time (s)."""
    shutil.rmtree(pool, ignore_errors=True)  # boost resumes a finished run by skipping it all
    options = ["--config_file", str(CONFIGS / f"deepspeed_zero{stage}.yaml")]
    started = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the two processes share the machine's cores
    launched = subprocess.run(accelerate_launch(options, "specboost.training.boost", args), env=env)
    if launched.returncode != 0:
        raise CheckFailed(f"the launch exited with status {launched.returncode} (its output is above)")
    return time.perf_counter() - started


def shard_stage(shard: Path) -> int:
    """The ZeRO stage a DeepSpeed optimizer shard was written at. The file was written a moment ago
    by DeepSpeed, which pickles its own enum types into it, hence weights_only=False."""
    state = torch.load(shard, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    return int(state["zero_stage"])


def check_zero_shards(pool: Path, stage: int) -> None:
    """Each round's last checkpoint holds one ZeRO optimizer shard per process, at `stage`."""
    for i in range(SSMS):
        checkpoint = pool / f"round-{i}" / "checkpoints" / f"checkpoint-{STEPS}"
        shards = sorted(checkpoint.glob("global_step*/*optim_states.pt"))
        if len(shards) != PROCESSES:
            raise CheckFailed(f"{checkpoint}: {len(shards)} ZeRO optimizer shards, expected {PROCESSES}")
        for shard in shards:
            if shard_stage(shard) != stage:
                raise CheckFailed(f"{shard} was written at ZeRO stage {shard_stage(shard)}, not {stage}")


@torch.no_grad()
def distilled_loss(model: PreTrainedModel, rows: list[dict[str, Any]], pad_id: int) -> float:
    """Mean next-token loss on the LLM's output tokens of `rows` (the loss boost trains)."""
    examples = training_examples(rows, {}, context_of(model)).to_list()
    batch = PadCollator(pad_id)(examples)
    return float(model.eval()(**batch).loss)


def check_ssms(args: list[str], pool: Path) -> list[dict[str, float]]:
    """Each saved SSM loads and beats its own untrained start (the same seed) on the distilled data."""
    config = boost.parse_args(args)[0]
    tokenizer, ssm_config, rows = boost.setup(config)
    losses = []
    for i in range(SSMS):
        before = distilled_loss(build_ssm(config, ssm_config, i), rows, tokenizer.pad_token_id)
        trained = AutoModelForCausalLM.from_pretrained(pool / f"ssm-{i}", dtype=torch.float32)
        after = distilled_loss(trained, rows, tokenizer.pad_token_id)
        if not after < before:
            raise CheckFailed(f"ssm-{i}: loss {after:.4f} after training, {before:.4f} before")
        losses.append({"before": before, "after": after})
    return losses


def check_stage(stage: int, llm: Path, distilled: Path, out: Path) -> dict[str, Any]:
    """Run one stage and check it; its wall time and each SSM's loss before and after training."""
    pool = out / f"zero{stage}"
    args = boost_args(llm, distilled, pool)
    seconds = run_stage(stage, args, pool)
    steps = [r["steps"] for r in json.loads((pool / boost.RECORD_FILE).read_text())["rounds"]]
    if steps != [STEPS] * SSMS:
        raise CheckFailed(f"{pool / boost.RECORD_FILE}: rounds of {steps} steps, expected {[STEPS] * SSMS}")
    check_zero_shards(pool, stage)
    return {"seconds": round(seconds, 1), "processes": PROCESSES, "ssm_loss": check_ssms(args, pool)}


def environment() -> dict[str, Any]:
    """Library versions and what DeepSpeed runs on (raises ImportError without DeepSpeed)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    return {
        **library_versions(),
        "deepspeed": metadata.version("deepspeed"),
        "deepspeed_accelerator": accelerator.device_name(),
        "deepspeed_backend": accelerator.communication_backend_name(),
    }


def summary(name: str, result: dict[str, Any]) -> str:
    """One line per stage for the console."""
    if "failed" in result:
        return f"[check-deepspeed] {name} FAILED: {result['failed']}"
    losses = ", ".join(
        f"ssm-{i} loss {loss['before']:.3f} -> {loss['after']:.3f}"
        for i, loss in enumerate(result["ssm_loss"])
    )
    return (
        f"[check-deepspeed] {name} OK: {result['processes']} processes, {result['seconds']:.0f} s; {losses}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run boost-tuning under DeepSpeed ZeRO stages and check it.")
    p.add_argument("--out", type=Path, default=Path("artifacts/deepspeed-check"))
    p.add_argument("--stages", type=int, nargs="+", choices=(2, 3), default=[2, 3])
    a = p.parse_args(argv)
    try:
        versions = environment()
    except ImportError as error:
        print(f"error: {error}: install the `deepspeed` extra (`make check-deepspeed` does)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    started = time.perf_counter()
    llm, distilled = fixtures(a.out)
    results: dict[str, dict[str, Any]] = {}
    for stage in a.stages:
        try:
            results[f"ZeRO-{stage}"] = check_stage(stage, llm, distilled, a.out)
        except CheckFailed as failure:
            results[f"ZeRO-{stage}"] = {"failed": str(failure)}
    ok = all("failed" not in r for r in results.values())
    seconds = time.perf_counter() - started
    record = {"ok": ok, "stages": results, "seconds": round(seconds, 1), "versions": versions}
    write_json_atomic(a.out / "check.json", record)
    for name, result in results.items():
        print(summary(name, result))
    v = versions
    print(
        f"[check-deepspeed] DeepSpeed {v['deepspeed']} ({v['deepspeed_accelerator']} accelerator, "
        f"{v['deepspeed_backend']}), torch {v['torch']}: {'passed' if ok else 'FAILED'} "
        f"in {seconds:.0f} s; {a.out / 'check.json'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
