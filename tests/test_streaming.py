"""Streaming with transformers streamers (`TokenStream`, decoder/sequence.py): `generate` and the
serving engine put the prompt first, then each verification step's kept tokens, then call `end()`
exactly once, whether the sequence finishes, fails or is cancelled; `TextIteratorStreamer`'s text
is the decoded output, greedy and sampled."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError

import pytest
import torch
from conftest import CHARS, tiny_llama
from test_batched import prompts
from test_engine import LENGTHS, TIMEOUT, Boom, break_engine_loop, decoder, fresh_decoder
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast, TextIteratorStreamer
from transformers.generation.streamers import BaseStreamer

from specboost.decoder import SpeculativeDecoder
from specboost.decoder.engine import Engine, EngineConfig, RequestHandle
from specboost.speculator.beam_search import left_pad

MAX_NEW = 24


class Recorder(BaseStreamer):
    """Records every `put` and `end`, from any thread, and whether something was put after `end`."""

    def __init__(self) -> None:
        self.puts: list[torch.Tensor] = []
        self.ends = 0
        self.put_after_end = False
        self.ended = threading.Event()

    def put(self, value: torch.Tensor) -> None:
        self.put_after_end |= self.ends > 0
        self.puts.append(value)

    def end(self) -> None:
        self.ends += 1
        self.ended.set()

    @property
    def prompt(self) -> list[int]:
        return self.puts[0].tolist()[0]

    @property
    def steps(self) -> list[list[int]]:
        return [value.tolist()[0] for value in self.puts[1:]]

    def check(self, prompt: list[int], new_tokens: list[int]) -> None:
        """The prompt [1, L] first, then [1, n] steps making up `new_tokens`, then one end."""
        assert all(v.dtype == torch.long and v.device.type == "cpu" and v.dim() == 2 for v in self.puts)
        assert self.prompt == prompt
        assert all(self.steps) and [t for step in self.steps for t in step] == new_tokens
        assert self.ends == 1 and not self.put_after_end


def spaced_tokenizer() -> PreTrainedTokenizerFast:
    """Half the ids are words that start with a space (like GPT-2's "Ġ" tokens), so that a
    `TextStreamer` releases text in pieces as words complete rather than all of it at the end."""
    vocab = {c: i for i, c in enumerate(CHARS[:32])} | {" " + c: 32 + i for i, c in enumerate(CHARS[:32])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="a"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="a", clean_up_tokenization_spaces=False)


def streamed_text(streamer: TextIteratorStreamer) -> list[str]:
    return [piece for piece in streamer if piece]


# generate ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sampling", [{}, dict(do_sample=True, temperature=0.9, seed=3)], ids=["greedy", "sampled"]
)
def test_text_iterator_streamer_gives_the_decoded_output(sampling: dict) -> None:
    tokenizer = spaced_tokenizer()
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=TIMEOUT)
    prompt = prompts(3, (5,))[0]
    out = decoder().generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, streamer=streamer, **sampling)
    pieces = streamed_text(streamer)  # an unbounded queue: generate has already filled it
    assert "".join(pieces) == tokenizer.decode(out.sequences[0, len(prompt) :])
    assert len(pieces) > 1  # released as words complete, not only at the end


@pytest.mark.parametrize(
    "sampling", [{}, dict(do_sample=True, temperature=0.9, seed=5)], ids=["greedy", "sampled"]
)
def test_each_step_puts_the_tokens_it_kept(sampling: dict) -> None:
    """One put per verification step, several tokens at once when drafts are accepted; an EOS in
    the middle of a step's accepted drafts cuts that step's put where the output ends."""
    dec, prompt = decoder(), prompts(4, (6,))[0]
    full = dec.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, eos_token_id=None, **sampling)
    recorder = Recorder()
    out = dec.generate(
        torch.tensor([prompt]), max_new_tokens=MAX_NEW, streamer=recorder, eos_token_id=None, **sampling
    )
    recorder.check(prompt, out.sequences[0, len(prompt) :].tolist())
    assert len(recorder.steps) == out.stats.llm_steps and max(map(len, recorder.steps)) > 1
    # An EOS that is an accepted draft in the middle of a step: that step's put stops at it.
    tokens = full.sequences[0, len(prompt) :].tolist()
    step, eos = mid_step_token(recorder.steps, tokens)
    cut = Recorder()
    out = dec.generate(
        torch.tensor([prompt]), max_new_tokens=MAX_NEW, streamer=cut, eos_token_id=eos, **sampling
    )
    assert out.finish_reason == "eos"
    assert out.sequences[0].tolist() == prompt + tokens[: tokens.index(eos) + 1]
    cut.check(prompt, out.sequences[0, len(prompt) :].tolist())
    assert len(cut.steps) == step + 1 and cut.steps[-1] == recorder.steps[step][: len(cut.steps[-1])]
    assert len(cut.steps[-1]) < len(recorder.steps[step])


def mid_step_token(steps: list[list[int]], tokens: list[int]) -> tuple[int, int]:
    """(step, token): a token that first occurs in `tokens` inside `steps[step]`, not as its last."""
    start = 0
    for i, step in enumerate(steps):
        for j, token in enumerate(step[:-1]):
            if tokens.index(token) == start + j:
                return i, token
        start += len(step)
    raise AssertionError("no step accepted a fresh token before its last")


def test_padding_is_not_streamed() -> None:
    prompt = prompts(5, (4,))[0]
    ids, mask = left_pad([prompt, [1] * 7], pad_id=0)
    recorder = Recorder()
    out = decoder().generate(ids[:1], attention_mask=mask[:1], max_new_tokens=5, streamer=recorder)
    recorder.check(prompt, out.sequences[0, len(prompt) :].tolist())


def test_a_batch_with_a_streamer_is_refused() -> None:
    ids, mask = left_pad(prompts(6, (3, 5)), pad_id=0)
    recorder = Recorder()
    with pytest.raises(ValueError, match="streamers support batch size 1"):
        decoder().generate(ids, attention_mask=mask, max_new_tokens=4, streamer=recorder)
    assert not recorder.puts and not recorder.ends


def test_generate_ends_the_stream_when_it_fails() -> None:
    llm = tiny_llama(layers=1, seed=0)
    calls = {"n": 0}

    def hook(*_: object) -> None:
        calls["n"] += 1
        if calls["n"] > 3:
            raise Boom("llm failed")

    llm.register_forward_pre_hook(hook)
    recorder = Recorder()
    with pytest.raises(Boom):
        SpeculativeDecoder(llm, [], strategy="plain").generate(
            torch.tensor([[1, 2, 3]]), max_new_tokens=20, streamer=recorder
        )
    assert recorder.prompt == [1, 2, 3] and recorder.steps  # the steps before the error
    assert recorder.ends == 1


# The engine -------------------------------------------------------------------------------------
@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "sequential"])
def test_engine_streams_every_request(pipeline: bool) -> None:
    """Several requests in flight, each with its own streamer, called from the workers: every
    stream is its request's output, and its result is ready when `end()` comes."""
    rows = prompts(8, LENGTHS[:5])
    tokenizer = spaced_tokenizer()
    recorders = [Recorder() for _ in rows]
    texts = [TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=TIMEOUT) for _ in rows]
    config = EngineConfig(batch_size=2, num_groups=2, pipeline=pipeline)
    with Engine(decoder(), config) as engine:
        handles = [
            engine.submit(row, max_new_tokens=MAX_NEW, streamer=r)
            for row, r in zip(rows, recorders, strict=True)
        ]
        text_handles = [
            engine.submit(row, max_new_tokens=MAX_NEW, streamer=t) for row, t in zip(rows, texts, strict=True)
        ]
        for recorder, handle in zip(recorders, handles, strict=True):
            assert recorder.ended.wait(TIMEOUT)
            handle.result(0)  # resolved before its stream ended
        for text, handle in zip(texts, text_handles, strict=True):
            pieces = streamed_text(text)  # waits for end(), from the worker
            assert "".join(pieces) == tokenizer.decode(handle.result(0).new_tokens)
    for row, recorder, handle in zip(rows, recorders, handles, strict=True):
        recorder.check(row, handle.result(0).new_tokens)
        assert len(recorder.steps) == handle.result(0).stats.llm_steps


