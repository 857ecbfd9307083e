"""Measure the hardware cost model on this machine (ALGORITHMS.md sections 5 and 8).

    specboost profile --llm PATH --pool POOL_DIR            # writes POOL_DIR/hardware_profile.json

Everything is timed through the decoder's own code paths: L_verify(n) is the LLM's `TreeCache`
pass over an n-node tree after `prefix_length` cached tokens, followed by the commit a real step
does (the root kept); L_speculate(b, d) is `PoolDrafter.draft_one` of a beam tree after the same prefix
(the steady-state cache catch-up of one token included). The chain tables of the routed scheduler
(section 5.3) are timed the same way at every batch size of `batch_sizes`: the LLM's pass over a
chain of n nodes in every row, and each SSM's `BatchedChainDrafter.draft_greedy` of a d-token chain
in every row (a one-token catch-up first). Each number is the median of `repeats`
timed runs after one warm-up run; CUDA is synchronised around every run.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from specboost.decoder.compilation import ModelCalls
from specboost.decoder.validation import model_name
from specboost.speculator.batched_drafter import BatchedChainDrafter
from specboost.speculator.cost_model import CostModel, device_key
from specboost.speculator.drafter import PoolDrafter
from specboost.speculator.kv_cache import CompiledPass, TreeCache, capacity_for
from specboost.speculator.predictor import DEPTHS, WIDTHS
from specboost.speculator.sampling import LogitsToProbs, SamplingConfig
from specboost.speculator.shapes import BeamShape, ChainShape
from specboost.speculator.tree import ChainDraft, TokenTree, TreeBatch

COMPILED = "compiled "  # the names of the compiled runs start with it


@dataclass(frozen=True)
class ProfileConfig:
    widths: tuple[int, ...] = WIDTHS
    depths: tuple[int, ...] = DEPTHS
    verify_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)  # rows of the chain tables (section 5.3)
    compile: bool = False  # also the chain tables on the compiled loop (compiles their passes)
    prefix_length: int = 64
    repeats: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.prefix_length < 1:
            raise ValueError("repeats and prefix_length must be >= 1")
        if min(self.verify_sizes) < 1:
            raise ValueError("verify sizes count tree nodes, root included: they must be >= 1")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError("batch_sizes count rows: give at least one, each >= 1")

    @property
    def chain_nodes(self) -> list[int]:
        """The chain sizes verified: a plain step (1) and every drafted depth, root included."""
        return sorted({1, *(1 + d for d in self.depths)})


def _interleaved_medians(
    runs: dict[str, Callable[[], object]], repeats: int, device: torch.device, show_progress: bool
) -> dict[str, float]:
    """Median seconds of every run, timed round-robin (`repeats` rounds), so that a burst of load on
    a shared machine spreads over all shapes instead of skewing one. Each timing follows an untimed
    call of the same run (which compiles it, the first time): the run before may be another
    model's, whose passes leave this one's weights out of the CPU's caches, and that had charged
    the first run of each model for it (a one-token compiled verify pass of the tiny fixture's LLM
    measured 3.9 ms, its two-token pass 2.4 ms; a plain step of the decoding loop takes 1.5 ms)."""
    times: dict[str, list[float]] = {key: [] for key in runs}
    with tqdm(total=repeats * len(runs), desc="profiling", unit="run", disable=not show_progress) as bar:
        for _ in range(repeats):
            for key, run in runs.items():
                run()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                run()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[key].append(time.perf_counter() - start)
                bar.update(1)
    return {key: statistics.median(values) for key, values in times.items()}


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


@torch.no_grad()
def profile(
    llm: PreTrainedModel,
    ssms: list[PreTrainedModel],
    config: ProfileConfig | None = None,
    show_progress: bool = True,
) -> CostModel:
    """Measure L_verify over tree sizes and L_speculate over the (b, d) grid for every SSM."""
    config = config or ProfileConfig()
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
    for index, ssm in enumerate(ssms):
        drafter = PoolDrafter([ssm], [index])
        drafter.draft_one(prefix, ChainShape(1), probs, 1)  # fill the cache: timed runs catch up one token
        runs[f"ssm {index} step"] = functools.partial(drafter.draft_one, prefix, ChainShape(1), probs, 1)
        for width in config.widths:
            for depth in config.depths:
                shape = BeamShape(width, depth)
                runs[f"ssm {index} {width},{depth}"] = functools.partial(
                    drafter.draft_one, prefix, shape, probs, depth
                )
    batch_sizes = sorted(set(config.batch_sizes))
    runs |= chain_runs(llm, ssms, prefix, batch_sizes, config)
    if config.compile:
        calls = ModelCalls(device, enabled=True)
        runs |= chain_runs(llm, ssms, prefix, batch_sizes, config, calls.get, COMPILED)
    pool = PoolDrafter(ssms) if len(ssms) > 1 else None
    if pool is not None and pool.stacked:  # one step of every SSM at once
        steps = [ChainShape(1)] * len(ssms)
        pool.draft(prefix, steps, probs, 1)
        runs["pool step"] = functools.partial(pool.draft, prefix, steps, probs, 1)
    seconds = _interleaved_medians(runs, config.repeats, device, show_progress)
    verify_seconds = [seconds[f"verify {size}"] for size in sizes]
    steps = [seconds[f"ssm {i} step"] for i in range(len(ssms))]
    speculate = [
        {f"{b},{d}": seconds[f"ssm {i} {b},{d}"] for b in config.widths for d in config.depths}
        for i in range(len(ssms))
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
        batch_sizes=batch_sizes,
        chain_nodes=config.chain_nodes,
        chain_depths=list(config.depths),
        chain_seconds=chain_table(seconds, len(ssms), batch_sizes, config.depths),
        chain_verify_seconds=verify_table(seconds, batch_sizes, config.chain_nodes),
        **(
            {
                "compiled_chain_seconds": chain_table(
                    seconds, len(ssms), batch_sizes, config.depths, COMPILED
                ),
                "compiled_chain_verify_seconds": verify_table(
                    seconds, batch_sizes, config.chain_nodes, COMPILED
                ),
            }
            if config.compile
            else {}
        ),
    )


def chain_table(
    seconds: dict[str, float], ssms: int, batch_sizes: list[int], depths: tuple[int, ...], tag: str = ""
) -> list[list[list[float]]]:
    """[SSM][batch][depth] of the "ssm I chain BxD" runs (`tag`: of the compiled runs)."""
    return [
        [[seconds[f"{tag}ssm {i} chain {b}x{d}"] for d in depths] for b in batch_sizes] for i in range(ssms)
    ]


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
) -> dict[str, Callable[[], object]]:
    """The timed runs of the chain tables (section 5.3): "verify BxN", the LLM's pass over a chain
    of N nodes in each of B rows after the prefix, then the commit of the root and the truncation a
    real step does; "ssm I chain BxD", SSM I drafting a D-token greedy chain in each of B rows after
    the prefix (its cache holding the prefix but the last token, as after a step). With
    `compiled` (a model's compiled pass), on the compiled loop, the names prefixed by `tag`. The
    LLM's passes return the hidden states, as the learned scheduler's verification does."""
    runs: dict[str, Callable[[], object]] = {}
    largest = max(config.chain_nodes)
    for rows in batch_sizes:
        target = TreeCache(llm, rows, capacity_for(len(prefix) + largest), compiled(llm))
        target.feed_chains([prefix[:-1]] * rows, eager=True)
        for nodes in config.chain_nodes:
            chains = ChainDraft(
                [prefix[-1]] * rows,
                torch.zeros(rows, nodes - 1, dtype=torch.long, device=llm.device),
                [nodes - 1] * rows,
                0,
            )
            runs[f"{tag}verify {rows}x{nodes}"] = functools.partial(
                _verify_chains, target, chains.batch(), len(prefix)
            )
        for index, ssm in enumerate(ssms):
            drafter = BatchedChainDrafter(ssm, compiled(ssm))
            drafter.add_sequences(rows)
            drafter.draft_greedy([prefix] * rows, [1] * rows)  # fill the cache: timed runs catch up one token
            for depth in config.depths:
                runs[f"{tag}ssm {index} chain {rows}x{depth}"] = functools.partial(
                    drafter.draft_greedy, [prefix] * rows, [depth] * rows
                )
    return runs


def _verify_chains(target: TreeCache, batch: TreeBatch, prefix_length: int) -> None:
    """One LLM pass over `batch` (one chain per row), the roots kept, then back to the prefix."""
    target.feed(batch.tokens, prefix_length - 1 + batch.depths, batch.ancestors, True)
    target.commit([[0]] * target.rows)
    for row in range(target.rows):
        target.truncate(row, prefix_length - 1)
