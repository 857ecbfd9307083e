"""`SpeculativeDecoder(compile=True)`: the LLM's verify pass and the SSMs' drafting passes run as
torch.compile'd graphs at bucketed shapes (nodes padded; the row padding of compiled caches is
checked without compiling in tests/test_kv_cache.py); greedy output is still `llm.generate`'s,
token for token. The learned scheduler's varying shapes are all compiled by `warmup` (how a cache
runs them is checked without compiling in tests/test_kv_cache.py). Compiling on the CPU takes about
a minute; a batch and the learned scheduler (~90 s) are the `slow` tests, and the CUDA run with CUDA
graphs is in tests/test_gpu.py."""

from __future__ import annotations

import copy
import functools
import gc
import weakref
from collections.abc import Callable

import numpy as np
import pytest
import torch
from conftest import noisy_copy, tiny_llama, tiny_opt
from transformers import PreTrainedModel

from specboost.decoder import ChainShape, SpeculativeDecoder, compilation
from specboost.decoder.engine import Engine, EngineConfig
from specboost.decoder.profiler import ProfileConfig, profile
from specboost.speculator.batched_drafter import BatchedChainDrafter
from specboost.speculator.chain_router import ChainRouter
from specboost.speculator.cost_model import CostModel
from specboost.speculator.kv_cache import (
    CAPACITY_STEP,
    CompiledPass,
    FullStaticCache,
    PassShape,
    TreeCache,
    cache_capacity,
)
from specboost.speculator.predictor import MatchLengthPredictor, PredictorConfig
from specboost.speculator.routed_scheduler import RoutedScheduler
from specboost.speculator.scheduler import LearnedScheduler
from specboost.speculator.shapes import BeamShape

PROMPTS = [[3, 17, 42, 8, 8, 51, 23], [12, 5, 60]]


def compiled_decoder(ssms: int = 1, length: int = 3, **options: object) -> SpeculativeDecoder:
    llm = tiny_llama(layers=2, seed=0).float()
    pool = [noisy_copy(llm, 0.1, seed=1 + i) for i in range(ssms)]
    return SpeculativeDecoder(llm, pool, shape=ChainShape(length), compile=True, **options)


@pytest.mark.parametrize("pool", [dict(ssms=3), dict(ssms=3, strategy="majority")], ids=["pool", "majority"])
def test_compiled_decoding_equals_generate(pool: dict) -> None:
    """A stacked pool of 3 (its rows are not padded: blocks of one row per SSM); one SSM's chain:
    `test_a_compiled_chain_drafts_after_its_first_token_in_one_compiled_block`."""
    dec = compiled_decoder(**pool)
    llm = dec.llm
    assert dec.calls.enabled and dec.calls.get(llm) is not None
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        expected = llm.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
        assert torch.equal(dec.generate(ids, max_new_tokens=12).sequences, expected)


