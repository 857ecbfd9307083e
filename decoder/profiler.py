"""Measure the hardware cost model on this machine (ALGORITHMS.md sections 5 and 8).

    specboost profile --llm PATH --pool POOL_DIR            # writes POOL_DIR/hardware_profile.json

Everything is timed through the decoder's own code paths: L_verify(n) is the LLM's `TreeCache`
pass over an n-node tree after `prefix_length` cached tokens, followed by the commit a real step
does (the root kept); L_speculate(b, d) is `PoolDrafter.draft_one` of a beam tree after the same prefix
(the steady-state cache catch-up of one token included). The chain tables of the routed scheduler
(section 5.3) are timed as the decode loop runs its steps, at every batch size of `batch_sizes`: a
drafting step is each SSM's `BatchedChainDrafter.draft_greedy` of a d-token chain in every row (a
one-token catch-up first) followed by the LLM's pass over those chains, each part timed, so that
each part pays for the other's passes having pushed its weights out of the CPU's caches, as it does
in the loop; a plain step is the LLM's one-node pass after another one. With `sampled`, each SSM
also drafts sampled chains (`BatchedChainDrafter.draft` at temperature SAMPLED_TEMPERATURE, the
tokens read back as sampled decoding reads them) in the same steps. Each number is the median
of `repeats` timed runs, each after `ProfileConfig.settle` untimed runs of itself (the steps before
it in a stretch of that action); CUDA is synchronised around every timed part. SSMs of one
architecture (`cost_twins`) are timed once, their rows of the tables shared.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from specboost.decoder.compilation import ModelCalls
from specboost.decoder.validation import model_name
from specboost.speculator.batched_drafter import BatchedChainDrafter
from specboost.speculator.cost_model import DRAFTING_TABLES, CostModel, device_key
from specboost.speculator.drafter import PoolDrafter
from specboost.speculator.kv_cache import CompiledPass, TreeCache, capacity_for
from specboost.speculator.predictor import DEPTHS, WIDTHS
from specboost.speculator.sampling import LogitsToProbs, SamplingConfig
from specboost.speculator.shapes import BeamShape, ChainShape
from specboost.speculator.tree import ChainDraft, TokenTree, TreeBatch

COMPILED = "compiled "  # the names of the compiled runs start with it
SAMPLED = "sampled "  # the names of the sampled chains' drafting runs start with it
SAMPLED_TEMPERATURE = 0.8  # a temperature warper, as sampled requests usually have


@dataclass(frozen=True)
class ProfileConfig:
    widths: tuple[int, ...] = WIDTHS
    depths: tuple[int, ...] = DEPTHS
    verify_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)  # rows of the chain tables (section 5.3)
    compile: bool = False  # also the chain tables on the compiled loop (compiles their passes)
    sampled: bool = False  # also the sampled chains' drafting tables (for a pool that samples)
    prefix_length: int = 64
    repeats: int = 5
    settle: int = 8  # untimed runs of a shape before each timed one (see `_interleaved_medians`)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.prefix_length < 1 or self.settle < 1:
            raise ValueError("repeats, settle and prefix_length must be >= 1")
        if min(self.verify_sizes) < 1:
            raise ValueError("verify sizes count tree nodes, root included: they must be >= 1")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError("batch_sizes count rows: give at least one, each >= 1")

    @property
    def chain_nodes(self) -> list[int]:
        """The chain sizes verified: a plain step (1) and every drafted depth, root included."""
        return sorted({1, *(1 + d for d in self.depths)})


Segments = Callable[[], dict[str, float]]  # a run that times its own parts: {name: seconds}


def timed(run: Callable[[], object], name: str, device: torch.device) -> Segments:
    """`run` as a run of one part, `name`, timed whole (CUDA synchronised around it)."""

    def segments() -> dict[str, float]:
        start = _clock(device)
        run()
        return {name: _clock(device) - start}

    return segments


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _interleaved_medians(
    runs: list[Segments], repeats: int, settle: int, show_progress: bool
) -> dict[str, float]:
    """Median seconds of every part the runs time, the runs taken round-robin (`repeats` rounds), so
    that a burst of load on a shared machine spreads over all shapes instead of skewing one. A part
    several runs time pools their samples. Each timed run follows `settle` untimed calls of itself
    (the first compiles it), as a step of the loop follows the steps of a stretch of one action:
    the run before may be another shape's or model's, and the first few calls after it pay for
    bringing this one's weights and buffers back into the CPU's caches. On the tiny fixture's LLM
    a compiled one-token pass measured 1.7 ms after one untimed call, 1.3 ms after three and
    0.52 ms after eight, as in the loop's stretches of plain steps (2-core EPYC)."""
    times: dict[str, list[float]] = {}
    with tqdm(total=repeats * len(runs), desc="profiling", unit="run", disable=not show_progress) as bar:
        for _ in range(repeats):
            for run in runs:
                for _ in range(settle):
                    run()
                for name, seconds in run().items():
                    times.setdefault(name, []).append(seconds)
                bar.update(1)
    return {name: statistics.median(values) for name, values in times.items()}


