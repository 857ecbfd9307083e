"""Distribution distillation and boosting for sampling (ALGORITHMS.md section 15): the bucketed
losses against brute force, `--loss kl|tv|mix`, `--boost-mode sampled` (weights, resume), the
refusal of data without stored distributions, and the exported manifest's fields."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import tiny_llama
from test_boost import VOCAB, config, save_llama, save_tokenizer, write_distilled
from transformers import TrainingArguments

from specboost.training import boost as boost_module
from specboost.training import export
from specboost.training.boost import ACCEPTANCE_FILE, boost, load_acceptance, main, setup
from specboost.training.boost_data import (
    PadCollator,
    acceptance_weights,
    load_row_targets,
    split_held_out,
    training_examples,
)
from specboost.training.boost_scoring import output_acceptance
from specboost.training.distill import DistillConfig, distill
from specboost.training.distribution_loss import bucketed_kl, bucketed_tv, position_losses
from specboost.training.ssm_setup import build_ssm, load_ssm
from specboost.training.ssm_training import DistributionTrainer
from specboost.training.target_distributions import PositionTargets, distribution_columns

torch.set_num_threads(1)  # tiny models; the machine may be busy
T = 0.8


# ---------------------------------------------------------------- the losses against brute force


def full_kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return torch.xlogy(p, p).sum(-1) - (p * q.log()).sum(-1)


def stored_top_k(p: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    probs, ids = p.topk(k, dim=-1)
    return ids, probs, (1 - probs.sum(-1)).clamp(min=0)


def test_with_the_whole_vocabulary_the_bucketed_losses_are_the_full_ones() -> None:
    g = torch.Generator().manual_seed(0)
    logits, p = torch.randn(5, 11, generator=g), torch.softmax(torch.randn(5, 11, generator=g) * 2, -1)
    q = torch.softmax(logits / T, -1)
    ids, probs, _ = stored_top_k(p, 11)
    tail = torch.zeros(5)  # K = V: the bucket is empty
    assert torch.allclose(bucketed_kl(logits, ids, probs, tail, T), full_kl(p, q), atol=1e-5)
    assert torch.allclose(bucketed_tv(logits, ids, probs, tail, T), 0.5 * (p - q).abs().sum(-1), atol=1e-6)
    # An empty bucket gives finite gradients (log q_tail is clamped smoothly).
    logits.requires_grad_(True)
    bucketed_kl(logits, ids, probs, tail, T).sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_with_a_tail_the_bucket_term_is_the_hand_computed_one_and_a_lower_bound() -> None:
    g = torch.Generator().manual_seed(1)
    logits, p = torch.randn(6, 13, generator=g), torch.softmax(torch.randn(6, 13, generator=g), -1)
    q = torch.softmax(logits / T, -1)
    ids, probs, tail = stored_top_k(p, 4)
    q_top = q.gather(-1, ids)
    q_tail = 1 - q_top.sum(-1)
    kl = (probs * (probs / q_top).log()).sum(-1) + tail * (tail / q_tail).log()
    tv = 0.5 * ((probs - q_top).abs().sum(-1) + (tail - q_tail).abs())
    assert torch.allclose(bucketed_kl(logits, ids, probs, tail, T), kl, atol=1e-5)
    assert torch.allclose(bucketed_tv(logits, ids, probs, tail, T), tv, atol=1e-6)
    # Lower bounds of the full values (log-sum and triangle inequalities), so 1 - TV_b >= 1 - TV.
    assert (bucketed_kl(logits, ids, probs, tail, T) <= full_kl(p, q) + 1e-6).all()
    assert (bucketed_tv(logits, ids, probs, tail, T) <= 0.5 * (p - q).abs().sum(-1) + 1e-6).all()


def test_tv_is_exact_when_p_has_no_tail() -> None:
    """p cut by top-p inside the stored K: the tail term is q_tail, exactly the full TV."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 9, generator=g)
    p = torch.zeros(4, 9)
    p[:, :3] = torch.softmax(torch.randn(4, 3, generator=g), -1)
    q = torch.softmax(logits / T, -1)
    ids, probs, tail = stored_top_k(p, 5)
    assert torch.allclose(bucketed_tv(logits, ids, probs, tail, T), 0.5 * (p - q).abs().sum(-1), atol=1e-6)


