"""The README's decoding example, runnable: `make example` or

    python -m specboost.decoder.example [--models-dir artifacts/tiny-models]

It builds the tiny stand-in models (random weights, see `tiny_models`), loads them from disk,
decodes one prompt with a pool of two SSMs, prints the text and the statistics, and checks that
the greedy output is token-for-token `llm.generate`'s. The code between the README markers below
is the README's example, verbatim (tests/test_cli_bench.py keeps them in sync).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specboost.decoder import ChainShape, SpeculativeDecoder
from specboost.decoder.tiny_models import build_tiny_models


def run_example(models_dir: Path) -> None:
    # --- README example ---
    llm_path, ssm_paths = build_tiny_models(models_dir)  # random stand-ins: llm/, ssm-0/, ssm-1/
    tok = AutoTokenizer.from_pretrained(llm_path)
    llm = AutoModelForCausalLM.from_pretrained(llm_path)
    ssms = [AutoModelForCausalLM.from_pretrained(path) for path in ssm_paths]

    decoder = SpeculativeDecoder(llm, ssms=ssms, tokenizer=tok, shape=ChainShape(4))
    inputs = tok("Once upon a time", return_tensors="pt")
    out = decoder.generate(inputs.input_ids, attention_mask=inputs.attention_mask, max_new_tokens=48)

    new_tokens = out.sequences[0, inputs.input_ids.shape[1] :]
    print("text:", repr(tok.decode(new_tokens, skip_special_tokens=True)))  # gibberish: random weights
    s = out.stats
    print(f"{s.new_tokens} tokens in {s.llm_steps} LLM steps: {s.tokens_per_step:.2f} tokens/step")
    print(f"acceptance {s.acceptance_rate:.2f}, per SSM {s.acceptance_rate_per_ssm}")
    print(f"seconds: draft {s.time_draft:.3f}, verify {s.time_verify:.3f}, total {s.time_total:.3f}")

    # Greedy speculative decoding is lossless: exactly the tokens the LLM generates alone.
    reference = llm.generate(**inputs, max_new_tokens=48, do_sample=False)
    if not torch.equal(out.sequences, reference):
        raise RuntimeError("speculative output differs from llm.generate")
    print("identical to llm.generate: yes")
    # --- end of README example ---


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specboost.decoder.example", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--models-dir",
        type=Path,
        default=Path("artifacts/tiny-models"),
        help="where the tiny models are built, or found if already there (default: artifacts/tiny-models)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny models: thread start-up costs more than it saves
    run_example(args.models_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
