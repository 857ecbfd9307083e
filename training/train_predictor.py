"""Train the match-length predictor on labels from `predictor_data` (ALGORITHMS.md section 5).

    python -m specboost.training.train_predictor --labels artifacts/predictor-data \\
        --out artifacts/pool/predictor

A 3-layer MLP (`specboost.speculator.predictor`) regresses every (SSM, b, d) match length from
the LLM's hidden state with the Huber loss. Samples, not positions, are split into train and
validation (scikit-learn `GroupShuffleSplit`: neighbouring positions of one sample are nearly the
same example, and must not sit on both sides). Training stops when the validation loss has not
improved for `patience` epochs and keeps the best epoch's weights.

Reported per configuration on the validation split: MAE and R^2 of the predictor, and the MAE of
the constant baseline (the training mean), the thing the predictor has to beat. OUT gets the
predictor (safetensors + JSON config, loadable with `MatchLengthPredictor.from_pretrained`) and
`predictor_record.json`; put OUT inside a boost run folder as `predictor/` so `make export`
ships it with the pool.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.metrics import mean_absolute_error, r2_score
from sklearn.model_selection import GroupShuffleSplit
from tqdm.auto import tqdm

from specboost.speculator.predictor import MatchLengthPredictor, PredictorConfig
from specboost.training.predictor_data import METADATA_FILE, load_labels
from specboost.training.run_files import library_versions, write_json_atomic

RECORD_FILE = "predictor_record.json"


@dataclass(frozen=True)
class TrainPredictorConfig:
    hidden_size: int = 256
    learning_rate: float = 1e-3
    weight_decay: float = 1e-4
    batch_size: int = 128
    max_epochs: int = 300
    patience: int = 20
    validation_fraction: float = 0.2
    huber_delta: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.validation_fraction < 1:
            raise ValueError(f"validation_fraction must be in (0, 1), got {self.validation_fraction}")
        if min(self.hidden_size, self.batch_size, self.max_epochs, self.patience) < 1:
            raise ValueError("hidden_size, batch_size, max_epochs and patience must be >= 1")


def split(groups: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Train / validation row indices, whole samples on one side."""
    if len(np.unique(groups)) < 2:
        raise ValueError("the labels come from a single sample: collect labels from at least 2 samples")
    splitter = GroupShuffleSplit(n_splits=1, test_size=fraction, random_state=seed)
    return next(splitter.split(groups, groups=groups))


def fit(
    model: MatchLengthPredictor,
    x: torch.Tensor,
    y: torch.Tensor,
    train: np.ndarray,
    valid: np.ndarray,
    config: TrainPredictorConfig,
) -> list[dict[str, float]]:
    """Adam on the Huber loss with early stopping; leaves the best epoch's weights in `model`."""
    torch.manual_seed(config.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay
    )
    loss_fn = torch.nn.HuberLoss(delta=config.huber_delta)
    xt, yt, xv, yv = x[train], y[train], x[valid], y[valid]
    best, best_state, history, stale = float("inf"), None, [], 0
    bar = tqdm(range(config.max_epochs), desc="predictor", unit="epoch")
    for epoch in bar:
        model.train()
        for batch in torch.randperm(len(xt)).split(config.batch_size):
            optimizer.zero_grad()
            loss_fn(model(xt[batch]), yt[batch]).backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            valid_loss = float(loss_fn(model(xv), yv))
        history.append({"epoch": epoch + 1, "valid_loss": valid_loss})
        bar.set_postfix(valid_loss=f"{valid_loss:.4f}", best=f"{min(best, valid_loss):.4f}")
        if valid_loss < best - 1e-6:
            best, best_state, stale = valid_loss, copy.deepcopy(model.state_dict()), 0
        else:
            stale += 1
            if stale >= config.patience:
                break
    bar.close()
    assert best_state is not None
    model.load_state_dict(best_state)
    return history


def evaluate(
    model: MatchLengthPredictor, x: torch.Tensor, y: torch.Tensor, train: np.ndarray, valid: np.ndarray
) -> dict[str, Any]:
    """Per configuration: predictor MAE and R^2 vs the constant (training mean) baseline's MAE."""
    predicted = model.predict(x[valid]).numpy()
    truth, baseline = y[valid].numpy(), y[train].mean(0).numpy()
    c = model.config
    per_config = []
    for s in range(c.num_ssms):
        for i, b in enumerate(c.widths):
            for j, d in enumerate(c.depths):
                t, p = truth[:, s, i, j], predicted[:, s, i, j]
                per_config.append(
                    {
                        "ssm": s,
                        "width": b,
                        "depth": d,
                        "mean": float(t.mean()),
                        "mae": float(mean_absolute_error(t, p)),
                        "baseline_mae": float(mean_absolute_error(t, np.full_like(t, baseline[s, i, j]))),
                        "r2": float(r2_score(t, p)) if t.std() > 0 else None,
                    }
                )
    mae = float(np.abs(predicted - truth).mean())
    baseline_mae = float(np.abs(baseline[None] - truth).mean())
    return {"mae": mae, "baseline_mae": baseline_mae, "per_config": per_config}


def train_predictor(labels: Path, out: Path, config: TrainPredictorConfig) -> dict[str, Any]:
    started = time.time()
    data = load_labels(labels).with_format("torch")[:]
    x, y = data["hidden"].float(), data["match"].float()  # [N, H], [N, S, W, D]
    metadata = json.loads((labels / METADATA_FILE).read_text())
    label_config = metadata["config"]
    train, valid = split(data["id"].numpy(), config.validation_fraction, config.seed)
    model = MatchLengthPredictor(
        PredictorConfig(
            input_size=x.shape[1],
            num_ssms=y.shape[1],
            widths=tuple(label_config["widths"]),
            depths=tuple(label_config["depths"]),
            hidden_size=config.hidden_size,
            llm=label_config["llm"],
            ssms=tuple(label_config["ssms"]),
        )
    )
    model.set_input_statistics(x[train])
    history = fit(model, x, y, train, valid, config)
    scores = evaluate(model, x, y, train, valid)
    model.save_pretrained(out)
    record = {
        "labels": str(labels),
        "rule": metadata.get("rule", "greedy"),  # what the labels measure (`predictor_data --temperature`)
        "config": asdict(config),
        "rows": {"train": len(train), "validation": len(valid)},
        "epochs": len(history),
        "best_valid_loss": min(h["valid_loss"] for h in history),
        **scores,
        "wall_time_s": round(time.time() - started, 1),
        "versions": library_versions(),
    }
    write_json_atomic(out / RECORD_FILE, record)
    print(
        f"[predictor] validation MAE {scores['mae']:.3f} vs constant baseline {scores['baseline_mae']:.3f} "
        f"({len(valid)} positions); saved to {out}"
    )
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--labels", required=True, type=Path, help="a predictor_data run folder")
    p.add_argument("--out", required=True, type=Path, help="predictor folder (e.g. BOOST_DIR/predictor)")
    defaults = TrainPredictorConfig()
    for name, value in asdict(defaults).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    a = vars(p.parse_args(argv))
    labels, out = a.pop("labels"), a.pop("out")
    try:
        train_predictor(labels, out, TrainPredictorConfig(**a))
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