def test_a_compiled_chain_drafts_after_its_first_token_in_one_compiled_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A compiled chain of 4 tokens drafts the 3 after its first in one compiled argmax-chain block
    (speculator/chain_block.py), which the warm-up compiled: the generations compile nothing new
    and equal `llm.generate`'s, with a logits processor (`repetition_penalty`) too."""
    blocks: list[int | None] = []
    chain = CompiledPass.chain

    def counted(self: CompiledPass, *args: object) -> torch.Tensor | None:
        out = chain(self, *args)
        blocks.append(None if out is None else args[8])  # its steps (then a sampled block's draws)
        return out

    monkeypatch.setattr(CompiledPass, "chain", counted)
    dec = compiled_decoder(length=4)
    ssm = dec.ssms[0]
    assert dec.calls.get(ssm).expected_chains == {3}
    dec.warmup()
    assert set(blocks) == {3}
    blocks.clear()
    generate_after_warmup(dec, warm=False)
    # Decoding runs the warm-up's blocks: on the CPU, where the capacity is a dynamic size, their
    # keys hold none, and a lookup by the cache's capacity had found none since 2026-12-05.
    assert blocks and set(blocks) == {3}
    # Greedy rows with logits processors draft the same raw argmax chains in the same blocks; the
    # verifier takes the argmax of the processed scores, each position with its own history.
    blocks.clear()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    changed = False
    for prompt in PROMPTS:
        ids, mask = torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long)
        expected = dec.llm.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
        penalised = dec.llm.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=24, repetition_penalty=1.5
        )
        changed = changed or not torch.equal(penalised, expected)
        out = dec.generate(ids, max_new_tokens=24, repetition_penalty=1.5)
        assert torch.equal(out.sequences, penalised)
    assert changed and blocks and set(blocks) == {3}
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    # Chains of other widths (the router's) feed the same block: once a drafter's cache warmed,
    # nothing compiles for them.
    drafter = BatchedChainDrafter(ssm, dec.calls.get(ssm))
    drafter.add_sequences(1)
    with torch.inference_mode():
        drafter.draft_greedy([PROMPTS[0]], [5])
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for width in (6, 9, 4):
            drafter.draft_greedy([PROMPTS[0]], [width])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize(
    ("build", "length", "grown"),
    [(functools.partial(tiny_llama, positions=512), 300, 2), (tiny_opt, 90, 1)],
    ids=["llama", "opt"],
)
def test_a_capacity_met_after_the_first_compiles_nothing(
    build: Callable[..., PreTrainedModel], length: int, grown: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU the compiled passes and chain blocks take the cache capacity as a dynamic size
    (`compilation.dynamic_sizes`): a prompt of `length` tokens, whose text needs larger caches
    than a short one's (the LLM's; the SSM's too where the model's context lets it outgrow the
    drafter's first capacity: the first `grown` of the two), runs the graphs already compiled, and
    the output is still `llm.generate`'s (OPT: learned positions, another attention code)."""
    met: dict[int, set[int]] = {}  # the capacities of the caches each compiled call was called with
    sizes_key = CompiledPass.sizes_key

    def recorded(self: CompiledPass, cache: FullStaticCache, rows: int) -> tuple[int | None, int | None]:
        met.setdefault(id(self), set()).add(cache_capacity(cache))
        return sizes_key(self, cache, rows)

    monkeypatch.setattr(CompiledPass, "sizes_key", recorded)
    llm = build(layers=2, seed=0).float()
    dec = SpeculativeDecoder(llm, [noisy_copy(llm, 0.1, seed=1)], shape=ChainShape(4), compile=True)
    calls = [dec.calls.get(model) for model in (llm, dec.ssms[0])]
    assert compilation.dynamic_sizes(llm.device) and all(call.dynamic_capacity for call in calls)

    def generate(tokens: int) -> None:
        ids = torch.randint(1, 60, (1, tokens), generator=torch.Generator().manual_seed(tokens))
        out = dec.generate(ids, max_new_tokens=24)
        expected = llm.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24)
        assert torch.equal(out.sequences, expected)

    generate(7)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    before = [set(met[id(call)]) for call in calls]
    generate(length)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert all(met[id(call)] - seen for call, seen in zip(calls[:grown], before, strict=False))


def test_a_row_bucket_met_after_the_first_compiles_nothing() -> None:
    """On the CPU the compiled passes take the rows past one as a dynamic size
    (`CompiledPass.sizes_key`): caches of 4 and 3 rows (padded to 4) run the graphs a cache of 2
    rows compiled, and their logits are the eager pass's. A stacked pool's rows (blocks of one per
    member) stay a static size."""
    llm = tiny_llama(layers=2, seed=0).float()
    calls = compilation.ModelCalls(llm.device, enabled=True)
    call = calls.get(llm)
    assert call.dynamic_rows and call.dynamic_capacity
    graphs = start = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for rows in (2, 4, 3):
        cache = TreeCache(llm, rows, CAPACITY_STEP, call)
        cache.feed_chains([prompt[: 2 + row] for row, prompt in enumerate([*PROMPTS, *PROMPTS][:rows])])
        for nodes in (1, 3):
            tokens = torch.arange(1, 1 + rows * nodes).view(rows, nodes) % 60
            positions = torch.tensor(cache.lengths)[:, None] + torch.arange(nodes)
            visible = torch.ones(nodes, nodes, dtype=torch.bool).tril().repeat(rows, 1, 1)
            compiled = cache.feed(tokens, positions, visible).logits
            cache.commit([[] for _ in range(rows)])
            eager = cache.feed(tokens, positions, visible, eager=True).logits
            cache.commit([[] for _ in range(rows)])
            torch.testing.assert_close(compiled, eager)
        if rows == 2:
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            assert graphs >= start + 2  # a graph of 1 node and one of 3
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert {key[0] for key in call.store.functions} == {None}
    stacked = compiled_decoder(ssms=3)
    assert not any(stacked.calls.get(unit.model).dynamic_rows for unit in stacked.speculator.drafter.units)


