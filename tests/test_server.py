"""The OpenAI-compatible server (`specboost serve`), started for real (uvicorn on a free port) on
tiny models and driven with the official `openai` client: exact greedy answers, streamed and
whole, concurrency, disconnects, back-pressure, authentication and limits; every error in OpenAI's
format, metrics labelled by route, time limits and gone clients that free their rows at once,
tokenization off the event loop, seeds that do not depend on the batch, stop sequences counted
as completed."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from conftest import char_tokenizer, noisy_copy, tiny_llama

from specboost.decoder import SpeculativeDecoder
from specboost.decoder.bench.serve_load import LoadConfig, report, run_load
from specboost.decoder.cli import build_parser
from specboost.decoder.engine import EngineConfig
from specboost.decoder.serve.app import create_app
from specboost.decoder.serve.background import serve_in_background
from specboost.decoder.serve.command import server_config
from specboost.decoder.serve.config import API_KEY_ENV, ServerConfig

MODEL = "tiny"
KEY = "sk-test"
AUTH = {"authorization": f"Bearer {KEY}"}
JSON_AUTH = AUTH | {"content-type": "application/json"}
LONG_BODY = {"model": MODEL, "prompt": "abc", "max_tokens": 900, "temperature": 0}
WAIT_S = 20.0  # bound on every wait for the engine to settle
SLOW_S = 3.0  # seconds `SlowTokenizer` takes
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}.{% endfor %}"
    "{% if add_generation_prompt %}b:{% endif %}"
)


@pytest.fixture(scope="module")
def parts():
    llm = tiny_llama(seed=1, positions=1024)
    ssm = noisy_copy(llm, 0.3, seed=2)
    tokenizer = char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return llm, ssm, tokenizer


def _server(parts, engine: EngineConfig | None = None, **limits) -> Iterator:
    llm, ssm, tokenizer = parts
    decoder = SpeculativeDecoder(llm, [ssm], tokenizer, compile=False)
    app = create_app(
        decoder, ServerConfig(model_name=MODEL, api_key=KEY, **limits), engine or EngineConfig(batch_size=4)
    )
    return app


@pytest.fixture(scope="module")
def served(parts):
    app = _server(parts)
    with serve_in_background(app) as url:
        yield app, url


def _client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def _greedy(parts, ids: list[int], n: int) -> str:
    llm, _, tokenizer = parts
    out = llm.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=None)
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def _openai_error(response: httpx.Response, status: int) -> dict:
    """The error of `response`, checked to be `status` in OpenAI's format."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def _settled(engine, resolved: int = 0) -> None:
    """Wait (bounded) until no row is generating and the engine has counted at least `resolved`
    requests (completed, failed or cancelled): it counts a finished request just after handing
    over its last tokens, so a client may have its answer a moment before the count moves."""
    deadline = time.monotonic() + WAIT_S

    def busy() -> bool:
        s = engine.stats
        return (
            bool(engine.active_rows or engine.queue_depth) or s.completed + s.failed + s.cancelled < resolved
        )

    while busy() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not busy()


def test_greedy_completions_equal_generate_whole_and_streamed(parts, served):
    _, url = served
    client = _client(url)
    _, _, tokenizer = parts
    for prompt in ("abc", "Hello.world"):
        expected = _greedy(parts, tokenizer(prompt).input_ids, 40)
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
        assert whole.choices[0].text == expected
        assert whole.choices[0].finish_reason == "length"
        assert whole.usage.completion_tokens == 40
        assert whole.usage.prompt_tokens == len(tokenizer(prompt).input_ids)
        stream = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True
        )
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == "length"
        assert len(chunks) > 2  # streamed as steps are accepted, not in one piece


def test_greedy_chat_equals_generate_whole_and_streamed(parts, served):
    _, url = served
    _, _, tokenizer = parts
    client = _client(url)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = tokenizer(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ).input_ids
    expected = _greedy(parts, ids, 30)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=30,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 30


