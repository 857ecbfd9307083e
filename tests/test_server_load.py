"""The server under a small load, on loopback: concurrent streamed and whole requests, some of
whose clients leave mid-way and some of which run past the server's request timeout, mixed with
a few hundred requests to random paths. Every answer that completes equals `llm.generate`'s
greedy text; a cut one is a prefix of it; no engine row is left generating for a client that has
gone; every generated token is accounted for; /metrics stays bounded."""

from __future__ import annotations

import json
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
import torch
from conftest import char_tokenizer, noisy_copy, tiny_llama

from specboost.decoder import SpeculativeDecoder
from specboost.decoder.engine import EngineConfig
from specboost.decoder.serve.app import create_app
from specboost.decoder.serve.background import serve_in_background
from specboost.decoder.serve.config import ServerConfig

MODEL, KEY = "tiny", "sk-load"
AUTH = {"authorization": f"Bearer {KEY}"}
PROMPTS = ["abc", "Hello", "x1y2", "The.cat", "zz", "Once.upon"]
# The server's request timeout: the long requests may run past it, the short ones must not. At
# 3 s, a fresh-clone run of the whole suite on a slow machine (44 min, against 32 the day before)
# cut 4 of the 12 short requests at the limit.
TIMEOUT_S = 10.0
CLIENT_S = 60.0  # no client waits longer than this for anything
RANDOM_PATHS = 300


@dataclass
class Outcome:
    prompt: str
    max_tokens: int
    text: str  # what the client received
    finish: str | None  # None: the client left, or the answer was an error
    status: int = 200


@pytest.fixture(scope="module")
def parts():
    llm = tiny_llama(seed=1, positions=1024)
    return llm, noisy_copy(llm, 0.3, seed=2), char_tokenizer()


def _greedy(parts, prompt: str, n: int) -> str:
    llm, _, tokenizer = parts
    ids = tokenizer(prompt).input_ids
    out = llm.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=None)
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def _body(prompt: str, max_tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def _streamed(url: str, prompt: str, max_tokens: int, leave_after: int | None = None) -> Outcome:
    """A streamed request; with `leave_after`, the client reads that many events, then leaves."""
    text, finish = "", None
    with (
        httpx.Client(timeout=CLIENT_S) as http,
        http.stream("POST", f"{url}/v1/completions", json=_body(prompt, max_tokens, True), headers=AUTH) as r,
    ):
        for events, line in enumerate(r.iter_lines()):
            if leave_after is not None and events >= leave_after:
                return Outcome(prompt, max_tokens, text, None)
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
    return Outcome(prompt, max_tokens, text, finish)


def _whole(url: str, prompt: str, max_tokens: int, read_timeout: float = CLIENT_S) -> Outcome:
    """A whole answer; a short `read_timeout` makes the client leave before it comes."""
    timeout = httpx.Timeout(CLIENT_S, read=read_timeout)
    try:
        r = httpx.post(
            f"{url}/v1/completions", json=_body(prompt, max_tokens, False), headers=AUTH, timeout=timeout
        )
    except httpx.ReadTimeout:
        return Outcome(prompt, max_tokens, "", None)
    if r.status_code != 200:
        return Outcome(prompt, max_tokens, "", None, r.status_code)
    choice = r.json()["choices"][0]
    return Outcome(prompt, max_tokens, choice["text"], choice["finish_reason"])


def _random_paths(url: str, seed: int) -> list[int]:
    rng = random.Random(seed)
    statuses = []
    with httpx.Client(timeout=CLIENT_S) as http:
        for _ in range(RANDOM_PATHS // 2):
            path = "/" + "/".join(f"{rng.getrandbits(40):x}" for _ in range(rng.randint(1, 3)))
            headers = AUTH if rng.random() < 0.5 else {}
            method = rng.choice(["GET", "POST", "DELETE"])
            statuses.append(http.request(method, f"{url}{path}", headers=headers).status_code)
    return statuses


def test_a_mixed_load_leaves_nothing_behind(parts):
    llm, ssm, tokenizer = parts
    decoder = SpeculativeDecoder(llm, [ssm], tokenizer, compile=False)
    config = ServerConfig(model_name=MODEL, api_key=KEY, request_timeout=TIMEOUT_S)
    app = create_app(decoder, config, EngineConfig(batch_size=4, num_groups=2, max_queue=64))
    with serve_in_background(app) as url, ThreadPoolExecutor(18) as pool:
        engine = app.state.server.engine
        jobs = [pool.submit(_random_paths, url, seed) for seed in (1, 2)]
        for i, prompt in enumerate(PROMPTS):
            n = 12 + 8 * i
            jobs.append(pool.submit(_streamed, url, prompt, n))  # complete: 6 streams
            jobs.append(pool.submit(_whole, url, prompt, n + 5))  # complete: 6 whole answers
        for prompt in PROMPTS[:2]:
            jobs.append(pool.submit(_streamed, url, prompt, 600, leave_after=3))  # leave mid-stream
            jobs.append(pool.submit(_whole, url, prompt, 600, read_timeout=0.3))  # leave before the answer
        jobs.append(pool.submit(_streamed, url, "Hello", 900))  # may run past the request timeout
        jobs.append(pool.submit(_whole, url, "abc", 900))
        results = [job.result(CLIENT_S * 2) for job in jobs]
        statuses = [s for batch in results[:2] for s in batch]
        outcomes: list[Outcome] = results[2:]

        # Nothing keeps generating for a client that has gone. (The engine counts a finished
        # request just after handing over its last tokens: a moment after its client has it.)
        deadline = time.monotonic() + 10

        def busy() -> bool:
            s = engine.stats
            return bool(engine.active_rows or engine.queue_depth) or s.completed + s.cancelled < len(outcomes)

        while busy() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (engine.active_rows, engine.queue_depth) == (0, 0)
        steps = engine.stats.llm_steps
        time.sleep(0.5)
        assert engine.stats.llm_steps == steps

        metrics = httpx.get(f"{url}/metrics", headers=AUTH).text

    assert set(statuses) <= {401, 404, 405} and len(statuses) == RANDOM_PATHS
    complete = [o for o in outcomes if o.finish is not None and len(o.text) == o.max_tokens]
    assert len(complete) >= 12  # every short request
    for o in outcomes:
        if o.finish is not None:  # a complete answer, or a stream cut at the time limit
            expected = _greedy(parts, o.prompt, o.max_tokens)
            assert o.text == expected if len(o.text) == o.max_tokens else expected.startswith(o.text)
        elif o.status != 200:
            assert o.status == 504  # a whole answer past the time limit
    # The engine counts every request once: completed (with all its tokens) or cancelled.
    stats = engine.stats
    assert stats.completed == len(complete)
    assert stats.completed + stats.cancelled == len(outcomes)
    assert stats.new_tokens == sum(o.max_tokens for o in complete)
    # Random paths share one label: a handful of series, not hundreds.
    routes = set(re.findall(r'specboost_http_requests_total\{route="([^"]*)"', metrics))
    assert routes <= {"unmatched", "/v1/completions", "/metrics"}, routes
    assert len(metrics) < 20_000
