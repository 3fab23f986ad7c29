"""The gateway's request metrics in vLLM's names and labels under a `stateblock:` prefix, so
dashboards and autoscalers written for vLLM (KEDA on num_requests_waiting, Grafana on
e2e_request_latency_seconds) read stateblock by swapping the prefix."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    """One per gateway; every series is labelled with the served model's name."""

    def __init__(self, metrics: CollectorRegistry, model_name: str) -> None:
        model = ["model_name"]
        self.model_name = model_name
        self.e2e = Histogram(
            "stateblock:e2e_request_latency_seconds",
            "End-to-end latency (validate, capture, readout, commit, decode), by outcome: "
            "ok, or the error's class.",
            [*model, "outcome"],
            buckets=LATENCY_BUCKETS_S,
            registry=metrics,
        )
        self.ttft = Histogram(
            "stateblock:time_to_first_token_seconds",
            "Time to the first token: the whole block arrives at once, so the answer's latency.",
            model,
            buckets=LATENCY_BUCKETS_S,
            registry=metrics,
        )
        self.running = Gauge(
            "stateblock:num_requests_running",
            "Requests captured and waiting for their readout.",
            model,
            registry=metrics,
        )
        self.waiting = Gauge(
            "stateblock:num_requests_waiting",
            "Requests accepted and not yet captured (queued for the base forward).",
            model,
            registry=metrics,
        )
        self.prompt_tokens = Counter(
            "stateblock:prompt_tokens",
            "Prompt tokens of answered requests.",
            model,
            registry=metrics,
        )
        self.generation_tokens = Counter(
            "stateblock:generation_tokens",
            "Answer tokens returned to clients.",
            model,
            registry=metrics,
        )
        self.success = Counter(
            "stateblock:request_success",
            "Answered requests by finish reason.",
            [*model, "finished_reason"],
            registry=metrics,
        )
        self.requests = Counter(
            "stateblock_requests",
            "Requests by API and outcome.",
            ["api", "outcome"],
            registry=metrics,
        )
        self.recaptures = Counter(
            "stateblock_gateway_recaptures",
            "Blocks rejected for a reason not the request's own (their payload lost, expired "
            "unread) and captured again for the same request.",
            ["reason"],
            registry=metrics,
        )
        # process_* and python_* series, as the default registry would have them (the
        # services serve their own registry, which starts without them)
        ProcessCollector(registry=metrics)
        PlatformCollector(registry=metrics)
