"""Hardware cost model: measured latencies of verification and speculation (ALGORITHMS.md
sections 5 and 8), stored per device and dtype.

`L_verify(n)` is one LLM tree pass over n tree tokens (root included) after a typical prefix;
`L_speculate(ssm, b, d)` is one SSM drafting a beam tree of width b and depth d (cache catch-up
included); `ssm_step_time(ssm)` is one SSM forward step, Sequoia's c numerator; `pool_step_seconds`
is one forward step of the whole pool stacked into one model (`speculator/stacked_pool.py`; None
when the SSMs draft one after another), so that a pool's drafting costs its slowest SSM's times
the stacked step's share (`pool_factor`) rather than the sum. All in seconds, measured by
`specboost profile` (`specboost.decoder.profiler`).

The chain tables cost the routed scheduler's actions (ALGORITHMS.md section 5.3) at several batch
sizes: `chain_verify_time(rows, n)` is one LLM pass over `rows` rows of an n-node chain (root
included), `chain_draft_time(ssm, rows, d)` one SSM's `BatchedChainDrafter` drafting a chain of d
tokens for `rows` rows (a catch-up pass of one token, then a pass per further token: affine in d,
and read as the line closest to the measured depths, `affine_in_depth`). Both are
piecewise-linear between the measured sizes and extended linearly past the largest. A profile
measured with `--compile` holds them on the compiled loop too, where their ratios differ (a
compiled one-token pass is cheaper next to a longer one than an eager one is). The sampled chain
tables hold the same drafting as sampled decoding drafts it (a draw from q at every position, the
chains read back as host trees): `chain_draft_table(..., sampled=True)`; a profile without them
prices sampled drafting as greedy drafting, and the online correction finds the difference.

A profile file (`hardware_profile.json`, in the pool folder) maps a device key such as
"cpu: AMD EPYC 7B13 (1 threads)|float32" to one `CostModel`. Latencies measured on one machine
mean little on another, so `load_cost_model` refuses a file without this machine's key unless
forced.
"""

from __future__ import annotations

import json
import logging
import platform
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

from specboost.speculator.atomic_files import write_text_atomic

logger = logging.getLogger(__name__)

PROFILE_FILE = "hardware_profile.json"
FORMAT_VERSION = 1
DRAFTING_TABLES = (  # `CostModel`'s [SSM][batch][depth] tables
    "chain_seconds",
    "compiled_chain_seconds",
    "sampled_chain_seconds",
    "compiled_sampled_chain_seconds",
)


