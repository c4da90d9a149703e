"""Prometheus metrics, vLLM's names with a `kvrail:` prefix, in one module-level registry.

The worker section below is updated by the worker's modules (`service.delivery`,
`service.output_processor`, `service.heartbeat`); tests read values with
`REGISTRY.get_sample_value(...)`. As vLLM's, each engine metric is labelled `model_name`: the
served model's name (the one clients send and heartbeats carry), so that one Prometheus
scraping the workers of several models tells them apart. The HTTP-side metrics, in their own
section, count what the API answered and carry no model (vLLM's do not either).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry()

# ---- worker (engine) metrics -----------------------------------------------------------------

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_TOKEN_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
_MODEL_NAME = ("model_name",)  # the label of every engine metric

num_requests_running = Gauge(
    "kvrail:num_requests_running",
    "Requests in model execution batches.",
    _MODEL_NAME,
    registry=REGISTRY,
)
num_requests_waiting = Gauge(
    "kvrail:num_requests_waiting",
    "Requests waiting to be scheduled.",
    _MODEL_NAME,
    registry=REGISTRY,
)
kv_cache_usage_perc = Gauge(
    "kvrail:kv_cache_usage_perc",
    "KV-cache usage, 1 = 100 percent.",
    _MODEL_NAME,
    registry=REGISTRY,
)
prompt_tokens = Counter(
    "kvrail:prompt_tokens", "Prompt tokens of finished requests.", _MODEL_NAME, registry=REGISTRY
)
generation_tokens = Counter(
    "kvrail:generation_tokens", "Generated tokens delivered.", _MODEL_NAME, registry=REGISTRY
)
request_success = Counter(
    "kvrail:request_success",
    "Requests answered in full, by finish reason.",
    (*_MODEL_NAME, "finished_reason"),
    registry=REGISTRY,
)
num_preemptions = Counter(
    "kvrail:num_preemptions", "Preemptions by the scheduler.", _MODEL_NAME, registry=REGISTRY
)
prefix_cache_queries = Counter(
    "kvrail:prefix_cache_queries",
    "Prompt tokens looked up in the prefix cache.",
    _MODEL_NAME,
    registry=REGISTRY,
)
prefix_cache_hits = Counter(
    "kvrail:prefix_cache_hits",
    "Prompt tokens found in the prefix cache.",
    _MODEL_NAME,
    registry=REGISTRY,
)
# Speculative decoding (vLLM's `spec_decode_*`): the acceptance rate at draft position i is
# num_accepted_tokens_per_pos{position="i"} / num_drafts.
spec_decode_num_drafts = Counter(
    "kvrail:spec_decode_num_drafts",
    "Verification rounds with drafts.",
    _MODEL_NAME,
    registry=REGISTRY,
)
spec_decode_num_draft_tokens = Counter(
    "kvrail:spec_decode_num_draft_tokens", "Draft tokens verified.", _MODEL_NAME, registry=REGISTRY
)
spec_decode_num_accepted_tokens = Counter(
    "kvrail:spec_decode_num_accepted_tokens",
    "Draft tokens accepted.",
    _MODEL_NAME,
    registry=REGISTRY,
)
spec_decode_num_accepted_tokens_per_pos = Counter(
    "kvrail:spec_decode_num_accepted_tokens_per_pos",
    "Draft tokens accepted, by position in the draft (0-based).",
    (*_MODEL_NAME, "position"),
    registry=REGISTRY,
)
time_to_first_token_seconds = Histogram(
    "kvrail:time_to_first_token_seconds",
    "From the request's XADD to its first token chunk.",
    _MODEL_NAME,
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
inter_token_latency_seconds = Histogram(
    "kvrail:inter_token_latency_seconds",
    "Between successive tokens of a request.",
    _MODEL_NAME,
    buckets=_TOKEN_LATENCY_BUCKETS,
    registry=REGISTRY,
)
e2e_request_latency_seconds = Histogram(
    "kvrail:e2e_request_latency_seconds",
    "From the request's XADD to its final chunk.",
    _MODEL_NAME,
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
request_queue_time_seconds = Histogram(
    "kvrail:request_queue_time_seconds",
    "From the request's XADD until a worker took it from the stream.",
    _MODEL_NAME,
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)

# ---- HTTP (API) metrics ------------------------------------------------------------------------
# Updated by service.api's middleware: what the API's clients saw, streams included
# (timed until the last byte of the response).

http_requests = Counter(
    "kvrail:http_requests",
    "HTTP requests answered, by route template, method and status code.",
    ["route", "method", "status"],
    registry=REGISTRY,
)
http_request_duration_seconds = Histogram(
    "kvrail:http_request_duration_seconds",
    "From receiving an HTTP request to sending the last byte of its response.",
    ["route", "method"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
http_requests_in_progress = Gauge(
    "kvrail:http_requests_in_progress", "HTTP requests being answered now.", registry=REGISTRY
)