def test_stop_sequence_ends_the_text_before_it(parts, served):
    _, url = served
    _, _, tokenizer = parts
    full = _greedy(parts, tokenizer("abc").input_ids, 40)
    stop = full[10:12]
    expected = full[: full.find(stop)]
    client = _client(url)
    whole = client.completions.create(model=MODEL, prompt="abc", max_tokens=40, temperature=0, stop=stop)
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=40, temperature=0, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_32_concurrent_clients_with_mixed_settings(parts, served):
    _, url = served
    _, _, tokenizer = parts
    prompts = ["abc", "Hello", "x1y2", "The.cat"]

    def one(i: int) -> tuple[int, tuple]:
        client = _client(url)
        prompt, n = prompts[i % 4], 8 + (i % 5) * 6
        greedy = i % 2 == 0
        settings = {"temperature": 0} if greedy else {"temperature": 0.8, "top_p": 0.9, "seed": i}
        if i % 3 == 0:
            usage = {"include_usage": True}
            stream = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=n, stream=True, stream_options=usage, **settings
            )
            chunks = list(stream)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)
            return i, (prompt, n, greedy, text, finish, chunks[-1].usage.completion_tokens)
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, **settings)
        return i, (
            prompt,
            n,
            greedy,
            out.choices[0].text,
            out.choices[0].finish_reason,
            out.usage.completion_tokens,
        )

    with ThreadPoolExecutor(32) as pool:
        answers = dict(pool.map(one, range(32)))
    assert sorted(answers) == list(range(32))
    for prompt, n, greedy, text, finish, tokens in answers.values():
        assert (finish, tokens) == ("length", n)  # complete: every token generated, none twice
        if greedy:
            assert text == _greedy(parts, tokenizer(prompt).input_ids, n)


def test_a_client_that_disconnects_mid_stream_frees_its_row(parts, served):
    app, url = served
    engine = app.state.server.engine
    cancelled = engine.stats.cancelled
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 900, "temperature": 0, "stream": True}
    headers = AUTH
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r,
    ):
        assert r.status_code == 200
        next(r.iter_lines())  # the first event: the request is running
        assert engine.active_rows == 1
    deadline = time.monotonic() + 20
    while (engine.active_rows or engine.stats.cancelled == cancelled) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.active_rows == 0
    assert engine.stats.cancelled == cancelled + 1


def test_a_full_queue_answers_429_with_retry_after(parts):
    """One row busy (a long request), one request queued: the next is refused with 429."""
    llm = tiny_llama(seed=1, positions=8192)  # room for a request that outlasts the test's steps
    tokenizer = parts[2]
    long_run = (llm, noisy_copy(llm, 0.3, seed=2), tokenizer)
    app = _server(long_run, EngineConfig(batch_size=1, num_groups=1, max_queue=1), max_tokens_limit=8000)
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 8000, "temperature": 0}
    headers = AUTH

    def post(payload: dict) -> httpx.Response:
        return httpx.post(f"{url}/v1/completions", json=payload, headers=headers, timeout=60)

    with serve_in_background(app) as url, httpx.Client(timeout=60) as http:
        engine = app.state.server.engine
        stream = body | {"stream": True}
        with http.stream("POST", f"{url}/v1/completions", json=stream, headers=headers) as running:
            lines = running.iter_lines()  # kept: a dropped iterator closes the connection
            next(lines)  # the first request holds the only row
            waiting = ThreadPoolExecutor(1).submit(post, body)
            deadline = time.monotonic() + 20
            while engine.queue_depth < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            refused = post(body)
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "1"
            assert "EngineConfig.max_queue=1" in refused.json()["error"]["message"]
            engine.close(cancel=True)
        assert waiting.result(60).status_code == 200  # the queued one is answered, not dropped


def test_authentication_and_limits_stop_requests_before_the_engine(parts, served):
    app, url = served
    engine = app.state.server.engine
    submitted = []
    real_submit = engine.submit
    engine.submit = lambda *a, **k: submitted.append(1) or real_submit(*a, **k)
    try:
        assert httpx.get(f"{url}/health").status_code == 200  # open without a key
        assert httpx.get(f"{url}/metrics").status_code == 401
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 4}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401
        wrong = httpx.post(f"{url}/v1/completions", json=body, headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            _client(url, key="nope").completions.create(model=MODEL, prompt="abc", max_tokens=4)
        big = httpx.post(
            f"{url}/v1/completions",
            json=body | {"prompt": "a" * (2 << 20)},
            headers={"authorization": f"Bearer {KEY}"},
        )
        assert big.status_code == 413
        assert "--max-body-bytes" in big.json()["error"]["message"]
        client = _client(url)
        for bad, text in [
            ({"max_tokens": 10**6}, "--max-tokens-limit"),
            ({"prompt": "a" * 5000}, "--max-prompt-tokens"),
            ({"n": 2}, "n=2"),
            ({"logit_bias": {"1": 2.0}}, "logit_bias"),
        ]:
            with pytest.raises(openai.BadRequestError, match=text.replace("-", "\\-")):
                client.completions.create(model=MODEL, **({"prompt": "abc", "max_tokens": 4} | bad))
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="abc", max_tokens=4)
        assert submitted == []
        with pytest.raises(openai.BadRequestError, match="context holds 1024"):  # the engine's own check
            client.completions.create(model=MODEL, prompt="b" * 1500, max_tokens=4)
    finally:
        engine.submit = real_submit


