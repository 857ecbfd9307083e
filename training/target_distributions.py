"""The LLM's next-token distributions at its own output positions, stored with the distillation
data (ALGORITHMS.md section 15, "Distribution distillation").

For every generated output position a distill run with `--top-k-probs K` records p, the LLM's
*processed* distribution: the softmax of the scores after the logits processors and warpers that
sampling at the recorded settings applies (temperature, top-p, the LLM's own generation config and
transformers' defaults such as top-k, repetition penalties...), built by the LLM's own
`_get_logits_processor` through `decoder/generation_options.resolve`, exactly as `generate` and the
speculative decoder build them (ALGORITHMS.md section 2, "Logits processing"). A sampled run records
the distribution its tokens were sampled from; a greedy run decodes greedily and records the
distribution sampling at `--temperature` / `--top-p` would use.

How: after a batch is generated (by `model.generate` or the speculative decoder, whichever
wrote it), ONE teacher-forced forward of the LLM over the left-padded prompt + output, with the
position ids `generate` gives left-padded rows, yields the logits of every output position; each
output step t is processed with the history `generate` held at that step (the padded prompt and
the first t output tokens), so processors that read the text (repetition penalties, n-gram
blocking, minimum lengths) see what they saw while generating.

Stored per output position (three Parquet columns, one entry per output token):
- `top_k_ids`  list<list<int32>>   [n_out][K]: the K most probable token ids, most probable first;
- `top_k_probs` list<list<float16>> [n_out][K]: their probabilities (zeros past a top-p / top-k cut);
- `tail_prob`  list<float32>       [n_out]: the rest of the mass, 1 - the sum of the top-K
  probabilities in float32, clamped at 0 (exactly 0 when K is the whole vocabulary). The float16
  rounding of the stored probabilities (relative 2^-11) leaves their sum + tail within about 1e-3
  of one; the losses take both as stored (training/distribution_loss.py).
That is `raw_bytes_per_token(K)` = 6 K + 4 bytes of values per token (388 for K = 64) before
Parquet's compression; the run's metadata reports the measured on-disk size per token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import PreTrainedModel

from specboost.decoder.generation_options import resolve
from specboost.speculator.model_info import output_vocab_size
from specboost.speculator.padding import left_pad
from specboost.speculator.sampling import LogitsToProbs

TOP_K_IDS, TOP_K_PROBS, TAIL = "top_k_ids", "top_k_probs", "tail_prob"
COLUMNS = (TOP_K_IDS, TOP_K_PROBS, TAIL)
ID_TYPE, PROB_TYPE, TAIL_TYPE = pa.int32(), pa.float16(), pa.float32()
COLUMN_TYPES = {TOP_K_IDS: "list<list<int32>>", TOP_K_PROBS: "list<list<float16>>", TAIL: "list<float32>"}
LOGITS_BUDGET = 256 * 2**20  # bytes of float32 logits one teacher-forced forward may hold


def raw_bytes_per_token(top_k: int) -> int:
    """Bytes of stored values per output token: K int32 ids, K float16 probabilities, one float32."""
    return top_k * (4 + 2) + 4


def clamp_top_k(top_k: int, llm: PreTrainedModel) -> int:
    """K, at most the LLM's vocabulary (then every token's probability is stored, the tail is 0)."""
    return min(top_k, output_vocab_size(llm))


@dataclass
class PositionTargets:
    """One row's stored distributions: ids [n, K] int32, probs [n, K] float16, tail [n] float32."""

    ids: np.ndarray
    probs: np.ndarray
    tail: np.ndarray


# ---------------------------------------------------------------- recording (distill)


def target_processing(
    llm: PreTrainedModel,
    prompt_ids: torch.Tensor,  # [B, T] the left-padded prompts of the batch
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    pad_id: int,
    eos: set[int],
) -> LogitsToProbs:
    """The processors `generate(do_sample=True, temperature, top_p, ...)` applies for this batch."""
    options = {
        "do_sample": True,
        "temperature": temperature,
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
        "pad_token_id": pad_id,
        "eos_token_id": sorted(eos) or None,
    }
    return resolve(llm, None, options, prompt_ids.to(llm.device)).probs


def processor_names(processing: LogitsToProbs) -> list[str]:
    return [type(p).__name__ for p in processing.processors]


