"""Prometheus metrics of the server, with vLLM's names (``vllm:*``, label ``model_name``).

Each app gets its own ``CollectorRegistry`` so several servers (tests) can live in one process.
Bucket bounds are vLLM V1's (``vllm/v1/metrics/loggers.py``).
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]


def engine_counters(engine) -> dict[str, int]:
    """Cumulative engine counters: ``num_preemptions`` (the scheduler's) and the prefix cache's queries
    and hits in tokens (the paged KV manager's ``prefix_queries`` / ``prefix_hits``).

    As vLLM's ``vllm:prefix_cache_*`` counters these cover first admissions only: re-admissions after a
    recompute preemption (the KV manager's ``preempted_queries`` / ``preempted_hits``) are kept apart so
    the hit rate describes the workload, and are not exported. An engine without a paged KV manager
    (the static baseline) reports 0.
    """
    sched = engine.scheduler
    kv = getattr(sched, "kv", None)
    spec = getattr(sched, "spec_stats", None)
    return {"num_preemptions": int(getattr(sched, "num_preemptions", 0) or 0),
            "prefix_cache_queries": int(getattr(kv, "prefix_queries", 0) or 0),
            "prefix_cache_hits": int(getattr(kv, "prefix_hits", 0) or 0),
            "spec_decode_num_drafts": int(getattr(spec, "num_drafts", 0)),
            "spec_decode_num_draft_tokens": int(getattr(spec, "num_draft_tokens", 0)),
            "spec_decode_num_accepted_tokens": int(getattr(spec, "num_accepted_tokens", 0))}


class ServerMetrics:
    """The server's metrics in a private registry; ``render()`` gives the Prometheus text format.

    Gauges (set by the engine loop whenever requests are queued, admitted, aborted or finished; see
    ``AsyncEngine``): ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
    ``vllm:kv_cache_usage_perc`` (a fraction in [0, 1], as vLLM). Counters: ``vllm:num_preemptions_total``,
    ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, ``vllm:prefix_cache_queries_total``,
    ``vllm:prefix_cache_hits_total`` (tokens, first admissions: see :func:`engine_counters`),
    ``vllm:spec_decode_num_drafts_total``, ``vllm:spec_decode_num_draft_tokens_total``,
    ``vllm:spec_decode_num_accepted_tokens_total`` (speculative decoding),
    ``vllm:request_success_total{finished_reason=stop|length|abort|error}``. Histograms (seconds):
    ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
    ``vllm:e2e_request_latency_seconds``.

    Units: ``request_success`` counts requests, one per prompt of an API call whatever its ``n`` (an
    aborted ``n: 2`` request adds 1 under ``abort``); the token counters and the latency histograms
    count each choice's sequence (an ``n: 2`` request adds its prompt tokens twice, as vLLM's engine
    requests of a parallel-sampling call do).
    """

    def __init__(self, model_name: str):
        prometheus_client.disable_created_metrics()  # vLLM exposes no *_created series either
        self.registry = r = CollectorRegistry()
        lab = ["model_name"]

        def gauge(name, doc):
            return Gauge(name, doc, lab, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, lab, registry=r).labels(model_name)

        def hist(name, doc, buckets):
            return Histogram(name, doc, lab, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage_perc = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")
        # speculative decoding (vLLM V1's names; zero without it)
        self.spec_decode_num_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_decode_num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_decode_num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens",
                                                       "Number of accepted tokens.")
        # one per prompt of an API call, whatever its n (see the class docstring)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                lab + ["finished_reason"], registry=r)
        self._model_name = model_name
        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        E2E_BUCKETS)
        self._last_counters = {"num_preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0}

    def request_finished(self, finished_reason: str) -> None:
        self._success.labels(self._model_name, finished_reason).inc()

    def set_gauges(self, num_running: int, num_waiting: int, kv_usage: float | None = None) -> None:
        """Set the running/waiting gauges (clamped at 0) and, when given, the KV usage fraction."""
        self.num_requests_running.set(max(0, num_running))
        self.num_requests_waiting.set(max(0, num_waiting))
        if kv_usage is not None:
            self.kv_cache_usage_perc.set(min(1.0, max(0.0, kv_usage)))

    def update_counters(self, engine) -> None:
        """Add the growth of the engine's cumulative counters since the last call."""
        now = engine_counters(engine)
        for name, value in now.items():
            delta = value - self._last_counters.get(name, 0)
            if delta > 0:
                getattr(self, name).inc(delta)
        self._last_counters = now

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return prometheus_client.generate_latest(self.registry)


def parse_metrics(text: str) -> dict[str, float]:
    """Flatten Prometheus text into ``{sample name: value}`` summed over label sets (``vllm:*`` only).

    Histograms appear as their ``_sum``/``_count`` (buckets dropped), counters under their ``_total`` name.
    """
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.startswith("vllm:") or s.name.endswith("_bucket") or s.name.endswith("_created"):
                continue
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out
