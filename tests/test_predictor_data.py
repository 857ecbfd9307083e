"""Labels for the match-length predictor (ALGORITHMS.md section 5): batched beam search equals the
drafter, references follow the LLM's greedy path, and collection resumes after a kill."""

from __future__ import annotations

import copy
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from conftest import VOCAB, tiny_llama
from test_boost import save_llama, save_tokenizer, write_distilled
from transformers import AutoModelForCausalLM, GenerationConfig

from specboost.speculator.beam_search import beam_match_lengths
from specboost.speculator.drafter import PoolDrafter
from specboost.speculator.sampling import LogitsToProbs, SamplingConfig
from specboost.speculator.shapes import BeamShape
from specboost.training import predictor_data
from specboost.training.predictor_data import PredictorDataConfig, collect, greedy_reference, load_labels

DEPTHS = (1, 2, 4, 8)


def drafter_match(ssm, context: list[int], reference: list[int], width: int, depth: int) -> int:
    """The match length of the decoder's own beam tree: the longest root path equal to the reference."""
    tree = PoolDrafter([ssm]).draft_one(
        context, BeamShape(width, depth), LogitsToProbs(SamplingConfig()), depth
    )
    best = 0
    for sequence in tree.sequences():  # root excluded
        n = 0
        while n < len(sequence) and sequence[n] == reference[n]:
            n += 1
        best = max(best, n)
    return best


@pytest.mark.parametrize("width", [1, 2, 4])
def test_batched_beam_search_matches_the_drafter(width: int) -> None:
    """Contexts of different lengths (left padding) in one batch give the drafter's match lengths
    at every depth; references are the LLM's greedy continuations, so matches are non-trivial."""
    llm = tiny_llama(layers=2, seed=0)
    ssm = copy.deepcopy(llm)
    with torch.no_grad():
        for p in ssm.parameters():
            p.add_(torch.randn_like(p) * 0.3 * p.std() if p.numel() > 1 else 0)
    gen = torch.Generator().manual_seed(0)
    contexts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 9, 5, 12)]
    references = []
    for context in contexts:
        out = llm.generate(torch.tensor([context]), max_new_tokens=max(DEPTHS), do_sample=False)
        references.append(out[0, len(context) :].tolist())
    got = beam_match_lengths(ssm, contexts, torch.tensor(references), width, DEPTHS, pad_id=0)
    expected = [
        [drafter_match(ssm, c, r, width, d) for d in DEPTHS]
        for c, r in zip(contexts, references, strict=True)
    ]
    assert got.tolist() == expected
    assert got.sum() > 0


def test_greedy_reference_stops_where_the_sample_leaves_the_greedy_path() -> None:
    sequence = torch.tensor([5, 6, 7, 8, 9, 10])
    choices = torch.tensor([6, 7, 8, 0, 10, 11])  # the LLM would say 0 after [5, 6, 7, 8], not 9
    assert greedy_reference(sequence, choices, root=0, length=3) == [6, 7, 8]
    assert greedy_reference(sequence, choices, root=1, length=3) == [7, 8, 0]  # r_3 is the LLM's own
    assert greedy_reference(sequence, choices, root=1, length=4) is None  # r_4 would follow 0: unknown
    assert greedy_reference(sequence, choices, root=4, length=3) is None  # past the end


@pytest.fixture
def setup(tmp_path: Path) -> tuple[str, list[str], str]:
    """A tiny LLM with greedy distillation data, and two SSMs (a noisy copy and a smaller model)."""
    llm_dir, vocab = tmp_path / "llm", 32
    save_llama(llm_dir, vocab)
    save_tokenizer(llm_dir, [f"w{i}" for i in range(vocab - 4)])
    llm = AutoModelForCausalLM.from_pretrained(llm_dir).eval()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(6):
        prompt = torch.randint(4, vocab, (3 + i,), generator=gen).tolist()
        out = llm.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None)
        rows.append((prompt, out[0, len(prompt) :].tolist()))
    ssm_dirs = []
    for k, layers in enumerate((2, 1)):
        folder = tmp_path / f"ssm-{k}"
        save_llama(folder, vocab, layers=layers)
        ssm_dirs.append(str(folder))
    return str(llm_dir), ssm_dirs, write_distilled(tmp_path / "distilled", rows)


