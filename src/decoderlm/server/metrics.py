"""Prometheus metrics of the server: the engine's state read at each scrape, and request latencies.

The gauges and counters come from `EngineStats` when /metrics is scraped (so they cannot drift from
the engine; they are left out when it does not answer in time); the two histograms are observed by
the HTTP layer as each token reaches it: time to first token (request received → first token) and
inter-token latency (token → next token).
Each app has its own registry, so several apps (tests) can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from decoderlm.engine.types import EngineStats, EngineStoppedError

PREFIX = "decoderlm"
# Seconds: from a few milliseconds (a tiny model's step) to a minute (a long queue wait).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector(Collector):
    """Yields the engine's gauges and counters from one `EngineStats` snapshot (none while loading)."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.stats()
        except EngineStoppedError:  # the engine did not answer in time: the rest still shows
            return
        if stats is None:
            return
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        metrics = (  # (kind, name, help, value)
            (gauge, "requests_running", "sequences decoding now", stats.running),
            (gauge, "requests_waiting", "requests queued, not yet admitted", stats.waiting),
            (gauge, "kv_blocks_used", "KV-cache blocks in use", stats.kv_blocks_used),
            (gauge, "kv_blocks_total", "KV-cache blocks in the pool", stats.kv_blocks_total),
            (gauge, "state_pages_used", "pages holding recurrent states", stats.state_pages_used),
            (
                gauge,
                "state_pages_total",
                "pages recurrent states can take",
                stats.state_pages_total,
            ),
            (gauge, "max_running_seen", "most sequences decoding at once", stats.max_running_seen),
            (
                gauge,
                "generation_tokens_per_second",
                "recent generated tokens/s",
                stats.tokens_per_s,
            ),
            (
                gauge,
                "speculative_acceptance_rate",
                "accepted / proposed draft tokens",
                stats.speculative_acceptance_rate,
            ),
            (
                gauge,
                "speculative_mean_accepted_length",
                "accepted draft tokens per verification",
                stats.speculative_mean_accepted_length,
            ),
            (counter, "prompt_tokens", "prompt tokens received", stats.prompt_tokens),
            (counter, "generation_tokens", "tokens generated", stats.generated_tokens),
            (
                counter,
                "prefix_cache_hit_tokens",
                "prompt tokens served from cached KV blocks",
                stats.prefix_cache_hit_tokens,
            ),
            (
                counter,
                "speculative_proposed_tokens",
                "draft tokens proposed by speculative decoding (prompt lookup or a draft model)",
                stats.speculative_proposed,
            ),
            (
                counter,
                "speculative_accepted_tokens",
                "draft tokens the target accepted",
                stats.speculative_accepted,
            ),
        )
        for kind, name, doc, value in metrics:
            yield kind(f"{PREFIX}_{name}", doc, value=value)


class Metrics:
    """The server's registry; `render()` is the body and content type of GET /metrics."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "request received to its first token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "one token of a sequence to its next",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