def device_name(device: torch.device | str) -> str:
    """A human-readable name of the hardware behind `device` (threads matter on a CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{device.type}: {cpu} ({torch.get_num_threads()} threads)"


def device_key(device: torch.device | str, dtype: torch.dtype) -> str:
    return f"{device_name(device)}|{str(dtype).removeprefix('torch.')}"


@dataclass
class CostModel:
    device: str  # device_key of the machine it was measured on
    verify_tokens: list[int]  # tree sizes measured (root included), increasing
    verify_seconds: list[float]  # median LLM pass time per size
    speculate_seconds: list[dict[str, float]]  # per SSM: "b,d" -> median drafting time
    ssm_step_seconds: list[float]  # per SSM: one forward step
    prefix_length: int = 0  # cached tokens before the tree while measuring
    pool_step_seconds: float | None = None  # one step of the stacked pool (None: not stacked)
    llm: str | None = None
    ssms: list[str] = field(default_factory=list)
    # What the models' passes cost depends on (decoder/profiler.py `cost_key`): another pool of the
    # same architectures may reuse the profile (`specboost profile --like`). None, []: not recorded.
    llm_cost_key: str | None = None
    ssm_cost_keys: list[str] = field(default_factory=list)
    repeats: int | None = None  # timed rounds each median is of (None: not recorded)
    # Chain tables (section 5.3); empty in profiles measured before they existed.
    batch_sizes: list[int] = field(default_factory=list)  # rows measured, increasing
    chain_nodes: list[int] = field(default_factory=list)  # chain sizes verified (root included)
    chain_verify_seconds: list[list[float]] = field(default_factory=list)  # [batch][node size]
    chain_depths: list[int] = field(default_factory=list)  # chain lengths drafted
    chain_seconds: list[list[list[float]]] = field(default_factory=list)  # [SSM][batch][depth]
    # The same tables on the compiled loop (`specboost profile --compile`); empty: not measured.
    compiled_chain_verify_seconds: list[list[float]] = field(default_factory=list)
    compiled_chain_seconds: list[list[list[float]]] = field(default_factory=list)
    # Sampled chains drafted, [SSM][batch][depth], eager and compiled; empty: not measured.
    sampled_chain_seconds: list[list[list[float]]] = field(default_factory=list)
    compiled_sampled_chain_seconds: list[list[list[float]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.verify_tokens) != len(self.verify_seconds) or not self.verify_tokens:
            raise ValueError("a cost model needs verify times for at least one tree size")
        if len(self.speculate_seconds) != len(self.ssm_step_seconds):
            raise ValueError("speculate_seconds and ssm_step_seconds must have one entry per SSM")
        for name in DRAFTING_TABLES:
            table = getattr(self, name)
            if table and len(table) != len(self.ssm_step_seconds):
                raise ValueError(f"{name} must have one entry per SSM")

    @property
    def has_chain_costs(self) -> bool:
        """Whether the profile has the chain tables the routed scheduler needs (section 5.3)."""
        return bool(self.batch_sizes and self.chain_verify_seconds and self.chain_seconds)

    @property
    def num_ssms(self) -> int:
        return len(self.ssm_step_seconds)

    def verify_time(self, n_tokens: int | np.ndarray) -> float | np.ndarray:
        """L_verify(n): piecewise-linear in the measured sizes, extended linearly past the largest."""
        result = extrapolated(n_tokens, self.verify_tokens, self.verify_seconds)
        return float(result) if result.ndim == 0 else result

    @property
    def has_compiled_chain_costs(self) -> bool:
        return bool(self.compiled_chain_verify_seconds and self.compiled_chain_seconds)

    def chain_verify_time(self, rows: int, nodes: np.ndarray, compiled: bool = False) -> np.ndarray:
        """L_verify(rows, n) of chains of `nodes` sizes (root included) for `rows` rows (5.3), on
        the compiled loop when `compiled` and measured there."""
        table = self.compiled_chain_verify_seconds if compiled and self.has_compiled_chain_costs else None
        per_batch = np.stack(
            [
                extrapolated(nodes, self.chain_nodes, nondecreasing(y))
                for y in table or self.chain_verify_seconds
            ]
        )
        return np.stack(
            [extrapolated(rows, self.batch_sizes, per_batch[:, j]) for j in range(per_batch.shape[1])]
        )

    def chain_draft_table(self, max_rows: int, compiled: bool = False, sampled: bool = False) -> np.ndarray:
        """[SSM, max_rows + 1, chain_depths] seconds of SSM i drafting chains for 0..max_rows rows
        (0 rows: nothing drafted, 0 s), on the compiled loop when `compiled` and measured there,
        sampled chains when `sampled` and measured (else greedy ones)."""
        rows = np.arange(1, max_rows + 1)
        table = np.zeros((self.num_ssms, max_rows + 1, len(self.chain_depths)))
        compiled = compiled and self.has_compiled_chain_costs
        measured = [
            *([self.compiled_sampled_chain_seconds] if compiled and sampled else []),
            *([self.compiled_chain_seconds] if compiled else []),
            *([self.sampled_chain_seconds] if sampled else []),
            self.chain_seconds,
        ]
        for i, per_batch in enumerate(next(t for t in measured if t)):
            per_batch = np.stack([affine_in_depth(self.chain_depths, y) for y in per_batch])  # [batch, depth]
            for j in range(per_batch.shape[1]):
                table[i, 1:, j] = extrapolated(rows, self.batch_sizes, per_batch[:, j])
        return table

    def speculate_time(self, ssm: int, width: int, depth: int) -> float:
        key = f"{width},{depth}"
        table = self.speculate_seconds[ssm]
        if key not in table:
            raise KeyError(
                f"the cost model has no speculation time for SSM {ssm} with width {width} and depth "
                f"{depth} (measured: {', '.join(table)}); profile again with that configuration"
            )
        return table[key]

    def ssm_step_time(self, ssm: int) -> float:
        return self.ssm_step_seconds[ssm]

    @property
    def pool_factor(self) -> float | None:
        """A stacked pool's step over its slowest SSM's step (None when the pool is not stacked): what
        drafting every SSM at once costs relative to the slowest of them alone."""
        if self.pool_step_seconds is None:
            return None
        return self.pool_step_seconds / max(self.ssm_step_seconds)


def nondecreasing(seconds: list[float] | np.ndarray) -> np.ndarray:
    """A cost measured over increasing sizes, each size taking at most any larger size's time: a
    pass over more nodes (a longer chain) does not cost less, and where a profile says it does,
    the smaller size's number is noise or a shape that runs slower alone than in the decoding loop
    (a one-token compiled verify pass of the tiny fixture's LLM: 2.0 ms profiled, 1.4 ms in the
    loop, under its two-token pass's 1.4 ms)."""
    return np.minimum.accumulate(np.asarray(seconds, float)[::-1])[::-1]


def affine_in_depth(depths: list[int], seconds: list[float] | np.ndarray) -> np.ndarray:
    """A drafting table over chain depths, as the line a + b d (a, b >= 0) closest to it in relative
    error (ALGORITHMS.md 5.3, "Costs"): a chain of d tokens is a catch-up pass and d - 1 one-token
    passes, so its time is affine in d, and each measured depth is a noisy sample of that line.
    Taken one by one, a profile's depths had misled the router: on the tiny fixture's sampled
    profile a chain of 8 measured 1.35x a chain of 4 where the loop takes 1.70x (6.44 against 4.77
    ms; 10.2 against 6.0 in the loop); three fresh profiles measured 1.43x, 1.65x and 1.72x, and
    their fits 1.70x, 1.73x and 1.71x. Fewer than three depths: made `nondecreasing` only."""
    d, y = np.asarray(depths, float), np.asarray(seconds, float)
    if len(d) < 3 or not (y > 0).all():
        return nondecreasing(y)
    rows = np.stack([1 / y, d / y], 1)  # (a + b d) / y - 1: the relative error at each depth
    candidates = [np.linalg.lstsq(rows, np.ones_like(y), rcond=None)[0]]
    for column in (0, 1):  # the best line with the other coefficient at 0 (its bound)
        x = rows[:, column]
        candidates.append(np.eye(2)[column] * max(x.sum() / (x @ x), 0.0))
    feasible = [c for c in candidates if (c >= 0).all()]
    a, b = min(feasible, key=lambda c: float(np.sum((rows @ c - 1) ** 2)))
    return a + b * d


def extrapolated(x: float | np.ndarray, xs: list[int], ys: list[float] | np.ndarray) -> np.ndarray:
    """ys(x), piecewise-linear between the measured points xs, the last segment's slope continued
    past the largest (a cost keeps growing with size)."""
    xs, ys, x = np.asarray(xs, float), np.asarray(ys, float), np.asarray(x, float)
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
    return np.where(x > xs[-1], ys[-1] + slope * (x - xs[-1]), np.interp(x, xs, ys))


def save_cost_model(model: CostModel, path: str | Path) -> None:
    """Add (or replace) this device's entry in the profile file at `path`, atomically."""
    path = Path(path)
    profiles = _read(path)["profiles"] if path.is_file() else {}
    profiles[model.device] = asdict(model)
    write_text_atomic(
        path, json.dumps({"format_version": FORMAT_VERSION, "profiles": profiles}, indent=2) + "\n"
    )


def _read(path: Path) -> dict:
    data = json.loads(path.read_text())
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} has format_version {data.get('format_version')!r}; this specboost reads "
            f"{FORMAT_VERSION}: profile again with `specboost profile`"
        )
    return data


