"""ServingMetrics scraped as Prometheus would: vLLM's names under `kvcache:`, the model_name label,
hits by tier, running/waiting read at scrape time, and coexistence with the daemon's series."""

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvcache.kvstore.types import StoreStats, TierName
from kvcache.server.metrics import Metrics
from kvcache.server.model_api.metrics import ServingMetrics


def scrape(registry) -> dict[str, dict[tuple, float]]:
    """sample name -> {sorted label items: value}"""
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def value(samples, name: str, **labels) -> float:
    return samples[name][tuple(sorted({"model_name": "m", **labels}.items()))]


def serving(queue=(0, 0)):
    registry, state = CollectorRegistry(), {"queue": queue}
    return registry, state, ServingMetrics(registry, lambda: state["queue"], model_name="m")


def test_running_and_waiting_are_read_at_each_scrape():
    registry, state, _ = serving((3, 7))
    s = scrape(registry)
    assert value(s, "kvcache:num_requests_running") == 3 and value(s, "kvcache:num_requests_waiting") == 7
    state["queue"] = (0, 1)
    s = scrape(registry)
    assert value(s, "kvcache:num_requests_running") == 0 and value(s, "kvcache:num_requests_waiting") == 1


def test_a_finished_request_counts_tokens_hits_by_tier_and_latencies():
    registry, _, m = serving()
    m.arrived("chat")
    m.first_token(0.02)
    m.finished("chat", "stop", prompt_tokens=600, generation_tokens=11, cached_by_tier={"hbm": 256, "dram": 192},
               e2e_s=0.5, tpot_s=0.03)
    m.finished("messages", "length", prompt_tokens=100, generation_tokens=1, cached_by_tier={}, e2e_s=0.1,
               tpot_s=None)
    s = scrape(registry)
    assert value(s, "kvcache:prompt_tokens_total") == 700
    assert value(s, "kvcache:generation_tokens_total") == 12
    assert value(s, "kvcache:prefix_cache_queries_total") == 700
    assert value(s, "kvcache:prefix_cache_hits_total", tier="hbm") == 256
    assert value(s, "kvcache:prefix_cache_hits_total", tier="dram") == 192
    assert value(s, "kvcache:prefix_cache_hits_total", tier="nvme") == 0      # every tier present at 0
    assert value(s, "kvcache:request_success_total", finished_reason="stop") == 1
    assert value(s, "kvcache:request_success_total", finished_reason="length") == 1
    assert value(s, "kvcache:request_success_total", finished_reason="abort") == 0
    assert value(s, "kvcache:requests_received_total", api="chat") == 1
    assert value(s, "kvcache:time_to_first_token_seconds_count") == 1
    assert value(s, "kvcache:time_to_first_token_seconds_bucket", le="0.025") == 1
    assert value(s, "kvcache:time_to_first_token_seconds_bucket", le="0.01") == 0
    assert value(s, "kvcache:e2e_request_latency_seconds_count") == 2
    assert value(s, "kvcache:e2e_request_latency_seconds_sum") == pytest.approx(0.6)
    assert value(s, "kvcache:request_time_per_output_token_seconds_count") == 1   # None is not observed
    assert value(s, "kvcache:request_prompt_tokens_sum") == 700


def test_the_engine_tier_names_are_the_labels():
    registry, _, m = serving()
    m.finished("chat", "stop", 64, 2, {TierName.NVME: 64}, 1.0, 0.1)
    assert value(scrape(registry), "kvcache:prefix_cache_hits_total", tier="nvme") == 64


def test_rejections_by_api_and_reason():
    registry, _, m = serving()
    m.rejected("chat", "server_busy")
    m.rejected("chat", "server_busy")
    m.rejected("messages", "tenant_tokens")
    s = scrape(registry)
    assert value(s, "kvcache:requests_rejected_total", api="chat", reason="server_busy") == 2
    assert value(s, "kvcache:requests_rejected_total", api="messages", reason="tenant_tokens") == 1


def test_buckets_span_milliseconds_to_minutes():
    registry, _, m = serving()
    m.first_token(0.0005)
    m.first_token(400.0)
    s = scrape(registry)
    assert value(s, "kvcache:time_to_first_token_seconds_bucket", le="0.001") == 1
    assert value(s, "kvcache:time_to_first_token_seconds_bucket", le="250.0") == 1
    assert value(s, "kvcache:time_to_first_token_seconds_bucket", le="600.0") == 2


class _IdleStore:
    dram = None

    def stats(self):
        return StoreStats(data_dir="", index_blocks=0, namespaces=0, tiers=[], counters={}, persistent_counters={})


def test_serving_metrics_share_the_daemon_registry():
    daemon = Metrics(_IdleStore())
    ServingMetrics(daemon.registry, lambda: (1, 2), model_name="m")
    body, _ = daemon.render()
    s = scrape(daemon.registry)
    assert value(s, "kvcache:num_requests_waiting") == 2
    assert "kvcache_index_blocks" in s
    assert b"kvcache:prompt_tokens_total" in body