def slow(dec: SpeculativeDecoder, seconds: float = 0.005) -> object:
    return dec.llm.register_forward_hook(lambda *_: time.sleep(seconds))


def wait_for(condition: object) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_engine_ends_the_stream_of_a_cancelled_request() -> None:
    """Running or queued: `cancel()` ends the stream at once (from the cancelling thread), and
    the worker puts nothing after it."""
    dec = fresh_decoder()
    hook = slow(dec)
    running, queued = Recorder(), Recorder()
    try:
        with Engine(dec, EngineConfig(batch_size=1, num_groups=1)) as engine:
            a = engine.submit([1, 2, 3], max_new_tokens=200, streamer=running)
            b = engine.submit([4, 5], max_new_tokens=200, streamer=queued)
            wait_for(lambda: len(running.steps) >= 2)
            assert b.cancel() and queued.ends == 1 and queued.prompt == [4, 5] and not queued.steps
            assert a.cancel() and running.ends == 1
            streamed = len(running.puts)
    finally:
        hook.remove()
    assert running.ends == 1 and not running.put_after_end and len(running.puts) == streamed
    assert sum(map(len, running.steps)) < 200
    for handle in (a, b):
        with pytest.raises(CancelledError):
            handle.result(0)


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "sequential"])
def test_engine_ends_the_stream_of_a_failed_request(pipeline: bool) -> None:
    dec = fresh_decoder()

    def fail(*_: object) -> None:
        raise Boom("llm failed")

    hook = dec.llm.register_forward_pre_hook(fail)
    recorders = [Recorder() for _ in range(3)]
    try:
        with Engine(dec, EngineConfig(batch_size=2, num_groups=2, pipeline=pipeline)) as engine:
            handles = [
                engine.submit([1, 2 + i], max_new_tokens=8, streamer=r) for i, r in enumerate(recorders)
            ]
            for recorder, handle in zip(recorders, handles, strict=True):
                with pytest.raises(Boom):
                    handle.result(TIMEOUT)
                assert recorder.ended.wait(TIMEOUT)
    finally:
        hook.remove()
    for i, recorder in enumerate(recorders):
        recorder.check([1, 2 + i], [])


