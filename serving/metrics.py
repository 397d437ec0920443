"""The server's Prometheus metrics (GET /metrics, prometheus_client's text format): requests by how they ended,
tokens in and out, time to first token, inter-token latency, and at each scrape the queue's length and the slots
in use. The scheduler reports through `observe`."""
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCIES = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self, stats):
        """stats(): (requests waiting, slots in use), read at each scrape."""
        self.registry = CollectorRegistry()
        self.finished = Counter("megalite_requests", "Requests finished, by reason (stop, length, cancelled)",
                                ["reason"], registry=self.registry)
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
            self.last_token.pop(id(request), None)

    def text(self) -> bytes:
        return generate_latest(self.registry)
