"""Boost-tuning (ALGORITHMS.md 4): marking rules, the round loop, output contract, resume, errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from specboost.training import boost as boost_module
from specboost.training import specialists as specialists_module
from specboost.training import ssm_training
from specboost.training.boost import boost, main
from specboost.training.boost_config import BoostConfig
from specboost.training.boost_data import split_held_out
from specboost.training.boost_scoring import (
    hits_from_logits,
    mark,
    match_lengths,
    output_hits,
    sample_marked,
    span_marked,
)
from specboost.training.specialists import Units, balance, initial_assignment, reassign

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS = [f"w{i}" for i in range(28)]
VOCAB = len(SPECIAL) + len(WORDS)


def save_tokenizer(folder: Path, words: list[str]) -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(SPECIAL + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(folder)
    return fast


def save_llama(folder: Path, vocab: int, hidden: int = 32, layers: int = 2) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(folder)


@pytest.fixture
def llm(tmp_path: Path) -> str:
    folder = tmp_path / "llm"
    save_llama(folder, VOCAB)
    save_tokenizer(folder, WORDS)
    return str(folder)


def write_distilled(
    folder: Path,
    rows: list[tuple[list[int], list[int]]],
    sources: list[str] | None = None,
    filters: list[str] | None = None,
) -> str:
    """A distill run folder by hand: data.parquet rows in distill's schema, all kept unless
    `filters` names the filter that dropped a row (with a `source` column when `sources` are
    given)."""
    folder.mkdir(parents=True)
    table = [
        {
            "id": i,
            "prompt": "",
            "prompt_ids": p,
            "output_ids": o,
            "output": "",
            "finish_reason": "length",
            "filter": "" if filters is None else filters[i],
        }
        for i, (p, o) in enumerate(rows)
    ]
    schema = pa.schema(
        [
            ("id", pa.int64()),
            ("prompt", pa.string()),
            ("prompt_ids", pa.list_(pa.int64())),
            ("output_ids", pa.list_(pa.int64())),
            ("output", pa.string()),
            ("finish_reason", pa.string()),
            ("filter", pa.string()),
        ]
    )
    if sources is not None:
        for row, source in zip(table, sources, strict=True):
            row["source"] = source
        schema = schema.append(pa.field("source", pa.string()))
    pq.write_table(pa.Table.from_pylist(table, schema=schema), folder / "data.parquet")
    return str(folder)


@pytest.fixture
def distilled(tmp_path: Path) -> str:
    """Sixteen samples: half follow a trivially learnable rule (output = a repeated token), half not."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(16):
        prompt = [1, *torch.randint(4, VOCAB, (3,), generator=g).tolist()]
        output = [5] * 6 if i % 2 == 0 else torch.randint(4, VOCAB, (6,), generator=g).tolist()
        rows.append((prompt, output))
    return write_distilled(tmp_path / "distilled", rows)


def config(llm: str, distilled: str, **kwargs) -> BoostConfig:
    settings = {
        "num_ssms": 2,
        "ssm_config": "tenth",
        "max_steps": 4,
        "batch_size": 4,
        "learning_rate": 5e-3,
        "warmup_steps": 0,
        "save_steps": 2,
        "held_out_fraction": 0.25,
    }
    return BoostConfig(llm=llm, distilled=distilled, **{**settings, **kwargs})


class SimulatedKill(Exception):
    pass


# ---------------------------------------------------------------- marking rules on hand-made cases


def test_hits_from_hand_made_logits_mark_the_reproduced_sample() -> None:
    # rows: prompt [1, 7] + output; A = [4, 5, 6] is predicted everywhere, B = [4, 9, 6] is not at k=1.
    ids = torch.tensor([[1, 7, 4, 5, 6], [1, 7, 4, 9, 6]])  # [B, T]
    predicted = torch.tensor([[0, 4, 5, 6, 0], [0, 4, 5, 6, 0]])  # the argmax after each position
    logits = torch.nn.functional.one_hot(predicted, 10).float()  # [B, T, V]
    a, b = hits_from_logits(logits, ids, [2, 2], [3, 3])
    assert a.tolist() == [True, True, True] and b.tolist() == [True, False, True]
    assert sample_marked(a) and not sample_marked(b)