@pytest.mark.slow
def test_compiled_batch_equals_generate_per_row() -> None:
    dec = compiled_decoder()
    llm, prompts = dec.llm, PROMPTS
    ids = torch.tensor([prompts[0], [0] * 4 + prompts[1]])
    mask = torch.tensor([[1] * 7, [0] * 4 + [1] * 3])
    out = dec.generate(ids, attention_mask=mask, max_new_tokens=12)
    for row, prompt in enumerate(prompts):
        single = torch.tensor([prompt])
        expected = llm.generate(
            single, attention_mask=torch.ones_like(single), do_sample=False, max_new_tokens=12
        )
        assert out.sequences[row, 7:].tolist() == expected[0, len(prompt) :].tolist()


def test_compile_setting_is_checked() -> None:
    llm = tiny_llama(layers=1, seed=0)
    with pytest.raises(ValueError, match='compile must be True, False or "auto"'):
        SpeculativeDecoder(llm, [llm], compile="yes")
    assert not SpeculativeDecoder(llm, [llm]).calls.enabled  # "auto" on the CPU: eager


def test_compile_without_a_compiler_names_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compilation.shutil, "which", lambda name: None)
    llm = tiny_llama(layers=1, seed=0)
    with pytest.raises(RuntimeError, match=r"needs a C\+\+ compiler .* or use compile=False"):
        SpeculativeDecoder(llm, [llm], compile=True)


def test_every_model_and_pass_key_keeps_its_compiled_graphs_apart() -> None:
    """torch.compile checks the graphs of one code object one after another at every call, and caps
    them (recompile_limit): each model's call makes a copy of the tree pass of its own for every
    pass key (`CompiledPass`), so a process compiling many models and shapes (the benchmark suite,
    the learned scheduler) neither scans dozens of graphs per step nor falls back to eager."""
    llm, ssm = tiny_llama(layers=1, seed=0), tiny_llama(layers=1, seed=1)
    calls = compilation.ModelCalls(llm.device, enabled=True)
    functions = [calls.get(model).make() for model in (llm, ssm, llm)]
    codes = {id(function._torchdynamo_orig_callable.__code__) for function in functions}
    assert len(codes) == 3 and calls.get(llm) is calls.get(llm)


def test_decoders_of_one_model_share_its_compiled_graphs() -> None:
    """A second decoder over the same LLM compiles nothing its first compiled (the benchmark suite
    builds one decoder per method and decoding), called in `torch.inference_mode` or not, nor does
    a serving engine's worker thread on it (graphs guard on the mode, which a thread does not
    inherit: decoding always runs in it); each gives the same greedy text."""
    llm = tiny_llama(layers=1, seed=0).float()
    ids = torch.tensor([PROMPTS[0]])
    first = SpeculativeDecoder(llm, [], strategy="plain", compile=True).generate(ids, max_new_tokens=6)
    frames = torch._dynamo.utils.counters["frames"]["total"]
    second = SpeculativeDecoder(llm, [], strategy="plain", compile=True)
    with torch.inference_mode():
        again = second.generate(ids, max_new_tokens=6)
        with Engine(second, EngineConfig(batch_size=1, num_groups=1)) as engine:
            served = engine.run([PROMPTS[0]], max_new_tokens=6)[0]
    assert torch._dynamo.utils.counters["frames"]["total"] == frames
    expected = llm.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6)
    for out in (first, again, served):
        assert torch.equal(out.sequences, expected)


def test_changed_weights_get_graphs_of_their_own() -> None:
    """A graph compiled on the CPU holds the weights it was compiled with (freezing): a model whose
    weights changed in place, or were replaced, since gets new functions; each call keeps its own
    expected shapes; a model's functions go with it."""
    llm, other = tiny_llama(layers=1, seed=0), tiny_llama(layers=1, seed=1)
    first, second = compilation.ModelCalls(llm.device, True), compilation.ModelCalls(llm.device, True)
    shared = first.get(llm).store
    assert second.get(llm).store is shared and first.get(other).store is not shared
    assert first.get(llm) is not second.get(llm)  # the expected shapes are each decoder's own
    with torch.no_grad():
        next(llm.parameters()).add_(1.0)  # an optimizer step, in place
    assert compilation.ModelCalls(llm.device, True).get(llm).store is not shared
    llm.float().double()  # replaced tensors
    assert compilation.ModelCalls(llm.device, True).get(llm).store is not shared
    held = weakref.ref(llm)
    del llm, first, second, shared
    gc.collect()
    assert held() is None  # the registry keeps no model alive


