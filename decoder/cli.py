"""The `specboost` command line: `specboost generate|serve|profile|bench ...`.

    specboost generate --llm artifacts/tiny-models/llm \\
        --ssm artifacts/tiny-models/ssm-0 artifacts/tiny-models/ssm-1 --prompt "Once upon a time"
    specboost generate --llm PATH --pool POOL_DIR|ID --prompt "Once upon a time"
    specboost serve --llm PATH --pool POOL_DIR|ID [--host 127.0.0.1 --port 8000 --api-key KEY]
    specboost profile --llm PATH --ssm PATH [PATH ...] --out POOL_DIR/hardware_profile.json
    specboost bench --llm PATH --ssm PATH [PATH ...] --prompts data/prompts/bench_prompts.txt --out DIR
    specboost bench --suite default|quick|demo|batched|strategies|scheduler|FILE [options]

Models and tokenizers are loaded from folders written by `save_pretrained`; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from specboost import __version__
from specboost.decoder.bench.configurations import FILE_BENCH, FILE_BENCH_OPTIONS, SUITES, resolve_suite
from specboost.decoder.bench.cost_standin import StandinShape, write_standin
from specboost.decoder.bench.protocol import CHECKPOINT, PARTIAL_REPORT, Protocol, Report
from specboost.decoder.bench.suite import BENCH_METHODS, Shapes, SuiteConfig, read_fixture
from specboost.decoder.decoder import SpeculativeDecoder, SpeculativeOutput
from specboost.decoder.pool import SHAPE_KINDS, PoolDefaults, SSMPool
from specboost.decoder.profiler import ProfileConfig, profile, reused_profile
from specboost.decoder.serve.command import add_serve_arguments, bounded, serve
from specboost.decoder.strategies import DEFAULT_BUDGET, STRATEGIES, StrategyOptions
from specboost.decoder.validation import SEED_LIMIT
from specboost.decoder.verify import Rule
from specboost.speculator.cost_model import device_key, load_cost_model, save_cost_model
from specboost.speculator.length_control import CONTROLLERS
from specboost.speculator.loading import (
    DTYPES,
    check_model_path,
    load_causal_lm,
    load_models,
    load_tokenizer,
    resolve_device,
)
from specboost.speculator.predictor import MatchLengthPredictor
from specboost.speculator.sequoia_acceptance import load_acceptance_file
from specboost.speculator.shapes import ChainShape, DraftShape, TopologyShape

THREADS = bounded(int, 1)  # the type of every --threads: torch refuses fewer than one thread
DEFAULT_TOPOLOGY = Shapes().topology_children
_TOPOLOGY_TEXT = json.dumps([list(level) for level in DEFAULT_TOPOLOGY])


def _topology(text: str) -> tuple[tuple[int, ...], ...]:
    """'[[2], [2, 1]]' -> ((2,), (2, 1)): children counts per level (TopologyShape.from_children_counts)."""
    try:
        levels = json.loads(text)
        if not isinstance(levels, list) or not all(
            isinstance(level, list) and all(isinstance(n, int) and n >= 0 for n in level) for level in levels
        ):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected children counts per level as JSON, e.g. '[[2], [2, 1]]', got {text!r}"
        ) from None
    if not any(n for level in levels for n in level):
        raise argparse.ArgumentTypeError(
            f"the topology {text!r} has no node besides the root: it drafts nothing"
        )
    return tuple(tuple(level) for level in levels)


def _add_model_options(
    parser: argparse.ArgumentParser,
    required: bool = True,
    defaults: bool = True,
    ssm_group: argparse._MutuallyExclusiveGroup | None = None,
) -> None:
    """--llm, --ssm, --tokenizer, --dtype, --device; without `defaults` an unset --dtype or --device
    stays None, so that the command can tell it from one given (bench: the suite's own settings).
    `ssm_group`: a required group that --ssm joins as one of its alternatives (generate: --pool)."""
    parser.add_argument(
        "--llm",
        required=required,
        type=Path,
        metavar="PATH",
        help="folder of the target LLM (save_pretrained)",
    )
    (ssm_group or parser).add_argument(
        "--ssm",
        dest="ssms",
        required=required and ssm_group is None,
        type=Path,
        nargs="+",
        action="extend",
        metavar="PATH",
        help="folder(s) of the SSMs; repeat the option or list several paths",
    )
    parser.add_argument(
        "--tokenizer", type=Path, metavar="PATH", help="tokenizer folder (default: the LLM's)"
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="float32" if defaults else None,
        help="model dtype (default: float32)",
    )
    parser.add_argument(
        "--device",
        default="cpu" if defaults else None,
        help="torch device: cpu, cuda, cuda:1 ... (default: cpu)",
    )


def _add_topology_option(parser: argparse._ActionsContainer, used_by: str, defaults: bool = True) -> None:
    parser.add_argument(
        "--topology-children",
        type=_topology,
        default=DEFAULT_TOPOLOGY if defaults else None,
        metavar="JSON",
        help=f"tree for {used_by}: children counts per level as JSON (default: {_TOPOLOGY_TEXT})",
    )


def _add_decoder_options(parser: argparse.ArgumentParser) -> None:
    """The models (--llm with --ssm or --pool) and how they decode: shape, verification, strategy
    (generate and serve build their decoder from these, `build_decoder`)."""
    ssms = parser.add_mutually_exclusive_group()
    _add_model_options(parser, ssm_group=ssms)
    ssms.add_argument(
        "--pool",
        metavar="DIR|ID",
        help="instead of --ssm: an exported SSM pool (`make export`), a folder or a hub id 'org/name', "
        "checked against the LLM and its tokenizer (default tokenizer: the LLM folder's, else the pool's). "
        "Its manifest's decoding choices (strategy, shape, length controller) are the defaults of the "
        "options below, and --predictor, --profile, --acceptance default to the files it ships",
    )
    shape = parser.add_argument_group(
        "draft shape (what every SSM drafts per step)",
        "Unset options take --pool's shape (of the same kind), else the defaults below.",
    )
    shape.add_argument(
        "--shape",
        choices=tuple(SHAPE_KINDS),
        help="(default: the pool's, else chain; none for --strategy sequoia, which builds its own tree)",
    )
    shape.add_argument("--length", type=int, metavar="L", help="chain length (default: the pool's, else 4)")
    shape.add_argument(
        "--chain-samples",
        type=int,
        metavar="K",
        help="with --do-sample: sampled chains per SSM, drawn independently and merged (SpecTr); verify "
        "them with --rule k_sequential (default: the pool's, else 1)",
    )
    shape.add_argument("--width", type=int, metavar="W", help="beam width (default: the pool's, else 2)")
    shape.add_argument("--depth", type=int, metavar="D", help="beam depth (default: the pool's, else 4)")
    _add_topology_option(shape, "--shape topology", defaults=False)
    verification = parser.add_argument_group("verification")
    verification.add_argument(
        "--rule",
        choices=[r.value for r in Rule],
        help="verification rule (default: greedy; with --do-sample: mss for chain, target for beam, "
        "without_replacement for topology with one SSM, target for topology with several; k_sequential: "
        "SpecTr's k-sequential selection for sampled chains, never accepting less than mss)",
    )
    verification.add_argument(
        "--verification",
        choices=("tree", "stairs"),
        default="tree",
        help="tree: one tree-attention pass; stairs: a batch of growing prefixes (greedy, one SSM, chain "
        "shape) (default: tree)",
    )

    strategy = parser.add_argument_group("strategy")
    strategy.add_argument(
        "--strategy",
        choices=STRATEGIES,
        help="pool: every SSM drafts the shape above, trees merged; learned: the learned scheduler picks a "
        "beam per SSM and step (needs --predictor); majority: only the weighted-majority chain is verified; "
        "pruned: the merged tree cut to --budget nodes by SSM weight; sequoia: one SSM fills a DP-optimal "
        "tree (needs --acceptance, and --nodes or --profile); plain: speculation off, the LLM alone (no "
        "--ssm or --pool) (default: the pool's, else pool; an exported pool with a predictor and a hardware "
        "profile recommends learned, and a shape option or --length-controller over it means pool; given, "
        "it replaces the pool's whole choice: its shape and length controller are not used)",
    )
    strategy.add_argument(
        "--length-controller",
        choices=sorted(CONTROLLERS),
        help="adapt the chain length every step (pool, majority, pruned with chain shapes): minions "
        "(Minions 3.3) or bass (BASS Algorithm 1) (default: the pool's, else a fixed --length)",
    )
    strategy.add_argument(
        "--budget",
        type=int,
        metavar="N",
        help=f"pruned: drafted nodes kept per step (default: {DEFAULT_BUDGET})",
    )
    strategy.add_argument(
        "--nodes",
        type=int,
        metavar="N",
        help="sequoia: tree size, root included (default: chosen for this hardware from --profile)",
    )
    strategy.add_argument(
        "--max-tree-depth",
        type=int,
        metavar="D",
        help="sequoia: depth bound of the tree (default: none with --nodes, 16 with --profile)",
    )
    strategy.add_argument(
        "--acceptance",
        type=Path,
        metavar="FILE",
        help="sequoia: acceptance vectors, one per --ssm (`make sequoia-acceptance` writes them; default: "
        "the pool's)",
    )
    strategy.add_argument(
        "--sequoia-ssm",
        type=int,
        metavar="I",
        help="sequoia: the SSM that drafts (default: the most promising)",
    )
    strategy.add_argument(
        "--predictor",
        type=Path,
        metavar="DIR",
        help="match-length predictor folder (make predictor; default: the pool's)",
    )
    strategy.add_argument(
        "--profile",
        type=Path,
        metavar="FILE",
        help="hardware_profile.json from `specboost profile` (default: the pool's for this device; "
        "learned: else measured on the spot; sequoia: picks the tree size)",
    )
    strategy.add_argument(
        "--force-profile", action="store_true", help="use a profile measured on other hardware"
    )
    parser.add_argument(
        "--threads",
        type=THREADS,
        metavar="N",
        help="torch CPU threads (default: torch's); a hardware profile holds for the thread count it was "
        "measured at (`make demo` measures at 1)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specboost", description="Lossless speculative decoding with a pool of small speculative models."
    )
    parser.add_argument("--version", action="version", version=f"specboost {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text from one prompt with SpeculativeDecoder")
    _add_decoder_options(gen)
    gen.add_argument("--prompt", required=True, metavar="TEXT", help="the prompt text")
    gen.add_argument(
        "--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate (default: 64)"
    )
    gen.add_argument(
        "--stop",
        nargs="+",
        action="extend",
        metavar="STRING",
        help="stop strings: generation ends with the token that completes one (that token is kept)",
    )
    gen.add_argument("--json", action="store_true", help="print text and stats as one JSON object")
    sampling = gen.add_argument_group("sampling (unset options come from the LLM's generation_config)")
    sampling.add_argument(
        "--do-sample", action=argparse.BooleanOptionalAction, default=None, help="sample instead of greedy"
    )
    sampling.add_argument("--temperature", type=bounded(float), metavar="T", help="sampling temperature")
    sampling.add_argument("--top-k", type=int, metavar="K", help="keep the K most likely tokens (0 = off)")
    sampling.add_argument(
        "--top-p", type=bounded(float), metavar="P", help="nucleus sampling threshold (1.0 = off)"
    )
    sampling.add_argument(
        "--seed",
        type=bounded(int, 0, SEED_LIMIT - 1),
        metavar="S",
        help="seed for reproducible sampling",
    )

    server = commands.add_parser(
        "serve",
        help="an OpenAI-compatible server (/v1/completions, /v1/chat/completions, streaming, /metrics) "
        "on the serving engine",
    )
    _add_decoder_options(server)
    add_serve_arguments(server)

    prof = commands.add_parser(
        "profile", help="measure verify and speculation latencies on this machine (learned scheduler)"
    )
    _add_model_options(prof)
    prof.add_argument(
        "--out",
        required=True,
        type=Path,
        metavar="FILE",
        help="profile file to add this device's entry to, e.g. POOL_DIR/hardware_profile.json",
    )
    prof.add_argument("--repeats", type=int, default=5, metavar="N", help="timed rounds (default: 5)")
    prof.add_argument(
        "--prefix-length",
        type=int,
        default=64,
        metavar="N",
        help="cached tokens before the tree (default: 64)",
    )
    prof.add_argument(
        "--threads", type=THREADS, metavar="N", help="torch CPU threads (default: torch's default)"
    )
    prof.add_argument(
        "--compile",
        action="store_true",
        help="also measure the learned scheduler's chain costs on the compiled loop (compiles its "
        "passes: minutes on a CPU); a compiled decoder then takes those",
    )
    prof.add_argument(
        "--sampled",
        action="store_true",
        help="also time sampled chains' drafting, which the learned scheduler then prices sampled "
        "decoding with (for a pool that samples: the chain runs take about twice as long); without "
        "it, sampled chains are priced as greedy ones and corrected online",
    )
    prof.add_argument(
        "--like",
        type=Path,
        metavar="FILE",
        help="a profile of models of the same architectures (another pool of the same sizes beside the "
        "same LLM), measured here with these options: its figures are copied and nothing is timed; "
        "where it does not fit, the reason is printed and the models are profiled",
    )

    standin = commands.add_parser(
        "standin",
        help="a cost stand-in for a large LLM: the LLM widened with zero weights to a large model's "
        "shapes, computing the same function, with a copy of its pool (to benchmark a GPU at real "
        "model sizes with the pool's real drafts)",
    )
    standin.add_argument("--llm", required=True, type=Path, metavar="PATH", help="folder of the LLM")
    standin.add_argument(
        "--pool", required=True, type=Path, metavar="FOLDER", help="the LLM's exported pool (make export)"
    )
    for flag, meaning in (
        ("--hidden-size", "hidden size, a multiple of the LLM's (its heads scale with it)"),
        ("--intermediate-size", "MLP width, at least the LLM's"),
        ("--layers", "number of layers, at least the LLM's"),
    ):
        standin.add_argument(flag, required=True, type=int, metavar="N", help=f"the stand-in's {meaning}")
    standin.add_argument(
        "--dtype", choices=sorted(DTYPES), help="dtype of the stand-in's weights (default: the LLM's)"
    )
    standin.add_argument(
        "--out", required=True, type=Path, metavar="DIR", help="new folder: DIR/llm and DIR/pool"
    )

    bench = commands.add_parser(
        "bench",
        help="measure: our modes against plain and HF assisted generation on a prompt file (greedy), or a "
        "configuration of the harness (--suite): the benchmark suite, batched decoding, the strategies, the "
        "learned scheduler",
    )
    # Unset options stay None: each configuration keeps its own settings where none is given.
    _add_model_options(bench, required=False, defaults=False)
    bench.add_argument(
        "--prompts",
        type=Path,
        metavar="FILE",
        help=".txt (one prompt per line) or .jsonl file (strategies, scheduler: or a bundled set's name)",
    )
    bench.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="folder for the report (default with --suite: ARTIFACTS/bench-suite/<fixture, or the --llm "
        "folder's name>, ARTIFACTS/batch-bench, ARTIFACTS/strategy-compare, ARTIFACTS/scheduler-eval); "
        f"a run killed midway resumes from DIR/{CHECKPOINT} (delete it to start over)",
    )
    _add_suite_options(bench)
    bench.add_argument("--max-new-tokens", type=int, metavar="N", help="tokens per prompt (default: 64)")
    bench.add_argument(
        "--repeats", type=int, metavar="N", help="timed runs per method and prompt (default: 3)"
    )
    bench.add_argument("--warmup", type=int, metavar="N", help="untimed runs per method first (default: 1)")
    bench.add_argument("--max-prompts", type=int, metavar="N", help="use only the first N prompts")
    bench.add_argument(
        "--methods",
        nargs="+",
        choices=BENCH_METHODS,
        metavar="METHOD",
        help=f"method families to run, from {', '.join(BENCH_METHODS)}; plain always runs (default: all)",
    )
    bench.add_argument(
        "--chain-length",
        type=int,
        metavar="L",
        help="chain length for chain, stairs, pool_chain (default: 4)",
    )
    bench.add_argument("--beam-width", type=int, metavar="W", help="beam width for pool_beam (default: 2)")
    bench.add_argument("--beam-depth", type=int, metavar="D", help="beam depth for pool_beam (default: 4)")
    _add_topology_option(bench, "pool_topology", defaults=False)
    bench.add_argument(
        "--threads", type=THREADS, metavar="N", help="torch CPU threads (default: torch's default; suites: 1)"
    )
    batched = bench.add_argument_group("--suite batched")
    batched.add_argument(
        "--prompt-sets", nargs="+", metavar="NAME", help="bundled sets whose held-out prompts mix"
    )
    batched.add_argument(
        "--num-prompts", type=int, metavar="N", help="prompts submitted at once (default: 32)"
    )
    batched.add_argument("--batch-sizes", type=int, nargs="+", metavar="B", help="(default: 1 2 4 8 16)")
    batched.add_argument("--num-groups", type=int, metavar="N", help="engine groups in flight (default: 2)")
    bench.add_argument_group("--suite scheduler").add_argument(
        "--force-profile", action="store_true", help="use a hardware profile measured on other hardware"
    )
    return parser


def _add_suite_options(bench: argparse.ArgumentParser) -> None:
    suite = bench.add_argument_group(
        "configurations",
        "--suite runs a configuration: the suite (default, quick, or a JSON file of SuiteConfig settings) on "
        "its fixture's models, or on --llm with --pool; batched (--llm, --ssm); strategies and scheduler "
        "(--llm, --pool; strategies: --ssm I names the SSM of its trees and lengths). The options given "
        "override the configuration's settings; one it does not take is refused.",
    )
    suite.add_argument(
        "--suite",
        metavar="NAME|FILE",
        help=f"run a configuration: {', '.join(SUITES)}, or a JSON file of SuiteConfig settings",
    )
    suite.add_argument("--fixture", metavar="NAME", help="override the suite's fixture (tiny, small)")
    suite.add_argument(
        "--pool",
        metavar="FOLDER|ID",
        help="with --llm: an exported pool for that LLM (make export); the suite runs on them instead of "
        "the fixture; the learned scheduler and Sequoia run when the pool ships their files",
    )
    suite.add_argument(
        "--sampled-pool",
        metavar="FOLDER|ID",
        help="with --llm and --pool: an exported pool trained for sampling (boost --boost-mode sampled); the "
        "sampled rows run on it, the greedy rows on --pool (the fixture has its own)",
    )
    suite.add_argument(
        "--spec-bench", type=Path, metavar="FILE", help="a Spec-Bench question file (JSONL) as the workloads"
    )
    suite.add_argument(
        "--artifacts", type=Path, default=Path("artifacts"), metavar="DIR", help="(default: artifacts)"
    )
    suite.add_argument(
        "--readme",
        type=Path,
        metavar="FILE",
        help="also write the full results into docs/results.md beside this README and the headline table "
        "into the README (between their marker lines)",
    )
    suite.add_argument("--dry-run", action="store_true", help="say which models the suite would run on")


# generate ---------------------------------------------------------------------------------------
# A shape's field -> the dest of its generate option.
SHAPE_OPTIONS = {"length": "length", "samples": "chain_samples", "width": "width", "depth": "depth"}
FIXED_SHAPE_FLAGS = ("shape", "topology_children", "length_controller")  # with SHAPE_OPTIONS


def _shape(args: argparse.Namespace, default: DraftShape | None) -> DraftShape | None:
    """The draft shape from --shape and its options over `default` (the pool's shape, else the
    decoder's; None for sequoia, which builds its own tree): the kind from --shape, else the
    default's; each parameter from its option, else the default's if of that kind, else the kind's."""
    if args.shape is None and default is None:
        if given := [
            d for d in (*SHAPE_OPTIONS.values(), "topology_children") if getattr(args, d) is not None
        ]:
            flags = ", ".join("--" + d.replace("_", "-") for d in given)
            raise ValueError(
                f"{flags} set a draft shape, but sequoia builds its own tree and plain drafts nothing"
            )
        return None
    name = args.shape or next(k for k, kind in SHAPE_KINDS.items() if isinstance(default, kind))
    kind = SHAPE_KINDS[name]
    if args.chain_samples is not None and kind is not ChainShape:
        raise ValueError(f"--chain-samples is for --shape chain, not --shape {name}")
    base = default if isinstance(default, kind) else None
    if kind is TopologyShape:
        if args.topology_children is None and base is not None:
            return base
        children = args.topology_children or DEFAULT_TOPOLOGY
        return TopologyShape.from_children_counts([list(level) for level in children])
    given = {f.name: getattr(args, SHAPE_OPTIONS[f.name]) for f in fields(kind)}
    return replace(base or kind(), **{k: v for k, v in given.items() if v is not None})


def format_stats(out: SpeculativeOutput) -> str:
    s = out.stats
    per_ssm = ", ".join(f"SSM {i} {a:.2f}" for i, a in s.acceptance_rate_per_ssm.items())
    return "\n".join(
        [
            f"{s.new_tokens} new tokens (finish: {out.finish_reason}) in {s.llm_steps} LLM steps: "
            f"{s.tokens_per_step:.2f} tokens/step",
            f"acceptance {s.acceptance_rate:.2f} ({s.accepted_tokens}/{s.draft_tokens} drafted; {per_ssm})",
            f"time {s.time_total:.3f} s (draft {s.time_draft:.3f}, verify {s.time_verify:.3f}, "
            f"other {s.time_other:.3f}): {s.tokens_per_second:.1f} tokens/s",
        ]
    )


def _decoder_options(
    args: argparse.Namespace,
    defaults: PoolDefaults,
    pool: SSMPool | None,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """SpeculativeDecoder's keywords from generate's options; unset ones from `defaults` (the
    pool's decoding choices, else the decoder's). A given --strategy replaces the pool's whole
    choice, as strategy= does in `SpeculativeDecoder.from_pretrained`; a shape option or
    --length-controller over a learned default asks for a fixed shape: strategy pool."""
    choice = defaults if args.strategy is None else PoolDefaults(args.strategy)
    fixed = [d for d in (*FIXED_SHAPE_FLAGS, *SHAPE_OPTIONS.values()) if getattr(args, d) is not None]
    if args.strategy is None and choice.strategy == "learned" and fixed:
        choice = PoolDefaults("pool")
    predictor = MatchLengthPredictor.from_pretrained(args.predictor) if args.predictor else None
    # An explicit --strategy learned needs a predictor; one the pool recommends without shipping one
    # falls back to its fixed shape with the decoder's warning.
    if args.strategy == "learned" and predictor is None and (pool is None or pool.predictor is None):
        raise ValueError(
            "--strategy learned needs --predictor DIR (train one with `make predictor`), or a --pool that "
            "ships one"
        )
    cost_model = None
    if args.profile is not None:
        cost_model = load_cost_model(args.profile, device_key(device, dtype), args.force_profile)
    options = StrategyOptions(
        budget=args.budget,
        nodes=args.nodes,
        depth=args.max_tree_depth,
        acceptance=load_acceptance_file(args.acceptance) if args.acceptance is not None else None,
        ssm=args.sequoia_ssm,
    )
    return {
        "strategy": choice.strategy,
        "shape": _shape(args, choice.shape),
        "length_controller": args.length_controller or choice.length_controller,
        "rule": args.rule,
        "verification": args.verification,
        "predictor": predictor,
        "cost_model": cost_model,
        "force_profile": args.force_profile,
        "strategy_options": options,
    }


def build_decoder(args: argparse.Namespace) -> SpeculativeDecoder:
    """The decoder of generate's and serve's options: --llm with --ssm or --pool (neither with
    --strategy plain, which drafts nothing)."""
    device, dtype = resolve_device(args.device), DTYPES[args.dtype]  # before anything loads
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.strategy == "plain":
        if args.ssms or args.pool:
            raise ValueError("--strategy plain drafts nothing: drop --ssm / --pool")
        options = _decoder_options(args, PoolDefaults("plain"), None, device, dtype)
        llm = load_causal_lm(args.llm, dtype, device)
        return SpeculativeDecoder(llm, [], load_tokenizer(args.tokenizer or args.llm), **options)
    if args.pool is None:
        if not args.ssms:
            raise ValueError("give the SSMs: --ssm PATH [PATH ...] or --pool DIR|ID (or --strategy plain)")
        options = _decoder_options(args, PoolDefaults(), None, device, dtype)
        models = load_models(args.llm, args.ssms, args.tokenizer, args.dtype, args.device)
        return SpeculativeDecoder(
            models.llm, models.ssms, models.tokenizer, ssm_tokenizers=models.ssm_tokenizers, **options
        )
    pool = SSMPool.from_pretrained(args.pool, device, dtype)
    options = _decoder_options(args, pool.defaults, pool, device, dtype)
    if (
        args.strategy is None
        and options["strategy"] == "learned"
        and not (args.profile or args.force_profile)
    ):
        pool = pool.for_recommended_learned(device, dtype)  # its profile, if of this machine
    return SpeculativeDecoder.from_pretrained(
        args.llm, pool, args.tokenizer, device=device, dtype=dtype, **options
    )


def generate(args: argparse.Namespace) -> int:
    decoder = build_decoder(args)
    tokenizer = decoder.tokenizer
    inputs = tokenizer(args.prompt, return_tensors="pt").to(decoder.llm.device)
    with torch.inference_mode():
        out = decoder.generate(
            inputs.input_ids,
            attention_mask=inputs.attention_mask,
            max_new_tokens=args.max_new_tokens,
            do_sample=args.do_sample,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            stop_strings=args.stop,
            seed=args.seed,
        )
    new_tokens = out.sequences[0, inputs.input_ids.shape[1] :]
    text = tokenizer.decode(new_tokens, skip_special_tokens=True)
    if args.json:
        print(json.dumps({"text": text, "finish_reason": out.finish_reason, "stats": out.stats.to_dict()}))
    else:
        print(text)
        print(format_stats(out), file=sys.stderr)
    return 0


# serve ------------------------------------------------------------------------------------------
def serve_command(args: argparse.Namespace) -> int:
    return serve(args, lambda: build_decoder(args))


# profile ----------------------------------------------------------------------------------------
def profile_command(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    models = load_models(args.llm, args.ssms, args.tokenizer, args.dtype, args.device)
    config = ProfileConfig(
        prefix_length=args.prefix_length,
        repeats=args.repeats,
        compile=args.compile,
        sampled=args.sampled,
    )
    cost = None
    if args.like is not None:
        try:
            like = load_cost_model(args.like, device_key(models.llm.device, models.llm.dtype))
            cost = reused_profile(like, models.llm, models.ssms, config)
            print(f"{args.like}: measured on models of these architectures here; its figures reused")
        except ValueError as why:
            print(f"{args.like} not reused ({why}): profiling")
    if cost is None:
        cost = profile(models.llm, models.ssms, config)
    save_cost_model(cost, args.out)
    sizes = ", ".join(
        f"{n}: {t * 1e3:.2f}" for n, t in zip(cost.verify_tokens, cost.verify_seconds, strict=True)
    )
    print(f"{cost.device}\nL_verify(n tokens) ms: {sizes}")
    for i, step in enumerate(cost.ssm_step_seconds):
        print(f"SSM {i}: one step {step * 1e3:.2f} ms; L_speculate(b, d) ms: ", end="")
        print(", ".join(f"{k}: {t * 1e3:.2f}" for k, t in cost.speculate_seconds[i].items()))
    print(f"wrote {args.out}")
    return 0


def standin_command(args: argparse.Namespace) -> int:
    shape = StandinShape(args.hidden_size, args.intermediate_size, args.layers)
    dtype = None if args.dtype is None else DTYPES[args.dtype]
    llm, pool = write_standin(args.llm, args.pool, shape, args.out, dtype)
    sizes = f"hidden_size {shape.hidden_size}, intermediate_size {shape.intermediate_size}"
    print(f"wrote {llm} ({sizes}, num_hidden_layers {shape.num_hidden_layers}) and {pool}")
    print(
        "its pool has no hardware profile yet; measure one where it will run, e.g. "
        f"`specboost profile --llm {llm} --ssm {pool}/ssm-* --device cuda --out {pool}/hardware_profile.json`"
    )
    return 0


# bench ------------------------------------------------------------------------------------------
RUN_OPTIONS = ("readme", "dry_run")  # how a suite runs, not what it measures
GENERAL = ("command", "suite", "out", "artifacts")


def _flag(dest: str) -> str:
    return "--ssm" if dest == "ssms" else "--" + dest.replace("_", "-")


def _given(args: argparse.Namespace) -> dict[str, object]:
    """The bench options given on the command line (unset ones are None or False), paths as text."""
    given = {}
    for dest, value in vars(args).items():
        if dest in GENERAL or value is None or value is False:
            continue
        if isinstance(value, list):
            value = tuple(str(v) if isinstance(v, Path) else v for v in value)
        given[dest] = str(value) if isinstance(value, Path) and dest not in RUN_OPTIONS else value
    return given


def bench_usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with this combination of bench options, or None."""
    given = _given(args)
    if args.suite is None:
        if args.pool is not None:
            return "--pool is a benchmark-suite option: add --suite NAME|FILE, or give SSM folders with --ssm"
        options = {"llm": "--llm", "ssms": "--ssm", "prompts": "--prompts", "out": "--out"}
        missing = [option for name, option in options.items() if getattr(args, name) is None]
        if missing:
            return f"bench needs {', '.join(missing)} (or --suite)"
        refused = [_flag(dest) for dest in given if dest not in FILE_BENCH_OPTIONS]
        return f"{', '.join(refused)} need --suite" if refused else None
    takes = SUITES[args.suite].options if args.suite in SUITES else SuiteConfig.options
    refused = [_flag(dest) for dest in given if dest not in takes]
    if refused:
        return f"{', '.join(refused)} cannot be used with --suite {args.suite}: it takes " + ", ".join(
            _flag(dest) for dest in takes
        )
    if isinstance(SUITES.get(args.suite, SuiteConfig()), SuiteConfig):
        if (args.llm is None) != (args.pool is None):
            return "--suite with your own models needs both --llm and --pool (a pool exported for that LLM)"
        if args.llm is not None and args.fixture is not None:
            return "--fixture and --llm/--pool both choose the suite's models: give one of them"
    return None


def bench_config(args: argparse.Namespace) -> Protocol:
    """The configuration `bench` runs, with the options given over its settings."""
    settings = {k: v for k, v in _given(args).items() if k not in RUN_OPTIONS}
    if args.suite is None:
        return SuiteConfig(**FILE_BENCH, prompts=settings.pop("prompts")).with_options(**settings)
    return resolve_suite(args.suite).with_options(**settings)


def bench(args: argparse.Namespace) -> int:
    config = bench_config(args)
    if args.dry_run:
        if config.llm is not None:
            print(f"no fixture to build: the suite would run on {config.llm} with the pool {config.pool}")
        else:
            paths = read_fixture(args.artifacts, config.fixture)["paths"]
            print(f"the suite would run on the fixture {config.fixture}: {paths['llm']}, {paths['export']}")
        return 0
    out = args.out or args.artifacts / config.folder()

    def on_table(so_far: Report) -> None:
        if (partial := config.write_partial(so_far, out)) is not None:
            print(f"[bench] the tables so far: {partial}", file=sys.stderr)

    report = config.run(
        log=lambda line: print(line, file=sys.stderr),
        artifacts=args.artifacts,
        on_table=on_table,
        checkpoint=out / CHECKPOINT,
    )
    print(config.write(report, out, args.readme))
    for leftover in (PARTIAL_REPORT, CHECKPOINT):
        (out / leftover).unlink(missing_ok=True)
    print(f"wrote {out}")
    if differing := report.differing():
        print(f"error: greedy output differs from plain llm.generate for {differing}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench" and (problem := bench_usage_error(args)) is not None:
        parser.error(problem)
    try:
        ssms = [] if getattr(args, "suite", None) == "strategies" else getattr(args, "ssms", None) or []
        models = [] if args.llm is None else [args.llm, *ssms]
        for path in models:  # fail fast, before anything loads
            check_model_path(path)
        commands = {
            "generate": generate,
            "serve": serve_command,
            "profile": profile_command,
            "standin": standin_command,
            "bench": bench,
        }
        return commands[args.command](args)
    except (FileNotFoundError, FileExistsError, ValueError, NotImplementedError) as error:
        print(f"specboost {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
