"""A server's instruments, kept by its engine client (client.py) and rendered as
`/metrics` in Prometheus' text format (prometheus_client), one registry per client: the
requests by how they ended, the tokens generated and the forward calls that made them
(their ratio is the tokens per NFE), the iterations by tokens kept (the accepted-length
histogram), the schedule (and `auto`'s prediction), the queue and the busy slots, and
histograms of the time to first token and of the time per output token after it."""

from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)

# Seconds: a tiny model on a CPU answers in milliseconds, a large one on a busy GPU in
# seconds.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class Metrics:
    """The instruments of one engine client; `queued` and `busy` are read when /metrics is
    asked."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queued, busy, slots: int):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("packed_ss_requests", "requests (each choice) by how they "
                                "ended", ["outcome"], registry=r)
        self.tokens = Counter("packed_ss_generated_tokens", "tokens generated", registry=r)
        self.forward_calls = Counter("packed_ss_forward_calls",
                                     "forward calls (NFE) of the generated tokens", registry=r)
        Gauge("packed_ss_queue_length", "requests (each choice) waiting for a slot",
              registry=r).set_function(queued)
        Gauge("packed_ss_slots_busy", "slots decoding a request",
              registry=r).set_function(busy)
        Gauge("packed_ss_slots", "slots in all", registry=r).set(slots)
        self.accepted = Counter("packed_ss_iterations_by_accepted",
                                "decoder iterations by the tokens each kept: the server's "
                                "running accepted-length histogram", ["tokens"], registry=r)
        self.schedule = Gauge("packed_ss_schedule", "the schedule decoding (1), with its "
                              "width and branches", ["schedule"], registry=r)
        self.predicted = Gauge("packed_ss_auto_predicted_tokens_per_second", "schedule auto: "
                               "the tokens/s its choice was predicted to make with every slot "
                               "busy (0: the schedule was given)", registry=r)
        self.ttft = Histogram("packed_ss_time_to_first_token_seconds", "from a request's "
                              "arrival at the decoder to its first token's hand-out",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("packed_ss_time_per_output_token_seconds", "after the first "
                              "token, seconds per further token of a choice",
                              buckets=_TPOT_BUCKETS, registry=r)

    def finished(self, result, first_token_s: float | None, wall_s: float) -> None:
        """A choice that ended with a result (its time from arrival to its end: `wall_s`)."""
        n = len(result.tokens)
        self.requests.labels(result.finish_reason).inc()
        self.tokens.inc(n)
        self.forward_calls.inc(result.nfe)
        for kept, iterations in enumerate(result.accept_hist):
            if iterations:
                self.accepted.labels(str(kept)).inc(int(iterations))
        if first_token_s is not None and n > 1:
            self.tpot.observe(max(wall_s - first_token_s, 0.0) / (n - 1))

    def schedule_in_use(self, label: str, predicted_tokens_per_s: float | None) -> None:
        self.schedule.clear()   # auto may move to another
        self.schedule.labels(label).set(1)
        self.predicted.set(predicted_tokens_per_s or 0.0)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def ended(self, outcome: str) -> None:
        """A choice that ended without a result: "cancelled" or "error"."""
        self.requests.labels(outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