def test_compiled_passes_serve_only_their_model_in_its_state() -> None:
    """A compiled pass checks nothing of the model it is called with (`compile_options` drops
    dynamo's guards on modules and parameters): two models of one architecture each decode to
    their own `generate`'s text, and a model put in train mode or given another attention
    implementation gets functions of its own."""
    ids = torch.tensor([PROMPTS[0]])
    for seed in (0, 1):
        llm = tiny_llama(layers=1, seed=seed).float()
        out = SpeculativeDecoder(llm, [], strategy="plain", compile=True).generate(ids, max_new_tokens=6)
        expected = llm.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6)
        assert torch.equal(out.sequences, expected)

    def store() -> compilation.CompiledFunctions:
        return compilation.ModelCalls(llm.device, True).get(llm).store

    evaluating = store()
    assert store() is evaluating
    llm.train()
    training = store()
    assert training is not evaluating
    llm.config._attn_implementation = "eager" if llm.config._attn_implementation != "eager" else "sdpa"
    assert store() is not training


def test_cuda_compiles_as_reduce_overhead_without_module_guards() -> None:
    """torch.compile takes a mode or options, not both: on CUDA the options are those of
    mode="reduce-overhead" (CUDA graphs) with the guard filter, and torch.compile accepts them (here
    on a CPU function, whose graph runs without CUDA graphs)."""
    options = compilation.compile_options(torch.device("cuda"))
    assert options["options"]["triton.cudagraphs"]
    assert options["options"]["guard_filter_fn"] is torch.compiler.skip_guard_on_all_nn_modules_unsafe
    double = torch.compile(lambda x: 2 * x, fullgraph=True, dynamic=False, **options)
    assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0))


def two_ssms_and_a_random_predictor(
    bias: float,
) -> tuple[PreTrainedModel, list[PreTrainedModel], MatchLengthPredictor]:
    """An LLM, two noisy copies as SSMs and a random predictor over widths (1, 2) and depths
    (1, 2) whose estimates sit around `bias`, so that choices vary with the LLM's state."""
    llm = tiny_llama(layers=2, seed=0).float()
    ssms = [noisy_copy(llm, 0.1, seed=1), noisy_copy(llm, 0.1, seed=2)]
    torch.manual_seed(0)
    config = PredictorConfig(input_size=32, num_ssms=2, widths=(1, 2), depths=(1, 2), hidden_size=16)
    predictor = MatchLengthPredictor(config)
    with torch.no_grad():
        predictor.mlp[-1].bias.fill_(bias)
    return llm, ssms, predictor


def learned_compiled_decoder() -> SpeculativeDecoder:
    """The learned scheduler over 2 SSMs choosing among beams (1 or 2 wide, 1 or 2 deep) or nothing:
    a random predictor and costs under which speculating pays, so that its choices vary with the
    LLM's state (no online corrections: they would learn from the warm-up's compiling steps)."""
    llm, ssms, predictor = two_ssms_and_a_random_predictor(bias=1.5)
    speculate = {"1,1": 0.1, "1,2": 0.2, "2,1": 0.15, "2,2": 0.3}
    cost = CostModel("test|float32", [1, 2, 4, 8], [1.0, 1.05, 1.1, 1.2], [speculate] * 2, [0.05] * 2)
    scheduler = LearnedScheduler(
        ssms, predictor, cost, BeamShape(1, 2), calibration=None, cost_correction=None
    )
    return SpeculativeDecoder(llm, ssms, speculator=scheduler, compile=True)


@pytest.mark.slow
def test_learned_scheduler_compiles_nothing_after_warmup() -> None:
    """The learned scheduler (ALGORITHMS.md section 5) picks a beam or nothing per SSM and step;
    `warmup` compiles every pass shape its choices can produce (`ModelCalls.expect_passes`), so
    generations whose choices vary compile nothing new, and their output is `llm.generate`'s."""
    reports = generate_after_warmup(learned_compiled_decoder())
    choices = {tuple(map(str, step)) for report in reports for step in report["choices"]}
    assert len(choices) > 1, choices  # the shapes varied


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["majority", "pool"])
def test_pools_compile_nothing_after_warmup(strategy: str) -> None:
    """A pool of a fixed shape verifies trees whose size varies with how far its SSMs agree (the
    merged tree) or which of them is voted (the majority's chain, ALGORITHMS.md section 6); `warmup`
    compiles every size, so generations on other prompts compile nothing new (`majority+compiled`
    had compiled a graph in a timed run of the quick suite); the outputs stay `llm.generate`'s."""
    llm = tiny_llama(layers=2, seed=0).float()
    ssms = [noisy_copy(llm, 0.3, seed=1), noisy_copy(llm, 0.6, seed=2)]
    generate_after_warmup(SpeculativeDecoder(llm, ssms, strategy=strategy, shape=ChainShape(3), compile=True))