def test_collect_writes_labels_with_the_documented_shape(setup, tmp_path: Path) -> None:
    llm, ssms, distilled = setup
    config = PredictorDataConfig(llm, tuple(ssms), distilled, depths=DEPTHS, stride=1, shard_size=2)
    metadata = collect(config, tmp_path / "labels")
    labels = load_labels(tmp_path / "labels")
    assert len(labels) == metadata["rows"] > 0
    row = labels[0]
    assert len(row["hidden"]) == 32  # the LLM's hidden size
    assert torch.tensor(row["match"]).shape == (2, 3, len(DEPTHS))
    match = torch.tensor(labels["match"])
    assert (match <= torch.tensor(DEPTHS)).all() and (match >= 0).all()
    chains = match[:, :, 0, :]  # width 1: deeper chains extend shallower ones (wider beams may drop them)
    assert (chains[..., 1:] >= chains[..., :-1]).all()
    # ssm-0 has the LLM's own weights (save_llama seeds identically): its greedy chain is the LLM's.
    assert (chains[:, 0] == torch.tensor(DEPTHS)).all()
    assert (match[:, 1] < match[:, 0]).any()  # the one-layer SSM does worse


def test_outputs_distillation_dropped_are_labelled_too(setup, tmp_path: Path) -> None:
    """The filters keep degenerate outputs out of the SSMs' training, but the decoder meets them:
    every distilled output is labelled, the dropped ones included (a row the filters dropped as
    repetition gets its rows of labels like the kept ones)."""
    llm, ssms, distilled = setup
    table = pq.read_table(Path(distilled) / "data.parquet").to_pylist()
    rows = [(row["prompt_ids"], row["output_ids"]) for row in table]
    filters = ["repetition" if i % 2 else "" for i in range(len(rows))]
    dropped = write_distilled(tmp_path / "with-dropped", rows, filters=filters)
    config = PredictorDataConfig(llm, (ssms[1],), dropped, depths=DEPTHS, stride=1, shard_size=2)
    collect(config, tmp_path / "labels")
    assert set(load_labels(tmp_path / "labels")["id"]) == set(range(len(rows)))


def test_sampled_labels_are_the_expected_acceptance_of_sampled_chains(setup, tmp_path: Path) -> None:
    """With a temperature, a width-1 label is sum_k prod_{j < k} (1 - TV(p, q)) at the chain's
    positions, teacher-forced along the sample (computed here position by position, one prefix per
    forward pass); an SSM equal to the LLM accepts every token (the label is the depth); wider
    beams keep their greedy labels."""
    llm_dir, ssms, distilled = setup
    temperature = 0.7
    sampled = PredictorDataConfig(llm_dir, tuple(ssms), distilled, depths=DEPTHS, temperature=temperature)
    metadata = collect(sampled, tmp_path / "sampled")
    collect(PredictorDataConfig(llm_dir, tuple(ssms), distilled, depths=DEPTHS), tmp_path / "greedy")
    labels, greedy = load_labels(tmp_path / "sampled"), load_labels(tmp_path / "greedy")
    assert metadata["rule"] == "sampled at temperature 0.7, top_k 50, top_p 1.0"  # as generate samples
    match, greedy_match = torch.tensor(labels["match"]), torch.tensor(greedy["match"])
    assert torch.equal(match[:, :, 1:], greedy_match[:, :, 1:].float())
    assert torch.allclose(match[:, 0, 0], torch.tensor(DEPTHS, dtype=torch.float32), atol=1e-5)
    check_sampled_labels(labels, llm_dir, ssms[1], distilled, temperature)
    assert (match[:, 1, 0] < match[:, 0, 0]).all()  # the one-layer SSM accepts less than the LLM's copy
    with pytest.raises(ValueError, match="temperature must be > 0"):
        PredictorDataConfig(llm_dir, tuple(ssms), distilled, temperature=0.0)
    with pytest.raises(ValueError, match="add width 1"):
        PredictorDataConfig(llm_dir, tuple(ssms), distilled, widths=(2,), temperature=0.8)