def _from_entry(entry: dict, path: Path) -> CostModel:
    """A profile entry as a `CostModel`; fields this specboost does not know (a newer one measured
    more) are left out with a warning rather than refused: what it knows is still this machine's."""
    known = {f.name for f in fields(CostModel)}
    unknown = sorted(set(entry) - known)
    if unknown:
        logger.warning(
            "%s: ignoring profile fields this specboost does not know: %s", path, ", ".join(unknown)
        )
    return CostModel(**{k: v for k, v in entry.items() if k in known})


def load_cost_model(path: str | Path, key: str, force: bool = False) -> CostModel:
    """This device's cost model from the profile file; a profile of another device only when forced
    (then the file's first entry)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no hardware profile at {path}: measure one with `specboost profile`")
    profiles = _read(path)["profiles"]
    if key in profiles:
        return _from_entry(profiles[key], path)
    if force and profiles:
        return _from_entry(next(iter(profiles.values())), path)
    raise ValueError(
        f"{path} holds latencies measured on {', '.join(profiles) or 'no device'}, not on this machine "
        f"({key}); run with the thread count it was measured at (torch.set_num_threads, --threads) if "
        "that is the difference, run `specboost profile` here, or force the foreign profile "
        "(force_profile=True, --force-profile) if you know the hardware is equivalent"
    )