def test_level_passes_cover_every_joint_beam() -> None:
    """Two SSMs of one stacked unit: level j feeds the wider beam still growing, after the levels
    before it (nodes and seen keys padded to their buckets)."""
    passes = compilation.level_passes({(1, 1), (1, 3), (2, 2)}, rows=2)
    # Alone: (1, 3) feeds 1 then 1 node; (2, 2) feeds 2. Together: 2 nodes, then 1 after those 2.
    assert passes == {
        PassShape(1, 1, False),
        PassShape(1, 2, False),
        PassShape(2, 2, False),
        PassShape(1, 3, False),
    }


@pytest.mark.slow
def test_routed_scheduler_compiles_nothing_after_warmup() -> None:
    """The routed scheduler (ALGORITHMS.md section 5.3) picks plain or one SSM's chain of 1 or 2
    tokens per step, for one sequence and for a batch; `warmup` compiles every pass it can cause,
    so a generation and a batch whose choices vary compile nothing new, and their output is
    `llm.generate`'s."""
    llm, ssms, predictor = two_ssms_and_a_random_predictor(bias=0.7)
    cost = chain_costs(4, [[[0.1, 0.2], [0.12, 0.22]], [[0.3, 0.4], [0.35, 0.45]]])
    scheduler = RoutedScheduler(ssms, predictor, cost, calibration=None, cost_correction=None)
    reports = generate_after_warmup(SpeculativeDecoder(llm, ssms, speculator=scheduler, compile=True))
    actions = {action for report in reports for action in report["actions"]}
    assert len(actions) > 1, actions  # the choices varied