def test_sampled_labels_follow_the_llms_own_sampling_settings(setup, tmp_path: Path) -> None:
    """An LLM whose generation config samples with top_k=5 is labelled as its requests are sampled
    (`requested_sampling`): p and q cut to their 5 likeliest tokens before 1 - TV. Labelled at T alone
    (transformers' top_k=50 is no cut of a 32-token vocabulary), these labels differ; and a run
    folder labelled under one rule is not resumed under another."""
    llm_dir, ssms, distilled = setup
    GenerationConfig(do_sample=True, top_k=5).save_pretrained(llm_dir)
    config = PredictorDataConfig(llm_dir, tuple(ssms), distilled, depths=DEPTHS, temperature=0.7)
    assert collect(config, tmp_path / "top5")["rule"] == "sampled at temperature 0.7, top_k 5, top_p 1.0"
    labels = load_labels(tmp_path / "top5")
    check_sampled_labels(labels, llm_dir, ssms[1], distilled, 0.7, top_k=5)
    with pytest.raises(AssertionError):
        check_sampled_labels(labels, llm_dir, ssms[1], distilled, 0.7)
    GenerationConfig(do_sample=True, top_k=7).save_pretrained(llm_dir)  # the rule changed: no resume
    with pytest.raises(ValueError, match=r"other settings \(sampling: .*'top_k': 5.* -> .*'top_k': 7"):
        collect(config, tmp_path / "top5")