@dataclass(frozen=True)
class TopKRecorder:
    """Records the top-K of p (the LLM's distribution after `processing`) at every output position
    of (prompt, output) pairs generated as one left-padded batch."""

    llm: PreTrainedModel
    processing: LogitsToProbs
    top_k: int
    pad_id: int

    @torch.no_grad()
    def __call__(self, prompts: list[list[int]], outputs: list[list[int]]) -> list[PositionTargets]:
        """One teacher-forced forward per chunk of rows (chunks keep the logits under LOGITS_BUDGET)."""
        found: list[PositionTargets] = []
        width = max(len(p) for p in prompts) + max(len(o) for o in outputs)
        rows_per_forward = max(1, LOGITS_BUDGET // (width * output_vocab_size(self.llm) * 4))
        for start in range(0, len(prompts), rows_per_forward):
            chunk = slice(start, start + rows_per_forward)
            found += self.record_chunk(prompts[chunk], outputs[chunk])
        return found

    def record_chunk(self, prompts: list[list[int]], outputs: list[list[int]]) -> list[PositionTargets]:
        llm, top_k, pad_id = self.llm, self.top_k, self.pad_id
        prompt_ids, prompt_mask = left_pad(prompts, pad_id)  # [B, P], as the batch was generated
        lengths = [len(o) for o in outputs]
        steps = max(lengths)
        if steps == 0:
            empty = PositionTargets(
                np.zeros((0, top_k), np.int32), np.zeros((0, top_k), np.float16), np.zeros(0, np.float32)
            )
            return [empty for _ in outputs]
        generated = torch.full((len(outputs), steps), pad_id, dtype=torch.long)  # [B, n]
        generated_mask = torch.zeros_like(generated)
        for row, output in enumerate(outputs):
            generated[row, : len(output)] = torch.tensor(output, dtype=torch.long)
            generated_mask[row, : len(output)] = 1
        ids = torch.cat([prompt_ids, generated], dim=1).to(llm.device)  # [B, P + n]
        mask = torch.cat([prompt_mask, generated_mask], dim=1).to(llm.device)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as `generate` numbers left-padded rows
        width = prompt_ids.shape[1]
        # Position width - 1 + t predicts output token t; the last output token is never an input.
        logits = llm(
            input_ids=ids[:, : width + steps - 1],
            attention_mask=mask[:, : width + steps - 1],
            position_ids=positions[:, : width + steps - 1],
        ).logits[:, width - 1 :]  # [B, n, V]
        top_ids = torch.zeros((len(outputs), steps, top_k), dtype=torch.int32)
        top_probs = torch.zeros((len(outputs), steps, top_k), dtype=torch.float16)
        tail = torch.zeros((len(outputs), steps), dtype=torch.float32)
        whole = top_k >= logits.shape[-1]
        processed = self.processing.along(logits, ids, width)  # [B, n, V], each step its own history
        for t in range(steps):
            values, indices = processed[:, t].topk(top_k, dim=-1)
            top_ids[:, t], top_probs[:, t] = indices.int().cpu(), values.half().cpu()
            if not whole:
                tail[:, t] = (1.0 - values.sum(-1)).clamp(min=0.0).cpu()
        return [
            PositionTargets(top_ids[row, :n].numpy(), top_probs[row, :n].numpy(), tail[row, :n].numpy())
            for row, n in enumerate(lengths)
        ]


def distribution_columns(targets: list[PositionTargets]) -> dict[str, pa.Array]:
    """The three Parquet columns of a shard's rows, built from numpy without Python lists."""
    lengths = np.array([t.tail.shape[0] for t in targets], dtype=np.int32)
    row_offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    top_k = targets[0].ids.shape[1] if targets else 0
    positions = int(lengths.sum())
    position_offsets = pa.array((np.arange(positions + 1) * top_k).astype(np.int32))

    def nested(values: np.ndarray, kind: pa.DataType) -> pa.Array:
        inner = pa.ListArray.from_arrays(position_offsets, pa.array(values.reshape(-1), type=kind))
        return pa.ListArray.from_arrays(row_offsets, inner)

    ids = np.concatenate([t.ids for t in targets]) if positions else np.zeros((0, top_k), np.int32)
    probs = np.concatenate([t.probs for t in targets]) if positions else np.zeros((0, top_k), np.float16)
    tail = np.concatenate([t.tail for t in targets]) if positions else np.zeros(0, np.float32)
    return {
        TOP_K_IDS: nested(ids, ID_TYPE),
        TOP_K_PROBS: nested(probs, PROB_TYPE),
        TAIL: pa.ListArray.from_arrays(row_offsets, pa.array(tail, type=TAIL_TYPE)),
    }


def stored_bytes_per_token(path: Path, tokens: int) -> float | None:
    """On-disk (compressed) bytes of the three columns in the Parquet file, per output token."""
    if tokens == 0:
        return None
    metadata = pq.ParquetFile(path).metadata
    total = 0
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        for column in range(row_group.num_columns):
            chunk = row_group.column(column)
            if chunk.path_in_schema.split(".")[0] in COLUMNS:
                total += chunk.total_compressed_size
    return total / tokens


# ---------------------------------------------------------------- reading (boost)


def distribution_info(distilled: str | Path) -> dict[str, Any] | None:
    """The "distributions" entry of a distill run's metadata.json (top_k, temperature, ...), or
    None when the run recorded none (or predates them)."""
    path = Path(distilled) / "metadata.json"
    if not path.is_file():
        return None
    info = json.loads(path.read_text()).get("distributions")
    schema = pq.read_schema(Path(distilled) / "data.parquet") if info else None
    if schema is None or not set(COLUMNS) <= set(schema.names):
        return None
    return info


def load_targets(distilled: str | Path, ids: set[int]) -> dict[int, PositionTargets]:
    """id -> the stored distributions of that row, for the rows in `ids`, read column-wise."""
    table = pq.read_table(Path(distilled) / "data.parquet", columns=["id", *COLUMNS])
    row_ids = table.column("id").to_pylist()
    columns = {name: table.column(name).combine_chunks() for name in COLUMNS}
    lengths = columns[TAIL].value_lengths().to_numpy(zero_copy_only=False)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    tail = columns[TAIL].flatten().to_numpy(zero_copy_only=False)
    id_rows = columns[TOP_K_IDS].flatten()
    top_k = int(id_rows.value_lengths()[0].as_py()) if len(id_rows) else 1  # no positions: any K
    flat_ids = id_rows.flatten().to_numpy(zero_copy_only=False).reshape(-1, top_k)
    flat_probs = columns[TOP_K_PROBS].flatten().flatten().to_numpy(zero_copy_only=False).reshape(-1, top_k)
    return {
        row_id: PositionTargets(flat_ids[a:b], flat_probs[a:b], tail[a:b])
        for row_id, a, b in zip(row_ids, starts[:-1], starts[1:], strict=True)
        if row_id in ids
    }