def test_a_refused_request_ends_its_stream() -> None:
    """`submit` puts the prompt before it queues the request; a refusal (`QueueFull`, a closed
    engine) ends the stream before raising. Bad settings raise before the streamer sees anything."""
    engine = Engine(decoder(), EngineConfig(batch_size=1, num_groups=1))
    bad = Recorder()
    with pytest.raises(ValueError, match="temperature"):
        engine.submit([1, 2], max_new_tokens=4, do_sample=True, temperature=0.0, streamer=bad)
    engine.close(timeout=TIMEOUT)
    refused = Recorder()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit([1, 2], max_new_tokens=4, streamer=refused)
    assert not bad.puts and not bad.ends
    refused.check([1, 2], [])


def test_engine_error_and_close_end_every_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error of the engine itself, and `close(cancel=True)`, end every open stream once."""
    release = break_engine_loop(monkeypatch)
    recorders = [Recorder() for _ in range(4)]
    engine = Engine(decoder(), EngineConfig(batch_size=1, num_groups=2))
    for row, recorder in zip(prompts(9, LENGTHS[:4]), recorders, strict=True):
        engine.submit(row, max_new_tokens=8, streamer=recorder)
    release.set()
    assert all(recorder.ended.wait(TIMEOUT) for recorder in recorders)
    engine.close(timeout=TIMEOUT)
    assert all(recorder.ends == 1 for recorder in recorders)

    monkeypatch.undo()  # a working engine again
    recorders = [Recorder() for _ in range(4)]
    engine = Engine(decoder(), EngineConfig(batch_size=1, num_groups=1))
    handles: list[RequestHandle] = [
        engine.submit(row, max_new_tokens=60, streamer=r)
        for row, r in zip(prompts(9, LENGTHS[:4]), recorders, strict=True)
    ]
    engine.close(cancel=True, timeout=TIMEOUT)
    assert all(handle.done() for handle in handles)
    assert all(recorder.ends == 1 and not recorder.put_after_end for recorder in recorders)