def check_sampled_labels(
    labels, llm_dir: str, ssm_dir: str, distilled: str, temperature: float, top_k: int = 50
) -> None:
    """Rows of `labels` (SSM 1's, width 1) equal sum_k prod_{j < k} (1 - TV(p, q)) computed one
    prefix per forward pass, p and q cut to their `top_k` likeliest tokens as `generate` samples
    (an LLM of no sampling settings of its own: transformers' top_k=50)."""

    def cut(logits: torch.Tensor) -> torch.Tensor:
        kept = logits.topk(min(top_k, logits.numel())).values[-1]
        return logits.masked_fill(logits < kept, float("-inf"))

    llm, ssm = AutoModelForCausalLM.from_pretrained(llm_dir), AutoModelForCausalLM.from_pretrained(ssm_dir)
    table = {r["id"]: r for r in pq.read_table(Path(distilled) / "data.parquet").to_pylist()}
    for row in list(labels)[:: max(1, len(labels) // 5)]:
        sequence, t = table[row["id"]]["prompt_ids"] + table[row["id"]]["output_ids"], row["position"]
        accept = []
        for j in range(t, t + max(DEPTHS)):
            with torch.no_grad():
                p = torch.softmax(cut(llm(torch.tensor([sequence[: j + 1]])).logits[0, -1]) / temperature, -1)
                q = torch.softmax(cut(ssm(torch.tensor([sequence[: j + 1]])).logits[0, -1]) / temperature, -1)
            accept.append(float(torch.minimum(p, q).sum()))
        expected = torch.tensor(accept).cumprod(0).cumsum(0)[[d - 1 for d in DEPTHS]]
        assert torch.allclose(torch.tensor(row["match"])[1, 0], expected, atol=1e-4)


def test_sampled_chains_alone_are_labelled_along_sampled_text(setup, tmp_path: Path) -> None:
    """Text sampled from the LLM leaves its greedy path within a few tokens, so greedy labels find
    no position of it usable; with a temperature and width 1 alone (on-policy labels for a pool
    that serves sampled requests) no label needs the greedy continuation, and every position with
    max(depths) tokens after it is labelled by the sampled rule."""
    llm_dir, ssms, _ = setup
    llm = AutoModelForCausalLM.from_pretrained(llm_dir).eval()
    torch.manual_seed(3)
    prompts = [[5 + i, 9, 7 + i] for i in range(4)]
    rows = []
    for prompt in prompts:
        out = llm.generate(
            torch.tensor([prompt]),
            max_new_tokens=20,
            do_sample=True,
            temperature=1.5,
            top_k=0,
            eos_token_id=None,
        )
        rows.append((prompt, out[0, len(prompt) :].tolist()))
    sampled_text = write_distilled(tmp_path / "sampled-text", rows)
    with pytest.raises(ValueError, match=r"no usable positions.*--temperature T --widths 1"):
        collect(PredictorDataConfig(llm_dir, tuple(ssms), sampled_text, depths=DEPTHS), tmp_path / "greedy")
    config = PredictorDataConfig(
        llm_dir, tuple(ssms), sampled_text, widths=(1,), depths=DEPTHS, temperature=0.8
    )
    metadata = collect(config, tmp_path / "on-policy")
    labels = load_labels(tmp_path / "on-policy")
    positions = [range(len(p) - 1, len(p) + len(o) - max(DEPTHS) + 1, config.stride) for p, o in rows]
    assert metadata["rows"] == sum(len(r) for r in positions) > 0
    assert metadata["skipped_positions_this_run"] == sum(
        len(range(len(p) - 1, len(p) + len(o) - 1, config.stride)) - len(r)
        for (p, o), r in zip(rows, positions, strict=True)
    )  # only the positions too close to the end for a chain of max(depths)
    assert torch.tensor(labels["match"]).shape[1:] == (2, 1, len(DEPTHS))
    check_sampled_labels(labels, llm_dir, ssms[1], sampled_text, 0.8)


def test_collect_resumes_after_a_kill_without_loss_or_duplicates(
    setup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm, ssms, distilled = setup
    config = PredictorDataConfig(llm, tuple(ssms), distilled, depths=DEPTHS, stride=1, shard_size=2)
    reference = collect(config, tmp_path / "full")
    real, calls = predictor_data.sample_rows, {"n": 0}

    def dies_on_the_fifth_sample(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt  # killed mid-shard: shards 1 and 2 are complete, shard 3 is not
        return real(*args, **kwargs)

    monkeypatch.setattr(predictor_data, "sample_rows", dies_on_the_fifth_sample)
    with pytest.raises(KeyboardInterrupt):
        collect(config, tmp_path / "resumed")
    monkeypatch.setattr(predictor_data, "sample_rows", real)
    resumed = collect(config, tmp_path / "resumed")
    a, b = load_labels(tmp_path / "full"), load_labels(tmp_path / "resumed")
    assert resumed["rows"] == reference["rows"]
    assert list(zip(a["id"], a["position"], strict=True)) == list(zip(b["id"], b["position"], strict=True))
    assert a["match"] == b["match"]


def test_collect_refuses_other_settings_and_empty_data(setup, tmp_path: Path) -> None:
    llm, ssms, distilled = setup
    collect(PredictorDataConfig(llm, (ssms[1],), distilled, depths=DEPTHS), tmp_path / "run")
    with pytest.raises(ValueError, match="other settings"):
        collect(PredictorDataConfig(llm, tuple(ssms), distilled, depths=DEPTHS), tmp_path / "run")
    with pytest.raises(ValueError, match="no usable positions"):  # outputs shorter than the deepest beam
        collect(PredictorDataConfig(llm, (ssms[1],), distilled, depths=(32,)), tmp_path / "deep")
    with pytest.raises(FileNotFoundError, match="make predictor-data"):
        load_labels(tmp_path / "missing")


def test_command_line_reports_bad_paths_without_a_traceback(tmp_path: Path, capsys) -> None:
    argv = ["--llm", str(tmp_path / "no-llm"), "--ssm", str(tmp_path / "no-ssm")]
    assert predictor_data.main([*argv, "--distilled", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "no model found" in capsys.readouterr().err