def bushy_tree(size: int, vocab: int, max_depth: int, gen: torch.Generator) -> TokenTree:
    """A tree of `size` nodes made of chains of at most `max_depth` hanging off the root (what
    beam trees of the configuration grid look like), with random tokens."""
    tree = TokenTree.root_only(int(torch.randint(vocab, (1,), generator=gen)))
    parent = 0
    for _ in range(size - 1):
        if tree.depths[parent] >= max_depth:
            parent = 0
        token = int(torch.randint(vocab, (1,), generator=gen))
        parent = tree.add_child(parent, token, 0)
    return tree


@torch.inference_mode()
def profile(
    llm: PreTrainedModel,
    ssms: list[PreTrainedModel],
    config: ProfileConfig | None = None,
    show_progress: bool = True,
) -> CostModel:
    """Measure L_verify over tree sizes and L_speculate over the (b, d) grid for every SSM, under
    `torch.inference_mode` as decoding runs (`loop.decode`): its compiled passes are the ones
    decoding then meets. One SSM of each architecture is timed (`cost_twins`) and its figures
    stand for the others'."""
    config = config or ProfileConfig()
    twins = cost_twins(ssms)
    firsts = sorted(set(twins))
    timed_ssms = [ssms[i] for i in firsts]
    row = [firsts.index(i) for i in twins]  # each SSM's figures: those of timed_ssms[row]
    gen = torch.Generator().manual_seed(config.seed)
    vocab = llm.get_output_embeddings().weight.shape[0]
    prefix = torch.randint(vocab, (config.prefix_length,), generator=gen).tolist()
    device = llm.device
    sizes = sorted(set(config.verify_sizes))
    target = TreeCache(llm, 1, capacity_for(len(prefix) + max(sizes)))
    target.feed_chains([prefix[:-1]], eager=True)

    def verify(tree: TokenTree) -> None:
        batch = TreeBatch.pack([tree], device=device)
        target.feed(batch.tokens, target.lengths[0] + batch.depths, batch.ancestors)
        target.commit([[0]])  # what a step does after the pass...
        target.truncate(0, len(prefix) - 1)  # ...then back to the same prefix

    runs: dict[str, Callable[[], object]] = {}
    for size in sizes:
        runs[f"verify {size}"] = functools.partial(verify, bushy_tree(size, vocab, max(config.depths), gen))
    probs = LogitsToProbs(SamplingConfig())
    for index, ssm in enumerate(timed_ssms):
        drafter = PoolDrafter([ssm], [index])
        drafter.draft_one(prefix, ChainShape(1), probs, 1)  # fill the cache: timed runs catch up one token
        runs[f"ssm {index} step"] = functools.partial(drafter.draft_one, prefix, ChainShape(1), probs, 1)
        for width in config.widths:
            for depth in config.depths:
                shape = BeamShape(width, depth)
                runs[f"ssm {index} {width},{depth}"] = functools.partial(
                    drafter.draft_one, prefix, shape, probs, depth
                )
    pool = PoolDrafter(ssms) if len(ssms) > 1 else None
    if pool is not None and pool.stacked:  # one step of every SSM at once
        steps = [ChainShape(1)] * len(ssms)
        pool.draft(prefix, steps, probs, 1)
        runs["pool step"] = functools.partial(pool.draft, prefix, steps, probs, 1)
    segmented = [timed(run, name, device) for name, run in runs.items()]
    batch_sizes = sorted(set(config.batch_sizes))
    segmented += chain_runs(llm, timed_ssms, prefix, batch_sizes, config)
    if config.compile:
        calls = ModelCalls(device, enabled=True)
        for ssm in timed_ssms:  # the compiled chains are drafted as the decoder drafts them
            calls.expect_chains(ssm, max(config.depths))
        segmented += chain_runs(llm, timed_ssms, prefix, batch_sizes, config, calls.get, COMPILED)
    drafting = [  # the drafting tables measured: (CostModel field, run names' tag)
        (name, tag)
        for name, tag, measured in (
            ("chain_seconds", "", True),
            ("compiled_chain_seconds", COMPILED, config.compile),
            ("sampled_chain_seconds", SAMPLED, config.sampled),
            ("compiled_sampled_chain_seconds", COMPILED + SAMPLED, config.compile and config.sampled),
        )
        if measured
    ]
    seconds = _interleaved_medians(segmented, config.repeats, config.settle, show_progress)
    verify_seconds = [seconds[f"verify {size}"] for size in sizes]
    steps = [seconds[f"ssm {i} step"] for i in row]
    speculate = [
        {f"{b},{d}": seconds[f"ssm {i} {b},{d}"] for b in config.widths for d in config.depths} for i in row
    ]
    return CostModel(
        device=device_key(device, llm.dtype),
        verify_tokens=sizes,
        verify_seconds=verify_seconds,
        speculate_seconds=speculate,
        ssm_step_seconds=steps,
        prefix_length=config.prefix_length,
        pool_step_seconds=seconds.get("pool step"),
        llm=model_name(llm),
        ssms=[model_name(s) for s in ssms],
        llm_cost_key=cost_key(llm),
        ssm_cost_keys=[cost_key(s) for s in ssms],
        repeats=config.repeats,
        batch_sizes=batch_sizes,
        chain_nodes=config.chain_nodes,
        chain_depths=list(config.depths),
        chain_verify_seconds=verify_table(seconds, batch_sizes, config.chain_nodes),
        **{name: chain_table(seconds, row, batch_sizes, config.depths, tag) for name, tag in drafting},
        compiled_chain_verify_seconds=(
            verify_table(seconds, batch_sizes, config.chain_nodes, COMPILED) if config.compile else []
        ),
    )


