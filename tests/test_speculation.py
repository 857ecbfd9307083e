"""The strategy interface: what the decoder hands a speculator each step."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from specboost.decoder import ChainShape, SpeculativeDecoder
from specboost.speculator.speculation import DraftRequest, PoolSpeculator, StepFeedback


class RecordingSpeculator(PoolSpeculator):
    """A pool speculator that asks for the LLM's hidden state and records every exchange."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.wants_hidden = True
        self.requests: list[tuple[list[int], torch.Tensor | None]] = []
        self.feedback: list[StepFeedback] = []

    def propose(self, request: DraftRequest):
        self.requests.append((list(request.verified), request.hidden))
        return super().propose(request)

    def observe(self, feedback: StepFeedback) -> None:
        self.feedback.append(feedback)


@pytest.mark.parametrize("verification", ["tree", "stairs"])
@pytest.mark.parametrize("prompt_length", [1, 5])
def test_hidden_state_is_the_llms_state_before_the_root(verification: str, prompt_length: int) -> None:
    """`DraftRequest.hidden` is the LLM's last-layer state at verified[-2], as a plain forward
    pass computes it, at every step (after prefill, accepted drafts and rejections alike)."""
    llm, ssm = tiny_llama(layers=2, seed=0), tiny_llama(layers=1, seed=3)
    speculator = RecordingSpeculator([ssm], ChainShape(3))
    decoder = SpeculativeDecoder(llm, [ssm], speculator=speculator, verification=verification)
    prompt = torch.arange(1, prompt_length + 1)[None]
    out = decoder.generate(prompt, max_new_tokens=12)

    assert len(speculator.requests) == out.stats.llm_steps == len(speculator.feedback)
    for verified, hidden in speculator.requests:
        if len(verified) == 1:
            assert hidden is None
            continue
        with torch.no_grad():
            states = llm(torch.tensor([verified[:-1]]), output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(hidden, states[-1])
    assert all(f.verify_seconds > 0 for f in speculator.feedback)
    assert [len(f.accepted) for f in speculator.feedback] == out.stats.match_lengths
    assert out.stats.strategy["strategy"] == "pool"