def test_chat_without_a_template_is_a_clear_400(parts):
    llm, ssm, _tokenizer = parts
    plain = char_tokenizer()
    decoder = SpeculativeDecoder(llm, [ssm], plain, compile=False)
    app = create_app(decoder, ServerConfig(model_name=MODEL))
    with serve_in_background(app) as url, pytest.raises(openai.BadRequestError, match="no chat template"):
        _client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])


def test_metrics_report_the_engine_in_prometheus_format(served):
    _, url = served
    _client(url).completions.create(model=MODEL, prompt="abc", max_tokens=12, temperature=0)
    values = _metrics(url)
    assert values["specboost_generated_tokens_total"] >= 12
    assert values["specboost_tokens_per_step"] >= 1.0
    assert 0.0 <= values["specboost_acceptance_rate"] <= 1.0
    assert 'specboost_ssm_acceptance_rate{ssm="0"}' in values
    assert "specboost_queue_depth" in values and "specboost_batch_size" in values
    assert values['specboost_http_requests_total{route="/v1/completions",status="200"}'] >= 1
    assert "specboost_time_to_first_token_seconds_count" in values


def test_serve_options_become_the_server_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """`specboost serve` binds this machine only by default and takes the key from the environment."""
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    base = ["serve", "--llm", "models/my-llm", "--pool", "pool"]
    config = server_config(
        build_parser().parse_args([*base, "--max-tokens-limit", "100", "--default-max-tokens", "50"])
    )
    assert (config.host, config.api_key, config.model_name) == ("127.0.0.1", "from-env", "my-llm")
    assert (config.max_tokens_limit, config.default_max_tokens) == (100, 50)
    given = server_config(
        build_parser().parse_args([*base, "--api-key", "given", "--request-timeout", "2.5"])
    )
    assert (given.api_key, given.request_timeout) == ("given", 2.5)
    too_many = [*base, "--default-max-tokens", "500", "--max-tokens-limit", "100"]
    with pytest.raises(ValueError, match="exceeds max_tokens_limit"):
        server_config(build_parser().parse_args(too_many))


def test_the_load_benchmark_drives_a_server_and_reports(served):
    """`serve_load` (the benchmark, not timed here): every request streamed to the end and counted."""
    _, url = served
    config = LoadConfig(requests=3, concurrency=2, max_tokens=5, warmup=1, rounds=1, model=MODEL)
    headers = AUTH
    results = run_load({"plain": url, "speculative": url}, ["abc", "bcd"], config, headers)
    assert [(r.mode, len(r.timings)) for r in results] == [("plain", 3), ("speculative", 3)]
    assert all(t.tokens == 5 and 0 < t.first_token <= t.total for r in results for t in r.timings)
    text, record = report(results, config, {"device": "cpu"})
    assert "speculative vs plain" in text and set(record["figures"]) == {"plain", "speculative"}


# Errors, labels and the lifetime of requests --------------------------------------------------------
@pytest.fixture(scope="module")
def slow_parts(parts):
    """The same models with an LLM that sleeps in every pass: a long request stays in flight for
    seconds (900 tokens take several), long enough to leave it or time it out mid-way."""
    llm = tiny_llama(seed=1, positions=1024)
    llm.register_forward_hook(lambda *_: time.sleep(0.01))
    return llm, parts[1], parts[2]


