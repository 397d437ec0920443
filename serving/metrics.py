"""The server's Prometheus metrics (GET /metrics, prometheus_client's text format): requests by how they ended and
by the model they named (the served model's name or a LoRA adapter's), tokens in and out, time to first token,
inter-token latency, and at each scrape the queue's length, the slots in use and the prefix cache's tokens looked up
and found (vLLM's prefix_cache_queries and prefix_cache_hits: their ratio is the hit rate). The scheduler reports
through `observe`."""
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

LATENCIES = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self, stats, prefix_cache=None, served: str = ""):
        """stats(): (requests waiting, slots in use), read at each scrape, as the prefix cache's counts are;
        served: the model's name, which its requests without an adapter count under."""
        self.registry, self.served = CollectorRegistry(), served
        if prefix_cache is not None:
            self.registry.register(PrefixCacheCounts(prefix_cache))
        self.finished = Counter("megalite_requests", "Requests finished, by reason (stop, length, cancelled)",
                                ["reason"], registry=self.registry)
        self.by_model = Counter("megalite_model_requests", "Requests finished, by the model or LoRA adapter named",
                                ["model"], registry=self.registry)
        self.refused = Counter("megalite_requests_refused", "Requests refused with a 4xx, by status", ["status"],
                               registry=self.registry)
        self.prompt_tokens = Counter("megalite_prompt_tokens", "Prompt tokens of admitted requests",
                                     registry=self.registry)
        self.generated_tokens = Counter("megalite_generation_tokens", "Tokens generated", registry=self.registry)
        self.first_token = Histogram("megalite_time_to_first_token_seconds", "From a request's arrival to its first "
                                     "token", buckets=LATENCIES, registry=self.registry)
        self.inter_token = Histogram("megalite_inter_token_latency_seconds", "Between two tokens of a request",
                                     buckets=LATENCIES, registry=self.registry)
        waiting = Gauge("megalite_queue_length", "Requests waiting for a slot", registry=self.registry)
        running = Gauge("megalite_slots_in_use", "Cache slots holding a request", registry=self.registry)
        waiting.set_function(lambda: stats()[0])
        running.set_function(lambda: stats()[1])
        self.last_token: dict[int, float] = {}

    def observe(self, event: str, request, value) -> None:
        """The scheduler's hook: a request admitted, a token drawn, a request finished."""
        now = time.monotonic()
        if event == "admitted":
            self.prompt_tokens.inc(len(request.prompt))
        elif event == "token":
            self.generated_tokens.inc()
            last = self.last_token.get(id(request))
            if last is None:
                self.first_token.observe(now - request.submitted)
            else:
                self.inter_token.observe(now - last)
            self.last_token[id(request)] = now
        elif event == "finished":
            self.finished.labels(reason=value).inc()
            self.by_model.labels(model=self.served if request.adapter is None else request.adapter.name).inc()
            self.last_token.pop(id(request), None)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class PrefixCacheCounts:
    """The prefix cache's own counts, read at each scrape."""

    def __init__(self, prefix_cache):
        self.prefix_cache = prefix_cache

    def collect(self):
        for name, what, value in [("queries", "Prompt tokens looked up in the prefix cache", self.prefix_cache.queries),
                                  ("hits", "Prompt tokens found in the prefix cache", self.prefix_cache.hits)]:
            yield CounterMetricFamily(f"megalite_prefix_cache_{name}", what, value=value)
