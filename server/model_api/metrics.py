"""Prometheus metrics of the model server, on the daemon's registry beside its `kvcache_` series.

Names are vLLM's (V1) with the prefix `kvcache:` for `vllm:`, so a vLLM dashboard ports by
replacing the prefix; every series carries vLLM's `model_name` label. What vLLM has no name for
(prefix-cache hits by tier, arrivals, rejections) is named in the same style.

Running and waiting requests are gauges read from the engine at scrape time through a callable,
so they can never drift from it. Everything else is counted by the routes as requests arrive,
emit their first token and finish. Label values (api, finish reason, rejection reason, tier) come
from the server's code, never from a client, so the series stay few.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvcache.kvstore.types import TierName

PREFIX = "kvcache:"
# Latencies from a GPU's milliseconds to a CPU's minutes (a long prompt on the demo model).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0,
                   50.0, 100.0, 250.0, 600.0)
# One output token: under a millisecond batched on a GPU to seconds on a loaded CPU.
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                         0.75, 1.0, 2.5, 5.0, 10.0)
TOKEN_COUNT_BUCKETS = tuple(m * 10 ** e for e in range(6) for m in (1, 2, 5))   # 1 .. 500k tokens
FINISH_REASONS = ("stop", "length", "abort", "error")    # the engine's, present from the start at 0


class _QueueCollector:
    """num_requests_running / num_requests_waiting, read when scraped."""

    def __init__(self, model_name: str, running_waiting: Callable[[], tuple[int, int]]):
        self.model_name, self.running_waiting = model_name, running_waiting

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (GaugeMetricFamily(PREFIX + "num_requests_running", "Requests in the engine's running batch",
                                  labels=["model_name"]),
                GaugeMetricFamily(PREFIX + "num_requests_waiting", "Requests in the engine waiting to run",
                                  labels=["model_name"]))

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families()       # names only: registering never calls into the engine

    def collect(self) -> Iterator[GaugeMetricFamily]:
        running, waiting = self.running_waiting()
        families = self._families()
        for family, value in zip(families, (running, waiting)):
            family.add_metric([self.model_name], value)
        yield from families


class _SpecCollector:
    """Speculative decoding, vLLM's series: drafts (verify rounds), draft tokens, accepted tokens,
    accepted tokens per draft position; read from the engine's SpecStats when scraped (absent
    while the engine has no speculation)."""

    def __init__(self, model_name: str, stats: Callable[[], object]):
        self.model_name, self.stats = model_name, stats

    def describe(self) -> Iterator[CounterMetricFamily]:
        return iter(())                   # unchecked: registering never calls into the engine

    def collect(self) -> Iterator[CounterMetricFamily]:
        s = self.stats()
        if s is None:
            return
        m = self.model_name
        for name, doc, value in (("spec_decode_num_drafts", "Verify rounds (a request's drafts checked)", s.steps),
                                 ("spec_decode_num_draft_tokens", "Draft tokens verified", sum(s.proposed)),
                                 ("spec_decode_num_accepted_tokens", "Draft tokens accepted", sum(s.accepted))):
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([m], value)
            yield family
        family = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by draft position (0: the first)",
                                     labels=["model_name", "position"])
        for pos, value in enumerate(list(s.accepted)):
            family.add_metric([m, str(pos)], value)
        yield family


class ServingMetrics:
    def __init__(self, registry: CollectorRegistry, running_waiting: Callable[[], tuple[int, int]],
                 model_name: str = "", spec_stats: Callable[[], object] = lambda: None):
        """running_waiting: the engine's (running, waiting) request counts, called at each scrape;
        model_name: the served model name, the value of every series' model_name label."""
        self.model_name = m = model_name
        r = registry

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=r).labels(m)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, ["model_name", *labels], registry=r)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency", LATENCY_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds", "Mean time per output token after "
                              "the first, per request", TOKEN_LATENCY_BUCKETS)
        self.prompt_sizes = histogram("request_prompt_tokens", "Prompt tokens per request", TOKEN_COUNT_BUCKETS)
        self.generation_sizes = histogram("request_generation_tokens", "Generated tokens per request",
                                          TOKEN_COUNT_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests").labels(m)
        self.generation_tokens = counter("generation_tokens", "Tokens generated by finished requests").labels(m)
        self.success = counter("request_success", "Finished requests, by finish reason", ("finished_reason",))
        self.cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache").labels(m)
        self.cache_hits = counter("prefix_cache_hits", "Prompt tokens whose KV came from the cache, by the tier "
                                  "that served them", ("tier",))
        self.arrivals = counter("requests_received", "Requests to the model routes, by API", ("api",))
        self.rejections = counter("requests_rejected", "Requests refused before the engine, by API and reason",
                                  ("api", "reason"))
        for reason in FINISH_REASONS:
            self.success.labels(m, reason)
        for tier in TierName:
            self.cache_hits.labels(m, tier.value)
        registry.register(_QueueCollector(m, running_waiting))
        registry.register(_SpecCollector(m, spec_stats))

    def arrived(self, api: str) -> None:
        self.arrivals.labels(self.model_name, api).inc()

    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def finished(self, api: str, finish_reason: str, prompt_tokens: int, generation_tokens: int,
                 cached_by_tier: dict[str, int], e2e_s: float, tpot_s: float | None) -> None:
        """One request's end, whatever the reason (api is not a label here: vLLM's series have none)."""
        m = self.model_name
        self.success.labels(m, finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.prompt_sizes.observe(prompt_tokens)
        self.generation_sizes.observe(generation_tokens)
        self.cache_queries.inc(prompt_tokens)
        for tier, n in cached_by_tier.items():
            self.cache_hits.labels(m, str(tier)).inc(n)
        self.e2e.observe(e2e_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)

    def rejected(self, api: str, reason: str) -> None:
        self.rejections.labels(self.model_name, api, reason).inc()