def test_http_requests_are_counted_by_route_template_not_by_raw_path(served):
    """Unauthenticated requests to random paths share one label: /metrics stays bounded."""
    _, url = served
    with httpx.Client(timeout=30) as http:
        for i in range(40):
            assert http.get(f"{url}/probe/{i}").status_code == 401
            assert http.get(f"{url}/probe/{i}", headers=AUTH).status_code == 404
        assert http.post(f"{url}/v1/completions", json={}).status_code == 401
    values = _metrics(url)
    routes = {key for key in values if key.startswith("specboost_http_requests_total")}
    assert not any("/probe" in key for key in routes)
    assert values['specboost_http_requests_total{route="unmatched",status="401"}'] >= 40
    assert values['specboost_http_requests_total{route="unmatched",status="404"}'] >= 40
    assert values['specboost_http_requests_total{route="/v1/completions",status="401"}'] >= 1


def test_every_error_is_in_openai_format_and_keeps_the_connection(served, monkeypatch):
    app, url = served
    completion = b'{"model": "tiny", "max_tokens": 3, "prompt": '
    with httpx.Client(base_url=url, timeout=30) as http:
        for body, param in [
            (completion + b'"a\\ud800"}', "prompt"),  # a lone surrogate, as JSON escapes it
            (completion + b'["a\\udfff"]}', "prompt"),
        ]:
            error = _openai_error(http.post("/v1/completions", content=body, headers=JSON_AUTH), 400)
            assert param in (error["param"] or "") + error["message"]
        chat = b'{"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi\\ud800"}]}'
        error = _openai_error(http.post("/v1/chat/completions", content=chat, headers=JSON_AUTH), 400)
        assert "messages" in (error["param"] or "") + error["message"]
        assert http.get("/health").status_code == 200  # the same connection still serves
        for body in [completion + b'"a\xff\xfe"}', b"[" * 100_000 + b"]" * 100_000, b'{"model": ']:
            _openai_error(http.post("/v1/completions", content=body, headers=JSON_AUTH), 400)
        _openai_error(http.post("/v1/completions", json={"model": MODEL}, headers=AUTH), 400)
        assert _openai_error(http.get("/nowhere", headers=AUTH), 404)["type"] == "invalid_request_error"
        assert "allow" in http.get("/v1/completions", headers=AUTH).headers
        _openai_error(http.get("/v1/completions", headers=AUTH), 405)
        assert _openai_error(http.get("/v1/models"), 401)["type"] == "authentication_error"
        big = http.post("/v1/completions", content=b"x" * (2 << 20), headers=JSON_AUTH)
        _openai_error(big, 413)

        def broken(*_):
            raise RuntimeError("an internal detail")

        monkeypatch.setattr(app.state.server, "prompt_ids", broken)
        error = _openai_error(http.post("/v1/completions", json=LONG_BODY, headers=AUTH), 500)
        assert error["type"] == "server_error" and "an internal detail" not in error["message"]
        assert http.get("/health").status_code == 200


def test_non_finite_numbers_and_out_of_range_seeds_are_refused_naming_the_field(served):
    _, url = served
    base = b'{"model": "tiny", "prompt": "abc", "max_tokens": 3, '
    for field in (b'"temperature": NaN}', b'"temperature": Infinity}', b'"top_p": -Infinity}'):
        response = httpx.post(f"{url}/v1/completions", content=base + field, headers=JSON_AUTH)
        assert _openai_error(response, 400)["param"] == field.split(b'"')[1].decode()
    for seed in (2**70, 2**64, -1):
        response = httpx.post(f"{url}/v1/completions", json=LONG_BODY | {"seed": seed}, headers=AUTH)
        error = _openai_error(response, 400)
        assert error["param"] == "seed" and "overflow" not in error["message"].lower()
    ok = httpx.post(
        f"{url}/v1/completions", json=LONG_BODY | {"max_tokens": 2, "seed": 2**63 - 1}, headers=AUTH
    )
    assert ok.status_code == 200


def test_the_bearer_scheme_is_case_insensitive(served):
    _, url = served
    for scheme in ("bearer", "BEARER", "Bearer"):
        assert httpx.get(f"{url}/v1/models", headers={"authorization": f"{scheme} {KEY}"}).status_code == 200
    assert httpx.get(f"{url}/v1/models", headers={"authorization": f"Basic {KEY}"}).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"authorization": f"bearer {KEY}x"}).status_code == 401


def test_a_non_streaming_client_that_leaves_frees_its_row(slow_parts):
    """Tokens keep arriving while the client is gone: its row is freed anyway, at once."""
    app = _server(slow_parts)
    with serve_in_background(app) as url:
        engine = app.state.server.engine
        before = engine.stats
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{url}/v1/completions", json=LONG_BODY, headers=AUTH, timeout=httpx.Timeout(30, read=0.5)
            )
        left = time.monotonic()
        _settled(engine)
        assert time.monotonic() - left < 3.0  # 900 tokens take several seconds
        after = engine.stats
        assert (after.cancelled, after.completed) == (before.cancelled + 1, before.completed)