def chain_table(
    seconds: dict[str, float], rows: list[int], batch_sizes: list[int], depths: tuple[int, ...], tag: str = ""
) -> list[list[list[float]]]:
    """[SSM][batch][depth] of the "ssm I chain BxD" runs (`tag`: of the compiled or sampled runs), SSM
    s's from the runs of the timed SSM `rows[s]`."""
    return [[[seconds[f"{tag}ssm {i} chain {b}x{d}"] for d in depths] for b in batch_sizes] for i in rows]


def cost_key(model: PreTrainedModel) -> str:
    """What a model's passes cost depends on, as a digest: its class, config (its name and path
    aside), attention implementation, and its parameters' names, shapes, dtypes and devices. A
    dense model's time does not depend on its weights' values."""
    config = {
        k: v for k, v in model.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")
    }
    params = [(n, tuple(p.shape), str(p.dtype), str(p.device)) for n, p in model.named_parameters()]
    attention = getattr(model.config, "_attn_implementation", None)
    key = json.dumps([type(model).__qualname__, config, attention, params], sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()


def cost_twins(models: list[PreTrainedModel]) -> list[int]:
    """For each model, the first of `models` with its `cost_key`: the profile times one of each.
    Timed apart, the tiny fixture's three SSMs of one size had differed by noise alone, which the
    router reads as one SSM being cheaper (a compiled chain of 16: 2.82 ms for SSM 2, 3.25 for
    SSM 0); timed once, its compiled profile makes 370 runs instead of 930 (7.3 minutes instead of
    8.3 from a cold compile cache: the other SSMs' graphs had come from inductor's cache)."""
    first: dict[str, int] = {}
    return [first.setdefault(cost_key(model), index) for index, model in enumerate(models)]


def reused_profile(
    like: CostModel, llm: PreTrainedModel, ssms: list[PreTrainedModel], config: ProfileConfig
) -> CostModel:
    """`like`'s figures for these models, where it was measured on models that cost what these
    do: the LLM and the pool's SSMs of the same `cost_key`s (in any order), on this device key
    (hardware, threads, dtype), with every table `config` asks for measured at its sizes. A pool
    retrained on other data, or boosted for sampling beside a greedy one of the same sizes, then
    needs no profile of its own. Raises ValueError saying what differs."""
    keys = [cost_key(ssm) for ssm in ssms]
    if like.llm_cost_key is None:
        raise ValueError("it does not record its models' architectures (measured before they were)")
    wanted = {
        "LLM architecture": (like.llm_cost_key, cost_key(llm)),
        "set of SSM architectures": (sorted(like.ssm_cost_keys), sorted(keys)),
        "device, dtype or thread count": (like.device, device_key(llm.device, llm.dtype)),
        "prefix length": (like.prefix_length, config.prefix_length),
        "set of verified tree sizes": (like.verify_tokens, sorted(set(config.verify_sizes))),
        "set of batch sizes": (like.batch_sizes, sorted(set(config.batch_sizes))),
        "set of chain lengths": (like.chain_depths, list(config.depths)),
        "set of beam shapes": (
            sorted(like.speculate_seconds[0]) if like.speculate_seconds else [],
            sorted(f"{b},{d}" for b in config.widths for d in config.depths),
        ),
    }
    for what, (theirs, ours) in wanted.items():
        if theirs != ours:
            raise ValueError(f"it was measured with another {what}")
    if like.repeats is None:
        raise ValueError("it does not record how many rounds it timed (measured before it did)")
    if like.repeats < config.repeats:
        raise ValueError(
            f"its medians are of {like.repeats} timed rounds, fewer than the {config.repeats} asked"
        )
    missing = [
        name
        for name, asked in (
            ("compiled_chain_seconds", config.compile),
            ("sampled_chain_seconds", config.sampled),
            ("compiled_sampled_chain_seconds", config.compile and config.sampled),
        )
        if asked and not getattr(like, name)
    ]
    if missing:
        raise ValueError(f"it lacks the tables {', '.join(missing)}")
    row = [like.ssm_cost_keys.index(key) for key in keys]
    per_ssm = ("speculate_seconds", "ssm_step_seconds", *DRAFTING_TABLES)
    return replace(
        like,
        llm=model_name(llm),
        ssms=[model_name(s) for s in ssms],
        ssm_cost_keys=keys,
        **{name: [getattr(like, name)[i] for i in row] if getattr(like, name) else [] for name in per_ssm},
    )


def verify_table(
    seconds: dict[str, float], batch_sizes: list[int], nodes: list[int], tag: str = ""
) -> list[list[float]]:
    """[batch][nodes] of the "verify BxN" runs (`tag`: of the compiled runs)."""
    return [[seconds[f"{tag}verify {b}x{n}"] for n in nodes] for b in batch_sizes]


def chain_runs(
    llm: PreTrainedModel,
    ssms: list[PreTrainedModel],
    prefix: list[int],
    batch_sizes: list[int],
    config: ProfileConfig,
    compiled: Callable[[PreTrainedModel], CompiledPass | None] = lambda model: None,
    tag: str = "",
) -> list[Segments]:
    """The timed runs of the chain tables (section 5.3), as the loop's steps: a plain step, the
    LLM's pass over the roots of B rows after the prefix, then the commit of the roots and the
    truncation back to the prefix ("verify Bx1"); a drafting step of SSM I, its D-token greedy
    chains in each of B rows after the prefix (its cache holding the prefix but the last token, as
    after a step: "ssm I chain BxD"), then the LLM's pass over those chains, committed and truncated
    likewise ("verify Bx(D+1)", pooled over the SSMs); with `config.sampled`, the same step with
    sampled chains ("sampled ssm I chain BxD", its verify pooled too). With `compiled` (a model's
    compiled pass), on the compiled loop, the names prefixed by `tag`. The LLM's passes return the
    hidden states, as the learned scheduler's verification does."""
    runs: list[Segments] = []
    device = llm.device
    kinds = [None, *([LogitsToProbs(SamplingConfig(True, SAMPLED_TEMPERATURE))] if config.sampled else [])]
    largest = max(config.chain_nodes)
    for rows in batch_sizes:
        target = TreeCache(llm, rows, capacity_for(len(prefix) + largest), compiled(llm))
        target.feed_chains([prefix[:-1]] * rows, eager=True)
        roots = [prefix[-1]] * rows
        plain = ChainDraft(roots, torch.zeros(rows, 0, dtype=torch.long, device=device), [0] * rows, 0)
        verify = functools.partial(_verify_chains, target, plain.batch(), len(prefix))
        runs.append(timed(verify, f"{tag}verify {rows}x1", device))
        for index, ssm in enumerate(ssms):
            drafter = BatchedChainDrafter(ssm, compiled(ssm))
            drafter.add_sequences(rows)
            drafter.expect_sampling([probs for probs in kinds if probs is not None])
            drafter.draft_greedy([prefix] * rows, [1] * rows)  # fill the cache: timed runs catch up one token
            for depth, probs in itertools.product(config.depths, kinds):
                names = (index, rows, tag if probs is None else tag + SAMPLED)
                runs.append(functools.partial(_drafting_step, drafter, target, prefix, depth, names, probs))
    return runs


def _drafting_step(
    drafter: BatchedChainDrafter,
    target: TreeCache,
    prefix: list[int],
    depth: int,
    names: tuple[int, int, str],
    probs: LogitsToProbs | None = None,
) -> dict[str, float]:
    """One drafting step of the loop: `drafter`'s chains of `depth` tokens in every row (greedy, or
    sampled with `probs` and read back), then the LLM's pass over them, each timed."""
    index, rows, tag = names
    start = _clock(target.device)
    if probs is None:
        chains, lengths = drafter.draft_greedy([prefix] * rows, [depth] * rows)
    else:
        drafted = drafter.draft([prefix] * rows, [depth] * rows, [probs] * rows, [None] * rows)
        chains = torch.tensor([[token for token, _ in chain] for chain in drafted], device=target.device)
        lengths = [len(chain) for chain in drafted]
    middle = _clock(target.device)
    _verify_chains(target, ChainDraft([prefix[-1]] * rows, chains, lengths, index).batch(), len(prefix))
    end = _clock(target.device)
    return {
        f"{tag}ssm {index} chain {rows}x{depth}": middle - start,
        f"{tag.removesuffix(SAMPLED)}verify {rows}x{depth + 1}": end - middle,
    }


def _verify_chains(target: TreeCache, batch: TreeBatch, prefix_length: int) -> None:
    """One LLM pass over `batch` (one chain per row), the roots kept, then back to the prefix."""
    target.feed(batch.tokens, prefix_length - 1 + batch.depths, batch.ancestors, True)
    target.commit([[0]] * target.rows)
    for row in range(target.rows):
        target.truncate(row, prefix_length - 1)