def test_kl_gradient_is_the_derived_one() -> None:
    """dKL_b/dz_i = (q_i - t_i) / T: t = p on the stored tokens, p_tail q_i / q_tail on the tail."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 10, generator=g, requires_grad=True)
    p = torch.softmax(torch.randn(3, 10, generator=g), -1)
    ids, probs, tail = stored_top_k(p, 4)
    bucketed_kl(logits, ids, probs, tail, T).sum().backward()
    q = torch.softmax(logits.detach() / T, -1)
    stored = torch.zeros_like(q, dtype=torch.bool).scatter(-1, ids, True)
    q_tail = (q * ~stored).sum(-1, keepdim=True)
    target = torch.where(stored, torch.zeros_like(q).scatter(-1, ids, probs), tail[:, None] * q / q_tail)
    assert torch.allclose(logits.grad, (q - target) / T, atol=1e-5)
    assert logits.grad.abs().sum() > 0


def test_position_losses_ce_and_mix() -> None:
    g = torch.Generator().manual_seed(4)
    logits, labels = torch.randn(5, 8, generator=g), torch.randint(0, 8, (5,), generator=g)
    ids, probs, tail = stored_top_k(torch.softmax(torch.randn(5, 8, generator=g), -1), 3)
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    assert torch.allclose(position_losses("ce", logits, labels, None, None), ce)
    mix = position_losses("mix", logits, labels, (ids, probs, tail), T, mix_weight=0.5)
    assert torch.allclose(mix, ce + 0.5 * bucketed_kl(logits, ids, probs, tail, T))
    with pytest.raises(ValueError, match="needs the stored distributions"):
        position_losses("kl", logits, labels, None, None)


def test_weighted_trainer_loss_with_unit_weights_is_the_models_own(tmp_path: Path) -> None:
    model = tiny_llama(layers=1, vocab=VOCAB)
    rows = [
        {"id": 0, "prompt_ids": [1, 7, 8], "output_ids": [5, 6, 9]},
        {"id": 1, "prompt_ids": [1, 4], "output_ids": [5]},
    ]
    weights = {0: torch.ones(3), 1: torch.ones(1)}
    batch = PadCollator(0)(list(training_examples(rows, {}, None, weights)))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = DistributionTrainer(model=model, args=args, loss="ce", temperature=None, mix_weight=1.0)
    ours = trainer.compute_loss(model, dict(batch))
    plain = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
    ).loss
    assert torch.allclose(ours, plain, atol=1e-6)
    assert batch["weights"].tolist() == [[0, 0, 0, 1, 1, 1], [0, 0, 1, 0, 0, 0]]  # at the output labels


# ---------------------------------------------------------------- boost on stored distributions


@pytest.fixture
def llm(tmp_path: Path) -> str:
    folder = tmp_path / "llm"
    save_llama(folder, VOCAB)
    save_tokenizer(folder, [f"w{i}" for i in range(VOCAB - 4)])
    return str(folder)


def write_distilled_with_targets(folder: Path, rows: list[tuple[list[int], list[int]]], targets: list) -> str:
    """A distill run by hand with stored distributions (p recorded at T) and its metadata."""
    write_distilled(folder, rows)
    table = pq.read_table(folder / "data.parquet")
    for name, column in distribution_columns(targets).items():
        table = table.append_column(name, column)
    pq.write_table(table, folder / "data.parquet")
    info = {
        "top_k": targets[0].ids.shape[1],
        "temperature": T,
        "top_p": 1.0,
        "recorded_from": "sampled outputs",
    }
    (folder / "metadata.json").write_text(json.dumps({"distributions": info}))
    return str(folder)


def position_targets(ids: list[list[int]], probs: list[list[float]]) -> PositionTargets:
    p = np.array(probs, dtype=np.float16)
    return PositionTargets(np.array(ids, np.int32), p, (1 - p.astype(np.float32).sum(-1)).clip(0))


@pytest.fixture
def distributions(tmp_path: Path) -> str:
    """24 samples: even ones follow a learnable rule (after 5 comes 5 with p = 0.6, 6 with 0.3, ...),
    odd ones are random tokens with random p."""
    g = torch.Generator().manual_seed(1)
    rows, targets = [], []
    for i in range(24):
        prompt = [1, *torch.randint(4, VOCAB, (3,), generator=g).tolist()]
        if i % 2 == 0:
            output = [5] * 6
            stored = position_targets([[5, 6, 7, 8]] * 6, [[0.6, 0.3, 0.05, 0.0]] * 6)
        else:
            output = torch.randint(4, VOCAB, (6,), generator=g).tolist()
            ids = [torch.randperm(VOCAB - 4, generator=g)[:4].add(4).tolist() for _ in range(6)]
            probs = torch.softmax(torch.randn(6, 4, generator=g) * 2, -1) * 0.9
            stored = position_targets(ids, probs.tolist())
        rows.append((prompt, output))
        targets.append(stored)
    return write_distilled_with_targets(tmp_path / "distributions", rows, targets)


def held_out_acceptance(cfg, out_ssm) -> float:
    _, _, rows = setup(cfg)
    targets = load_row_targets(cfg, rows)
    held = set(split_held_out(rows, cfg.held_out_fraction, cfg.seed))
    accepted = output_acceptance(out_ssm, [r for r in rows if r["id"] in held], targets, 0, 16, "score")
    return float(torch.cat(list(accepted.values())).mean())


def test_kl_training_raises_held_out_sampled_acceptance(llm: str, distributions: str, tmp_path: Path) -> None:
    cfg = config(llm, distributions, num_ssms=1, loss="kl", max_steps=60, save_steps=60, learning_rate=1e-2)
    _, ssm_config, _ = setup(cfg)
    before = held_out_acceptance(cfg, build_ssm(cfg, ssm_config, 0))  # the same seeded start
    record = boost(cfg, tmp_path / "pool")
    after = record["rounds"][0]["held_out_sampled_acceptance"]
    assert after == pytest.approx(held_out_acceptance(cfg, load_ssm(tmp_path / "pool" / "ssm-0")))
    assert after > before + 0.1, (before, after)
    assert record["loss"] == "kl" and record["boost_mode"] == "greedy" and record["target_temperature"] == T
    assert record["rounds"][0]["pool_sampled_acceptance"] == pytest.approx(after)


def test_sampled_boost_weights_favour_what_the_pool_serves_worst_and_resume(
    llm: str, distributions: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(
        llm, distributions, boost_mode="sampled", loss="kl", max_steps=60, save_steps=60, learning_rate=1e-2
    )
    seen: dict[str, list] = {"straight": [], "resumed": []}
    run = ["straight"]
    real_examples, real_train = training_examples, boost_module.train_round

    def spy_examples(rows, masked, max_len, weights=None, targets=None):
        seen[run[0]].append(weights)
        return real_examples(rows, masked, max_len, weights, targets)

    monkeypatch.setattr(boost_module, "training_examples", spy_examples)
    record = boost(cfg, tmp_path / "pool")
    assert seen["straight"][0] is None and seen["straight"][1] is not None  # round 0: uniform

    # Round 1's weights: 1 - the pool's acceptance after round 0, mean 1, lower on the learnt rule.
    _, _, rows = setup(cfg)
    held = set(record["held_out_ids"])
    train_rows = [r for r in rows if r["id"] not in held]
    pool = load_acceptance(tmp_path / "pool" / "round-0" / ACCEPTANCE_FILE, train_rows)
    weights = seen["straight"][1]
    expected = acceptance_weights(pool, train_rows)
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    assert float(torch.cat(list(weights.values())).mean()) == pytest.approx(1.0, abs=1e-5)
    even = torch.cat([weights[r["id"]] for r in train_rows if r["id"] % 2 == 0]).mean()
    odd = torch.cat([weights[r["id"]] for r in train_rows if r["id"] % 2 == 1]).mean()
    assert even < 0.5 * odd, (float(even), float(odd))

    assert (
        record["boost_mode"] == "sampled" and record["marking"] is None and record["target_temperature"] == T
    )
    pools = [r["pool_sampled_acceptance"] for r in record["rounds"]]
    assert pools == sorted(pools) and all(r["marked"] is None for r in record["rounds"])
    assert all(
        r["pool_sampled_acceptance"] >= r["held_out_sampled_acceptance"] - 1e-6 for r in record["rounds"]
    )
    assert (tmp_path / "pool" / "coverage.png").stat().st_size > 0

    # Killed after round 0: the resumed round 1 trains with exactly the same weights.
    run[0] = "resumed"

    def dying_train(cfg, i, *args):
        if i == 1 and not seen.get("killed"):
            seen["killed"] = [True]
            raise KeyboardInterrupt
        return real_train(cfg, i, *args)

    monkeypatch.setattr(boost_module, "train_round", dying_train)
    with pytest.raises(KeyboardInterrupt):
        boost(cfg, tmp_path / "killed")
    seen["resumed"].clear()
    resumed = boost(cfg, tmp_path / "killed")
    assert len(seen["resumed"]) == 1  # round 0 was skipped
    assert all(torch.equal(seen["resumed"][0][k], weights[k]) for k in weights)
    assert resumed["rounds"][1]["pool_sampled_acceptance"] == pytest.approx(pools[1], rel=1e-5)


def test_distribution_losses_refuse_data_without_distributions(llm: str, tmp_path: Path, capsys) -> None:
    plain = write_distilled(tmp_path / "plain", [([1, 4, 5], [6, 7]), ([1, 8], [9, 10]), ([1, 11], [12])])
    for flags in (["--loss", "kl"], ["--loss", "mix"], ["--boost-mode", "sampled"]):
        out = tmp_path / "out"
        assert main(["--distilled", plain, "--llm", llm, "--out", str(out), *flags]) == 2
        err = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("error: "))
        assert " ".join(flags) in err and "has none" in err
        assert (
            'make distill DISTILL_FLAGS="--top-k-probs 64' in err
            and "python -m specboost.training.distill" in err
        )
        assert not out.exists()


def test_distill_then_boost_then_export_carries_the_build(llm: str, tmp_path: Path) -> None:
    """Real distill output (several samples a prompt, top-K recorded) through boost --loss mix
    and export: the manifest and model cards say how the pool was built."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"q": f"w{i} w{i + 1} w{i + 2}"}) + "\n" for i in range(10)))
    distilled = tmp_path / "distilled"
    distill(
        DistillConfig(
            llm=llm,
            prompts=str(prompts),
            prompt_field="q",
            max_new_tokens=5,
            do_sample=True,
            temperature=T,
            num_samples=2,
            top_k_probs=8,
            batch_size=4,
            repeat_min_count=0,
        ),
        distilled,
    )
    cfg = config(llm, str(distilled), num_ssms=1, loss="mix", mix_weight=0.5, boost_mode="sampled")
    record = boost(cfg, tmp_path / "pool")
    held = set(record["held_out_ids"])
    columns = pq.read_table(distilled / "data.parquet", columns=["id", "prompt_id"]).to_pydict()
    prompt_of = dict(zip(columns["id"], columns["prompt_id"], strict=True))
    assert {prompt_of[i] for i in held}.isdisjoint(prompt_of[i] for i in prompt_of if i not in held)
    manifest = export.export_pool(tmp_path / "pool", tmp_path / "export")
    assert (manifest["boost_mode"], manifest["loss"], manifest["target_temperature"]) == ("sampled", "mix", T)
    assert (
        manifest["ssms"][0]["held_out_sampled_acceptance"]
        == record["rounds"][0]["held_out_sampled_acceptance"]
    )
    on_disk = json.loads((tmp_path / "export" / "specboost_pool.json").read_text())
    assert on_disk["loss"] == "mix" and on_disk["target_temperature"] == T
    card = (tmp_path / "export" / "ssm-0" / "README.md").read_text()
    assert "cross-entropy + 0.5 x KL(p || q)" in card and f"temperature {T}" in card
    assert "sampled boost mode" in card and "held-out sampled acceptance" in card
    assert "boost mode\n`sampled`" in (tmp_path / "export" / "README.md").read_text()
    # A record from before these fields: a greedy CE pool.
    assert export.build_info({"marking": "sample"}) == {
        "boost_mode": "greedy",
        "loss": "ce",
        "target_temperature": None,
    }


def test_tables_with_distributions_keep_their_compact_types(tmp_path: Path) -> None:
    targets = [position_targets([[5, 6]] * 3, [[0.5, 0.25]] * 3), position_targets([[7, 8]], [[0.9, 0.1]])]
    table = pa.table(distribution_columns(targets))
    pq.write_table(table, tmp_path / "t.parquet")
    back = pq.read_table(tmp_path / "t.parquet")
    assert back.column("top_k_probs").to_pylist()[0] == [[0.5, 0.25]] * 3
    assert back.column("tail_prob").to_pylist()[1] == [pytest.approx(0.0, abs=1e-3)]
    assert str(back.schema.field("top_k_ids").type) == "list<element: list<element: int32>>"