def test_the_request_timeout_ends_whole_and_streamed_requests(slow_parts):
    """A whole answer past --request-timeout is a 504 error; a stream ends with finish_reason
    "length"; both free their rows."""
    app = _server(slow_parts, request_timeout=1.0)
    with serve_in_background(app) as url:
        engine = app.state.server.engine
        start = time.monotonic()
        response = httpx.post(f"{url}/v1/completions", json=LONG_BODY, headers=AUTH, timeout=30)
        assert time.monotonic() - start < 4.0
        error = _openai_error(response, 504)
        assert "--request-timeout" in error["message"] and error["code"] == "request_timeout"
        start = time.monotonic()
        stream = _client(url).completions.create(
            model=MODEL, prompt="abc", max_tokens=900, temperature=0, stream=True
        )
        chunks = list(stream)
        assert time.monotonic() - start < 4.0
        assert chunks[-1].choices[0].finish_reason == "length"
        assert sum(len(c.choices[0].text) for c in chunks) < 900
        _settled(engine, 2)
        assert engine.stats.cancelled == 2 and engine.stats.completed == 0


class SlowTokenizer:
    """The tokenizer, taking `SLOW_S` seconds to tokenize or to apply the chat template (a ~1 MB
    prompt on a slow machine)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)

    def __call__(self, *args, **kwargs):
        time.sleep(SLOW_S)
        return self.tokenizer(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        time.sleep(SLOW_S)
        return self.tokenizer.apply_chat_template(*args, **kwargs)


def test_tokenizing_a_prompt_never_stalls_other_requests(served, monkeypatch):
    app, url = served
    monkeypatch.setattr(app.state.server, "tokenizer", SlowTokenizer(app.state.server.tokenizer))
    client = _client(url)
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(client.completions.create, model=MODEL, prompt="abc", max_tokens=3)
        chat = pool.submit(
            client.chat.completions.create,
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
        )
        time.sleep(0.5)  # both are being tokenized now
        start = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        assert time.monotonic() - start < 1.0  # tokenizing takes SLOW_S
        assert whole.result(60).usage.completion_tokens == 3
        assert chat.result(60).usage.completion_tokens == 3


def test_a_seed_gives_the_same_text_alone_and_in_a_busy_batch(served):
    """The text of a seeded sampled request depends on its seed, not on the requests beside it."""
    app, url = served
    engine = app.state.server.engine
    client = _client(url)

    def seeded(seed: int) -> str:
        settings = {"temperature": 0.8, "top_p": 0.9, "seed": seed}
        return client.completions.create(model=MODEL, prompt="abc", max_tokens=40, **settings).choices[0].text

    alone = {seed: seeded(seed) for seed in (7, 8)}
    assert {seed: seeded(seed) for seed in (7, 8)} == alone
    others = {"model": MODEL, "max_tokens": 300, "temperature": 0.9, "stream": True}
    with ThreadPoolExecutor(3) as pool:
        busy = [pool.submit(lambda p: list(client.completions.create(prompt=p, **others)), p) for p in "xyz"]
        deadline = time.monotonic() + WAIT_S
        while engine.active_rows < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert {seed: seeded(seed) for seed in (7, 8)} == alone
        for future in busy:
            future.result(60)


def test_a_stop_sequence_counts_as_completed_and_is_timed(parts):
    """A server of its own: its counts start at zero."""
    _, _, tokenizer = parts
    full = _greedy(parts, tokenizer("abc").input_ids, 40)
    stop = full[10:12]
    app = _server(parts)
    with serve_in_background(app) as url:
        engine = app.state.server.engine
        client = _client(url)
        settings = {"model": MODEL, "prompt": "abc", "max_tokens": 40, "temperature": 0, "stop": stop}
        assert client.completions.create(**settings).choices[0].finish_reason == "stop"
        assert list(client.completions.create(**settings, stream=True))[-1].choices[0].finish_reason == "stop"
        _settled(engine, 2)
        assert (engine.stats.completed, engine.stats.cancelled) == (2, 0)
        assert _metrics(url)["specboost_request_latency_seconds_count"] == 2