def test_span_marking_and_match_lengths() -> None:
    hits = torch.tensor([True, True, False, True, True, True])
    assert span_marked(hits, 2).tolist() == [True, False, False, True, True, True]  # tail: what is left
    assert span_marked(hits, 3).tolist() == [False, False, False, True, True, True]
    assert match_lengths(hits, 4).tolist() == [2, 1, 0, 3, 2, 1]


def test_mark_removes_samples_or_masks_positions() -> None:
    hits = {0: torch.tensor([True, True]), 1: torch.tensor([True, False, True])}
    masked, removed = {}, set()
    assert mark(BoostConfig(llm="x", distilled="y"), hits, masked, removed) == 1
    assert removed == {0} and masked == {}
    masked, removed = {}, set()
    assert mark(BoostConfig(llm="x", distilled="y", marking="span", span_depth=2), hits, masked, removed) == 3
    assert removed == {0} and masked == {0: {0, 1}, 1: {2}}


def test_held_out_split_is_seeded_and_leaves_training_data() -> None:
    rows = [{"id": i} for i in range(20)]
    assert split_held_out(rows, 0.25, 0) == split_held_out(rows, 0.25, 0)
    assert len(split_held_out(rows, 0.25, 0)) == 5
    assert len(split_held_out(rows[:2], 0.9, 0)) == 1


# ---------------------------------------------------------------- the round loop and its outputs


