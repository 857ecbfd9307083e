"""Measure the acceptance vector of every SSM of a pool and print Sequoia's best trees
(ALGORITHMS.md section 8):

    python -m specboost.training.sequoia_trees --llm artifacts/reference-llm/tiny/model \\
        --ssm artifacts/pool/ssm-* --distilled artifacts/distill/tinystories_openings \\
        --held-out-from artifacts/pool/boost_record.json --out artifacts/pool/sequoia_acceptance.json

(`make sequoia-acceptance`). The file `--out` is the pool's `sequoia_acceptance.json`: one vector
per SSM, in the order given, which `make export` ships with the pool for `strategy="sequoia"`.
Per SSM, the table compares, for n nodes in all (root included), the expected tokens per step of
the Sequoia tree with k independent chains sharing the n - 1 drafts and with one chain, all under
the same positional acceptance model (`sequoia_dp.chains_shape` says why k chains are a tree
there); `--decode N` also measures the Sequoia trees' real tokens per step on N samples.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel

from specboost.decoder.decoder import SpeculativeDecoder
from specboost.decoder.generation_options import requested_sampling
from specboost.speculator.loading import load_models
from specboost.speculator.sampling import SamplingConfig
from specboost.speculator.sequoia import SequoiaSpeculator
from specboost.speculator.sequoia_acceptance import AcceptanceVector, save_acceptance_file
from specboost.speculator.sequoia_dp import tree_vs_chains
from specboost.training.sequoia_acceptance import Sample, distilled_samples, estimate_acceptance


def table_sizes(max_nodes: int) -> list[int]:
    """2, 4, 8, ... up to max_nodes, and max_nodes itself."""
    sizes = [n for n in (2**i for i in range(1, max_nodes.bit_length())) if n < max_nodes]
    return [*sizes, max_nodes]


def measure(
    llm: PreTrainedModel,
    ssm: PreTrainedModel,
    acceptance: AcceptanceVector,
    samples: Sequence[Sample],
    nodes: int,
    max_depth: int | None,
) -> float:
    """Real tokens per step of the Sequoia tree on the samples' contexts (as many new tokens as
    each continuation holds), decoded as the acceptance vector was measured."""
    speculator = SequoiaSpeculator(ssm, acceptance, nodes=nodes, depth=max_depth)
    decoder = SpeculativeDecoder(llm, [ssm], speculator=speculator)
    sampling = acceptance.sampling
    new_tokens = steps = 0
    for seed, (context, continuation) in enumerate(samples):
        out = decoder.generate(
            torch.tensor([list(context)], device=llm.device),
            max_new_tokens=len(continuation),
            do_sample=sampling.do_sample,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            seed=seed,
        )
        new_tokens, steps = new_tokens + out.stats.new_tokens, steps + out.stats.llm_steps
    return new_tokens / steps


def format_table(acceptance: AcceptanceVector, rows: list[dict], chains: Sequence[int]) -> str:
    lines = [
        f"acceptance ({acceptance.rule}, {acceptance.num_positions} positions): "
        f"p = {[round(x, 3) for x in acceptance.p]}",
        f"marginal weights = {[round(x, 3) for x in acceptance.marginal]}",
        "expected tokens per step (positional model):",
    ]
    header = ["nodes", "sequoia", "depth", "chain", *(f"{k} chains" for k in chains)]
    if "measured" in rows[0]:
        header.append("measured")
    lines.append("".join(f"{h:>10}" for h in header))
    for row in rows:
        cells = [str(row["nodes"]), f"{row['sequoia']:.3f}", str(row["sequoia_depth"])]
        cells += [f"{row['chains'][k]:.3f}" if k in row["chains"] else "-" for k in (1, *chains)]
        if "measured" in row:
            cells.append(f"{row['measured']:.3f}")
        lines.append("".join(f"{c:>10}" for c in cells))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Measure SSMs' acceptance vectors; print Sequoia's best trees.")
    p.add_argument("--llm", type=Path, required=True, help="LLM folder (save_pretrained)")
    p.add_argument("--ssm", type=Path, nargs="+", required=True, help="SSM folder(s), in pool order")
    p.add_argument("--distilled", type=Path, required=True, help="a finished distillation run folder")
    p.add_argument("--held-out-from", type=Path, help="boost_record.json: score only its held_out_ids")
    p.add_argument("--max-samples", type=int, help="use at most this many samples")
    p.add_argument("--rule", choices=["greedy", "without_replacement"], default="greedy")
    p.add_argument("--temperature", type=float, default=1.0, help="for --rule without_replacement")
    settings = "for --rule without_replacement (default: the LLM's generation config, else transformers' %s)"
    p.add_argument("--top-k", type=int, help=settings % "50")
    p.add_argument("--top-p", type=float, help=settings % "1.0")
    p.add_argument("--width", type=int, default=8, help="ranks measured: children per node (default 8)")
    p.add_argument("--simulations", type=int, default=8, help="Monte Carlo replays per position")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-nodes", type=int, default=64)
    p.add_argument("--max-depth", type=int, help="depth bound of the Sequoia trees (default: none)")
    p.add_argument("--chains", type=int, nargs="*", default=[2, 4, 8], help="k of the k-chain columns")
    p.add_argument("--decode", type=int, default=0, metavar="N", help="measure tokens/step on N samples")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--out", type=Path, help="write the acceptance file (vectors and tables) here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        if args.rule == "greedy" and (args.top_k is not None or args.top_p is not None):
            raise ValueError("--top-k and --top-p apply to --rule without_replacement only")
        models = load_models(args.llm, args.ssm, dtype=args.dtype)
        samples = distilled_samples(args.distilled, args.held_out_from, args.max_samples)
        sampling = SamplingConfig()  # greedy
        if args.rule == "without_replacement":  # as a request at these settings samples p and q
            given = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
            sampling = requested_sampling(models.llm, **given)
    except (FileNotFoundError, KeyError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    vectors, tables = [], []
    for path, ssm in zip(args.ssm, models.ssms, strict=True):
        acceptance = estimate_acceptance(
            models.llm,
            ssm,
            samples,
            k=args.width,
            sampling=sampling,
            simulations=args.simulations,
            seed=args.seed,
        )
        rows = tree_vs_chains(acceptance.marginal, table_sizes(args.max_nodes), args.chains, args.max_depth)
        for row in rows if args.decode else ():
            row["measured"] = measure(
                models.llm, ssm, acceptance, samples[: args.decode], row["nodes"], args.max_depth
            )
        print(f"SSM {path}\n{format_table(acceptance, rows, args.chains)}\n")
        vectors.append(acceptance)
        tables.append(rows)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        ssms = [str(path) for path in args.ssm]
        save_acceptance_file(vectors, args.out, ssms=ssms, samples=len(samples), tables=tables)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
