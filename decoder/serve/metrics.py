"""`/metrics` in the Prometheus text format (`prometheus-client`).

The engine's own totals (tokens, drafted and accepted tokens overall and per SSM, draft and verify
time, queue depth, batch size) are read from `Engine.stats` at every scrape by a custom collector,
so they are never counted twice; the HTTP side (requests by route and status, time to first token,
request latency, prompt tokens) is counted as requests are answered. Each server has its own
registry, so that several servers in one process (tests, the load benchmark) do not mix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from specboost.decoder.engine import Engine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class EngineCollector(Collector):
    """The engine's totals at scrape time; nothing before the engine has started."""

    def __init__(self, engine: Callable[[], Engine | None]) -> None:
        self.engine = engine

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        engine = self.engine()
        if engine is None:
            return
        s = engine.stats
        counters = {
            "specboost_requests_completed": ("requests the engine finished", s.completed),
            "specboost_requests_failed": ("requests the engine failed with an error", s.failed),
            "specboost_requests_cancelled": ("requests cancelled (client gone, time limit)", s.cancelled),
            "specboost_generated_tokens": ("tokens generated", s.new_tokens),
            "specboost_drafted_tokens": ("tokens the SSMs drafted", s.draft_tokens),
            "specboost_accepted_tokens": ("drafted tokens the LLM accepted", s.accepted_tokens),
            "specboost_sequence_steps": ("verification steps summed over sequences", s.sequence_steps),
            "specboost_llm_passes": ("LLM verification passes (one per batch)", s.llm_steps),
            "specboost_draft_seconds": ("the SSM worker's busy time", s.draft_seconds),
            "specboost_verify_seconds": ("the LLM worker's busy time", s.verify_seconds),
        }
        for name, (text, value) in counters.items():
            yield CounterMetricFamily(name, text, value=value)
        gauges = {
            "specboost_queue_depth": ("requests waiting for a batch row", engine.queue_depth),
            "specboost_batch_size": ("sequences in the engine's batches now", engine.active_rows),
            "specboost_tokens_per_step": (
                "generated tokens per verification step of a sequence",
                s.new_tokens / s.sequence_steps if s.sequence_steps else 0.0,
            ),
            "specboost_acceptance_rate": (
                "accepted / drafted tokens",
                s.accepted_tokens / s.draft_tokens if s.draft_tokens else 0.0,
            ),
        }
        for name, (text, value) in gauges.items():
            yield GaugeMetricFamily(name, text, value=value)
        per_ssm = GaugeMetricFamily(
            "specboost_ssm_acceptance_rate", "accepted / proposed tokens per SSM", labels=["ssm"]
        )
        for ssm, proposed in sorted(s.proposed_per_ssm.items()):
            if proposed:
                per_ssm.add_metric([str(ssm)], s.accepted_per_ssm.get(ssm, 0) / proposed)
        yield per_ssm


class ServerMetrics:
    def __init__(self, engine: Callable[[], Engine | None]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self.requests = Counter(
            "specboost_http_requests",
            "HTTP requests answered, by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "specboost_prompt_tokens", "prompt tokens of accepted requests", registry=self.registry
        )
        self.time_to_first_token = Histogram(
            "specboost_time_to_first_token_seconds",
            "seconds from a request's arrival to its first generated token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.latency = Histogram(
            "specboost_request_latency_seconds",
            "seconds from a request's arrival to its last token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