def test_round_loop_trains_later_ssms_on_unmarked_samples_only(
    llm: str, distilled: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trained_on: list[int] = []
    real_train = boost_module.train_round
    real_hits = output_hits

    def spy_train(cfg, i, train_set, *args):
        trained_on.append(len(train_set))
        return real_train(cfg, i, train_set, *args)

    def rigged_hits(model, rows, pad_id, batch_size, desc):
        hits = real_hits(model, rows, pad_id, batch_size, desc)
        if desc.endswith("mark"):  # pretend SSM 0 reproduces exactly the even-id samples
            hits = {k: torch.full_like(h, k % 2 == 0) for k, h in hits.items()}
        return hits

    monkeypatch.setattr(boost_module, "train_round", spy_train)
    monkeypatch.setattr(boost_module, "output_hits", rigged_hits)
    out = tmp_path / "pool"
    record = boost(config(llm, distilled), out)
    held = set(record["held_out_ids"])
    train_ids = [i for i in range(16) if i not in held]
    odd = [i for i in train_ids if i % 2]
    assert trained_on == [len(train_ids), len(odd)]
    assert record["rounds"][0]["marked"] == len(train_ids) - len(odd)
    assert record["rounds"][1]["train_samples"] == len(odd)
    state = json.loads((out / "boost_state.json").read_text())
    assert set(state["removed"]) >= {i for i in train_ids if i % 2 == 0}
    assert held.isdisjoint(state["removed"])


def test_output_contract(llm: str, distilled: str, tmp_path: Path) -> None:
    out = tmp_path / "pool"
    record = boost(config(llm, distilled, marking="span", span_depth=2), out)
    on_disk = json.loads((out / "boost_record.json").read_text())
    assert on_disk["rounds"] == record["rounds"] and on_disk["marking"] == "span"
    assert {"llm", "distilled", "base", "marking", "rounds", "held_out_ids", "seed", "versions"} <= set(
        on_disk
    )
    assert (out / "coverage.png").stat().st_size > 0
    coverages = [r["pool_coverage"] for r in record["rounds"]]
    assert coverages == sorted(coverages)  # the union only grows
    for r in record["rounds"]:
        keys = {
            "ssm",
            "path",
            "train_samples",
            "marked",
            "held_out_acceptance",
            "held_out_mean_match_length",
            "pool_coverage",
            "steps",
            "final_loss",
        }
        assert keys <= set(r) and r["steps"] == 4
        assert 0 <= r["held_out_acceptance"] <= 1 and 0 <= r["held_out_mean_match_length"] <= 4
        model = AutoModelForCausalLM.from_pretrained(out / r["path"])
        assert model.config.vocab_size == VOCAB
        assert (
            AutoTokenizer.from_pretrained(out / r["path"]).get_vocab()
            == AutoTokenizer.from_pretrained(llm).get_vocab()
        )


def test_kill_after_round_one_resumes_to_the_same_record(
    llm: str, distilled: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(llm, distilled)
    reference = boost(cfg, tmp_path / "reference")
    real_train = boost_module.train_round
    calls: list[int] = []
    kill = [True]

    def dying_train(cfg, i, *args):
        calls.append(i)
        if i == 1 and kill and kill.pop():
            raise SimulatedKill("killed after round 0")
        return real_train(cfg, i, *args)

    monkeypatch.setattr(boost_module, "train_round", dying_train)
    out = tmp_path / "pool"
    with pytest.raises(SimulatedKill):
        boost(cfg, out)
    assert len(json.loads((out / "boost_state.json").read_text())["rounds"]) == 1
    calls.clear()
    resumed = boost(cfg, out)
    assert calls == [1]  # round 0 was skipped
    assert len(resumed["rounds"]) == len(reference["rounds"]) == 2
    for got, want in zip(resumed["rounds"], reference["rounds"], strict=True):
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] == (pytest.approx(value, rel=1e-5) if isinstance(value, float) else value), key
    assert resumed["held_out_ids"] == reference["held_out_ids"]


def test_a_partly_finished_round_resumes_from_its_checkpoint(
    llm: str, distilled: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(llm, distilled, num_ssms=1)
    reference = boost(cfg, tmp_path / "reference")
    real_save, real_last = ssm_training.save_ssm, ssm_training.last_checkpoint
    resumed_from: list[Path | None] = []

    def dying_save(*args):
        raise SimulatedKill("killed before the SSM was saved")

    monkeypatch.setattr(ssm_training, "save_ssm", dying_save)
    with pytest.raises(SimulatedKill):
        boost(cfg, tmp_path / "pool")
    monkeypatch.setattr(ssm_training, "save_ssm", real_save)
    monkeypatch.setattr(
        ssm_training, "last_checkpoint", lambda p: resumed_from.append(real_last(p)) or real_last(p)
    )
    record = boost(cfg, tmp_path / "pool")
    assert resumed_from[0] is not None and resumed_from[0].name == "checkpoint-4"
    assert record["rounds"][0]["steps"] == 4
    assert record["rounds"][0]["marked"] == reference["rounds"][0]["marked"]
    assert record["rounds"][0]["pool_coverage"] == pytest.approx(reference["rounds"][0]["pool_coverage"])


def test_lora_and_a_given_base(llm: str, distilled: str, tmp_path: Path) -> None:
    base = tmp_path / "base"
    save_llama(base, VOCAB, hidden=16, layers=1)
    record = boost(
        config(llm, distilled, num_ssms=1, ssm_base=str(base), lora=True, lora_rank=4), tmp_path / "p"
    )
    assert record["base"] == str(base)
    state = AutoModelForCausalLM.from_pretrained(tmp_path / "p" / "ssm-0").state_dict()
    assert not any("lora" in name for name in state)  # merged


# ---------------------------------------------------------------- errors a user can cause


def test_vocab_mismatch_is_refused(llm: str, distilled: str, tmp_path: Path) -> None:
    base = tmp_path / "other"
    save_llama(base, VOCAB + 8, hidden=16, layers=1)
    with pytest.raises(ValueError, match="vocabulary of 40 tokens but the LLM has 32"):
        boost(config(llm, distilled, ssm_base=str(base)), tmp_path / "p")
    save_llama(base, VOCAB, hidden=16, layers=1)
    save_tokenizer(base, list(reversed(WORDS)))
    with pytest.raises(ValueError, match="tokenizer maps tokens to other ids"):
        boost(config(llm, distilled, ssm_base=str(base)), tmp_path / "p")


def test_empty_distilled_data_is_refused(llm: str, tmp_path: Path) -> None:
    empty = write_distilled(tmp_path / "empty", [])
    with pytest.raises(ValueError, match="no usable distilled samples"):
        boost(config(llm, empty), tmp_path / "p")
    assert main(["--distilled", empty, "--llm", llm, "--out", str(tmp_path / "p")]) == 2


def test_other_settings_are_refused_on_resume(llm: str, distilled: str, tmp_path: Path) -> None:
    boost(config(llm, distilled, num_ssms=1), tmp_path / "p")
    with pytest.raises(ValueError, match="other settings"):
        boost(config(llm, distilled, num_ssms=1, marking="span"), tmp_path / "p")


# ---------------------------------------------------------------- specialists mode (ALGORITHMS.md 4.1)

DOMAIN_A, DOMAIN_B = list(range(14, 23)), list(range(23, 32))  # the prompts' disjoint token ranges
RING = list(range(4, 14))  # the tokens both domains' outputs run through


def two_domains(count: int, seed: int = 2) -> tuple[list[tuple[list[int], list[int]]], list[str]]:
    """Samples of two clearly different "domains", alternating. Their prompts use disjoint token
    ranges; their outputs run through the same ring of tokens from a random start, A counting up
    and B counting down, so that after the same token the two want different next tokens and a
    small SSM serves one domain better when it trains on that domain alone."""
    g = torch.Generator().manual_seed(seed)
    rows, sources = [], []
    for i in range(count):
        domain, step = (DOMAIN_A, 1) if i % 2 == 0 else (DOMAIN_B, -1)
        prompt = [1, *(domain[int(t)] for t in torch.randint(len(domain), (3,), generator=g))]
        start = int(torch.randint(len(RING), (1,), generator=g))
        output = [RING[(start + step * j) % len(RING)] for j in range(6)]
        rows.append((prompt, output))
        sources.append("a" if i % 2 == 0 else "b")
    return rows, sources


@pytest.fixture
def domain_llm(tmp_path: Path) -> str:
    """The tiny LLM, with input embeddings that know the prompts' two token ranges apart (as a
    trained LLM's embeddings know topics apart): the clustering feature can then see them."""
    folder = tmp_path / "domain-llm"
    save_llama(folder, VOCAB)
    save_tokenizer(folder, WORDS)
    model = LlamaForCausalLM.from_pretrained(folder)
    direction = torch.nn.functional.normalize(torch.randn(model.config.hidden_size), dim=0)
    with torch.no_grad():
        model.get_input_embeddings().weight[DOMAIN_A] += 0.1 * direction
        model.get_input_embeddings().weight[DOMAIN_B] -= 0.1 * direction
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture
def domains(tmp_path: Path) -> str:
    rows, sources = two_domains(24)
    return write_distilled(tmp_path / "domains", rows, sources)


def specialists(llm: str, distilled: str, **kwargs) -> BoostConfig:
    settings = {
        "boost_mode": "specialists",
        "em_rounds": 2,
        "max_steps": 16,
        "learning_rate": 2e-2,
        "held_out_fraction": 0.2,
    }
    return config(llm, distilled, **{**settings, **kwargs})


def domain_purity(out: Path, record: dict, round_index: int) -> float:
    """The fraction of training samples whose member is their domain's majority member."""
    assignment = np.load(out / f"round-{round_index}" / "assignment.npy")
    held = set(record["held_out_ids"])
    domain = np.array([i % 2 for i in range(24) if i not in held])
    agree = float((assignment == domain).mean())
    return max(agree, 1 - agree)


def test_balance_guard_moves_the_smallest_margins_and_keeps_ties() -> None:
    scores = np.array([[3.0, 0.0], [2.0, 1.9], [2.0, 0.5], [1.0, 0.2], [0.0, 0.0], [0.5, 0.0]])
    current = np.array([1, 1, 1, 1, 1, 0])
    assignment, moved = reassign(scores, current, min_count=2)
    # rows 0-3 and 5 prefer member 0; the tie (row 4) stays where it is; member 1 is short by one and
    # takes row 1, the sample that loses least (2.0 - 1.9) by moving
    assert assignment.tolist() == [0, 1, 0, 0, 1, 0] and moved == 1
    lopsided, moved = balance(np.zeros((9, 3)), np.zeros(9, dtype=np.int64), min_count=3)
    assert np.bincount(lopsided, minlength=3).tolist() == [3, 3, 3] and moved == 6


def test_initial_clusters_follow_the_feature() -> None:
    g = np.random.default_rng(0)
    one, other = np.array([5.0, 0, 0, 0]), np.array([0, -5.0, 0, 0])
    features = np.concatenate([g.normal(0, 0.1, (10, 4)) + one, g.normal(0, 0.1, (4, 4)) + other])
    assignment = initial_assignment(features, 2, seed=0, min_count=5)
    assert len(set(assignment[10:])) == 1 and (assignment == assignment[10]).sum() == 5  # guard: 4 + 1
    assert (initial_assignment(features, 2, seed=0, min_count=5) == assignment).all()  # seeded


def test_specialists_split_two_domains(domain_llm: str, domains: str, tmp_path: Path) -> None:
    out = tmp_path / "pool"
    record = boost(specialists(domain_llm, domains), out)
    assert record["boost_mode"] == "specialists" and record["marking"] is None
    assert record["em"]["rounds"] == 2 and len(record["em"]["history"]) == 2
    assert [r["steps"] for r in record["rounds"]] == [16, 16]  # the pool: 2 x max_steps in all
    fewest = int(0.5 * (24 - len(record["held_out_ids"])) / 2)  # the balance guard's floor
    for em_round in record["em"]["history"]:
        assert [m["steps"] for m in em_round["members"]] == [8, 8]
        assert sum(m["share"] for m in em_round["members"]) == pytest.approx(1)
        for m in em_round["members"]:
            assert {"own_mean_match_length", "held_out_mean_match_length", "pool_coverage"} <= set(m)
            assert m["train_samples"] >= fewest and sum(m["source_shares"].values()) == pytest.approx(1)
    for r in range(3):
        assert domain_purity(out, record, r) == 1.0, r
    final = record["em"]["history"][-1]["members"]
    assert sorted(max(m["next_source_shares"].values()) for m in final) == [1.0, 1.0]
    assert [r["path"] for r in record["rounds"]] == ["ssm-0", "ssm-1"]
    assert (out / "round-0" / "ssm-0").is_dir() and (out / "coverage.png").stat().st_size > 0


def test_em_repairs_a_mixed_start(
    domain_llm: str, domains: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = set(split_held_out([{"id": i} for i in range(24)], 0.2, 0))
    domain = np.array([i % 2 for i in range(24) if i not in held])

    def mixed(features, members, seed, min_count):  # a third of each domain in the wrong member
        start = domain.copy()
        start[::3] = 1 - start[::3]
        return start

    monkeypatch.setattr(specialists_module, "initial_assignment", mixed)
    out = tmp_path / "pool"
    record = boost(specialists(domain_llm, domains), out)
    assert domain_purity(out, record, 0) < 0.7
    assert domain_purity(out, record, 2) == 1.0
    assert record["em"]["history"][0]["reassigned"] > 0


def test_specialists_resume_to_the_same_assignment(
    domain_llm: str, domains: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = specialists(domain_llm, domains)
    reference = boost(cfg, tmp_path / "reference")
    real_train = specialists_module.train_round
    calls: list[int] = []
    kill = [True]

    def dying_train(cfg, i, *args, **kwargs):
        calls.append(i)
        if i == 3 and kill and kill.pop():  # EM round 1, member 1 (seed index 1 x 2 + 1)
            raise SimulatedKill("killed in the second EM round")
        return real_train(cfg, i, *args, **kwargs)

    monkeypatch.setattr(specialists_module, "train_round", dying_train)
    out = tmp_path / "pool"
    with pytest.raises(SimulatedKill):
        boost(cfg, out)
    state = json.loads((out / "boost_state.json").read_text())
    assert len(state["em"]["rounds"]) == 1 and len(state["em"]["members"]) == 1
    calls.clear()
    resumed = boost(cfg, out)
    assert calls == [3]  # round 0 and round 1's member 0 were not trained again
    for r in range(3):
        got, want = (
            np.load(folder / f"round-{r}" / "assignment.npy") for folder in (out, tmp_path / "reference")
        )
        assert (got == want).all(), r
    for got, want in zip(resumed["em"]["history"], reference["em"]["history"], strict=True):
        assert got["reassigned"] == want["reassigned"]
        for got_member, want_member in zip(got["members"], want["members"], strict=True):
            for key, value in want_member.items():
                expected = pytest.approx(value, rel=1e-5) if isinstance(value, float) else value
                assert got_member[key] == expected, key


def test_span_units_mask_the_other_units_and_score_their_own_positions() -> None:
    rows = [{"id": 10, "output_ids": [1] * 5}, {"id": 11, "output_ids": [1] * 3}]
    units = Units.of(rows, 2)
    assert units.row.tolist() == [0, 0, 0, 1, 1] and units.start.tolist() == [0, 2, 4, 0, 2]
    chosen = np.array([True, False, True, False, False])
    picked, masked = units.training(rows, chosen)
    assert picked == rows[:1] and masked == {10: {2, 3}}  # row 11 holds no chosen unit: not trained
    # scored positions: row 0's last one cut by the context
    sums, counts = units.totals([np.array([4, 3, 2, 1]), np.array([1, 0, 2])])
    assert sums.tolist() == [7, 3, 0, 1, 2] and counts.tolist() == [2, 2, 0, 2, 1]
    whole = Units.of(rows, 0)
    assert whole.row.tolist() == [0, 1] and whole.training(rows, np.array([True, True])) == (rows, {})
    assert whole.totals([np.array([4, 3, 2, 1]), np.array([1, 0, 2])])[0].tolist() == [10, 3]


def test_specialists_assign_spans(domain_llm: str, domains: str, tmp_path: Path) -> None:
    """With --em-span 3 each sample's two spans of its 6 output positions are assigned on their
    own; every member still ends with the spans of one domain."""
    out = tmp_path / "pool"
    record = boost(specialists(domain_llm, domains, em_span=3), out)
    assert record["em"]["span"] == 3
    held = set(record["held_out_ids"])
    domain = np.array([i % 2 for i in range(24) if i not in held for _ in range(2)])
    for r in range(3):
        assignment = np.load(out / f"round-{r}" / "assignment.npy")
        assert assignment.shape == domain.shape
        agree = float((assignment == domain).mean())
        assert max(agree, 1 - agree) == 1.0, r
    for em_round in record["em"]["history"]:
        members = em_round["members"]
        assert sum(m["train_units"] for m in members) == len(domain)
        assert all(m["train_samples"] == m["train_units"] // 2 for m in members)


def test_specialists_settings_are_checked(llm: str, distilled: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_ssms >= 2"):
        BoostConfig(llm="x", distilled="y", boost_mode="specialists", num_ssms=1)
    with pytest.raises(ValueError, match="marking applies to boost_mode 'greedy' only"):
        BoostConfig(llm="x", distilled="y", boost_mode="specialists", marking="span")
    with pytest.raises(ValueError, match="em_rounds apply only to boost_mode 'specialists'"):
        BoostConfig(llm="x", distilled="y", em_rounds=3)
    with pytest.raises(ValueError, match="min_share must be in"):
        BoostConfig(llm="x", distilled="y", boost_mode="specialists", min_share=0)
    with pytest.raises(ValueError, match="em_feature must be one of"):
        BoostConfig(llm="x", distilled="y", boost_mode="specialists", em_feature="labels")
    with pytest.raises(ValueError, match="em_span must be >= 1"):
        BoostConfig(llm="x", distilled="y", boost_mode="specialists", em_span=-1)
    with pytest.raises(ValueError, match="em_span apply only"):
        BoostConfig(llm="x", distilled="y", em_span=8)
    specialist = BoostConfig(llm="x", distilled="y", boost_mode="specialists")
    assert "em_span" not in specialist.identity()  # runs from before the option resume
    assert dataclasses.replace(specialist, em_span=8).identity()["em_span"] == 8
    greedy = BoostConfig(llm="x", distilled="y").identity()
    assert not {"em_rounds", "em_feature", "min_share", "num_ssms", "boost_mode"} & set(
        greedy
    )  # old runs resume
    assert {"em_rounds", "num_ssms", "boost_mode"} <= set(
        BoostConfig(llm="x", distilled="y", boost_mode="specialists").identity()
    )
    with pytest.raises(ValueError, match="give max_steps >= em_rounds"):
        boost(specialists(llm, distilled, em_rounds=3, max_steps=2), tmp_path / "short")
    assert not (tmp_path / "short" / "boost_state.json").exists()  # refused before writing
    few = write_distilled(tmp_path / "few", [([1, 4], [5, 6]), ([1, 7], [8, 9])])
    with pytest.raises(ValueError, match="cannot be split among 2 specialists"):
        boost(specialists(llm, few, held_out_fraction=0.5), tmp_path / "p")
    argv = ["--distilled", distilled, "--llm", llm, "--out", str(tmp_path / "q")]
    assert main([*argv, "--em-rounds", "3"]) == 2  # greedy mode has no EM rounds


def test_specialists_command_line(domain_llm: str, domains: str, tmp_path: Path) -> None:
    argv = ["--distilled", domains, "--llm", domain_llm, "--out", str(tmp_path / "p"), "--num-ssms", "2"]
    flags = ["--boost-mode", "specialists", "--em-rounds", "2", "--max-steps", "4", "--batch-size", "4"]
    assert main([*argv, *flags, "--em-feature", "prompt-mean", "--threads", "1"]) == 0
    record = json.loads((tmp_path / "p" / "boost_record.json").read_text())
    assert record["em"]["feature"] == "prompt-mean" and len(record["rounds"]) == 2