def test_the_routers_estimates_come_out_of_the_compiled_verify_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled routed decoder's LLM applies the router's predictor to its hidden states in the
    verify pass (`ChainRouter.pass_head`; 5.3, "Cost of deciding"): at every step the router gets
    the estimates, equal to its numpy predictor's on the LLM's own hidden state before the root.
    Two decoders over one LLM share its graphs, each with its own predictor's estimates (the
    weights are the graph's inputs, not frozen into it); the output stays `llm.generate`'s."""
    llm, ssms, predictor = two_ssms_and_a_random_predictor(bias=0.7)
    other = copy.deepcopy(predictor)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    cost = chain_costs(4, [[[0.1, 0.2], [0.12, 0.22]], [[0.3, 0.4], [0.35, 0.45]]])
    seen: list[tuple[ChainRouter, torch.Tensor, list[int]]] = []
    predict_one = ChainRouter._predict_one

    def record(self: ChainRouter, state: torch.Tensor | None, texts: list[list[int]] | None) -> list:
        if state is not None:
            seen.append((self, state.clone(), list(texts[0])))
        return predict_one(self, state, texts)

    monkeypatch.setattr(ChainRouter, "_predict_one", record)
    ids = torch.tensor([PROMPTS[0]])
    expected = llm.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10)
    for head in (predictor, other):
        scheduler = RoutedScheduler(ssms, head, cost, calibration=None, cost_correction=None, gated=False)
        decoder = SpeculativeDecoder(llm, ssms, speculator=scheduler, compile=True)
        assert torch.equal(decoder.generate(ids, max_new_tokens=10).sequences, expected)
    assert len(seen) > 4
    for router, state, text in seen:
        assert state.shape == (2 * 2,)  # [S * D], not the hidden state [32]
        with torch.no_grad():
            hidden = llm(torch.tensor([text]), output_hidden_states=True).hidden_states[-1][0, -2]
        numpy = router.predictor.on_host(1)(hidden.numpy())
        np.testing.assert_allclose(state.view(2, 2).numpy(), numpy, atol=1e-4)
    assert len({id(router) for router, _, _ in seen}) == 2


def chain_costs(rows: int, seconds: list[list[list[float]]]) -> CostModel:
    """A made-up profile of 2 SSMs whose chain tables (depths 1 and 2) were measured at batch sizes 1
    and `rows`: drafting `seconds` [SSM][batch size][depth]."""
    return CostModel(
        "test|float32",
        [1],
        [1.0],
        [{}] * 2,
        [0.05] * 2,
        batch_sizes=[1, rows],
        chain_nodes=[1, 2, 3],
        chain_verify_seconds=[[1.0, 1.05, 1.1], [1.5, 1.6, 1.7]],
        chain_depths=[1, 2],
        chain_seconds=seconds,
    )


def favouring(ssm: int) -> MatchLengthPredictor:
    """A predictor (width 1, depths 1 and 2) whose estimates favour SSM `ssm` whatever the state."""
    config = PredictorConfig(input_size=32, num_ssms=2, widths=(1,), depths=(1, 2), hidden_size=16)
    predictor = MatchLengthPredictor(config)
    with torch.no_grad():
        predictor.mlp[-1].weight.zero_()
        good, bad = [0.9, 1.8], [0.1, 0.1]
        predictor.mlp[-1].bias.copy_(torch.tensor([good, bad] if ssm == 0 else [bad, good]).flatten())
    return predictor.eval()


@pytest.mark.slow
def test_a_routed_batch_warmed_on_its_prompts_compiles_nothing_when_it_routes_otherwise() -> None:
    """A compiled method warms up on the prompts it is timed on; the routed scheduler's choices
    follow measured times, so the timed run may route to an SSM that sat out the warm-up, at a
    cache capacity that SSM never met (prompts past the first capacity). Its drafters are sized for
    the rows' final lengths and warmed when the rows change, whether they draft or not
    (`RoutedChains.warm`), and a plain step of the speculation gate's is among the shapes compiled
    (5.4), so nothing is compiled in the run that routes otherwise, and its output is
    `llm.generate`'s."""
    llm = tiny_llama(layers=2, seed=0, positions=512).float()
    ssms = [noisy_copy(llm, 0.1, seed=1), noisy_copy(llm, 0.1, seed=2)]
    cost = chain_costs(2, [[[0.1, 0.2], [0.1, 0.2]]] * 2)
    scheduler = RoutedScheduler(ssms, favouring(0), cost, calibration=None, cost_correction=None)
    dec = SpeculativeDecoder(llm, ssms, speculator=scheduler, compile=True)
    ids = torch.randint(1, 60, (2, 230), generator=torch.Generator().manual_seed(0))
    expected = llm.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)

    def drafters() -> set[str]:
        """The SSMs that drafted in a generation of `ids` (which equals `llm.generate`'s)."""
        out = dec.generate(ids, max_new_tokens=12)
        assert torch.equal(out.sequences, expected)
        actions = {action for row in out.stats.sequences for action in row.strategy["actions"]}
        return {action.split(" x")[0] for action in actions} - {"plain", "off"}

    assert drafters() == {"SSM 0"}  # the warm-up
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    scheduler.router = ChainRouter(favouring(1), cost, calibration=None, cost_correction=None)
    # The router's steps draft SSM 1; held steps draft the hold's preferred action (ALGORITHMS.md
    # 5.4, "Holding"): SSM 0's from the warm-up, SSM 1's once the router has drafted it more.
    assert {"SSM 1"} <= drafters() <= {"SSM 1", "held SSM 0", "held SSM 1"}
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def generate_after_warmup(dec: SpeculativeDecoder, warm: bool = True) -> list[dict]:
    """`warmup` (unless `warm` is False: the caller warmed it), then a generation per prompt: each
    equals `llm.generate`'s and none compiles a new graph; returns the strategy's report of each."""
    if warm:
        dec.warmup()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    reports = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = dec.generate(ids, max_new_tokens=24)
        expected = dec.llm.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24
        )
        assert torch.equal(out.sequences, expected)
        reports.append(out.stats.strategy)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    return reports


@pytest.mark.slow
def test_profile_measures_the_chain_tables_on_the_compiled_loop() -> None:
    """`specboost profile --compile`: the chain tables of the compiled loop too, which a compiled
    decoder's router then takes (ALGORITHMS.md 5.3)."""
    llm, ssms, predictor = two_ssms_and_a_random_predictor(bias=0.7)
    config = ProfileConfig(
        (1, 2), (1, 2), (1, 4), prefix_length=8, repeats=1, batch_sizes=(1, 2), compile=True
    )
    cost = profile(llm, ssms, config, show_progress=False)
    assert cost.has_compiled_chain_costs
    assert (
        len(cost.compiled_chain_seconds) == 2
        and min(min(row) for row in cost.compiled_chain_verify_seconds) > 0
    )
    decoder = SpeculativeDecoder(
        llm, ssms, strategy="learned", predictor=predictor, cost_model=cost, compile=True
    )
    assert decoder.speculator.router.compiled
