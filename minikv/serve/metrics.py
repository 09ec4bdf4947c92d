"""`GET /metrics`: the server's state in Prometheus text format, named as vLLM names its own.

    minikv:kv_cache_usage_perc            gauge      fraction of KV blocks held by requests (0..1)
    minikv:num_requests_running           gauge      requests in the running batch
    minikv:num_requests_waiting           gauge      requests queued for a seat
    minikv:num_preemptions_total          counter    requests preempted to make room
    minikv:prefix_cache_queries_total     counter    prompt tokens looked up in the prefix cache
    minikv:prefix_cache_hits_total        counter    ... of which were found there
    minikv:prefix_cache_hit_rate          gauge      hits / queries since start
    minikv:time_to_first_token_seconds    histogram  arrival -> first token, per request
    minikv:inter_token_latency_seconds    histogram  gap between consecutive tokens of a request
    minikv:e2e_request_latency_seconds    histogram  arrival -> last token
    minikv:request_success_total          counter    finished requests, by finished_reason
    minikv:prompt_tokens_total            counter    by tenant
    minikv:generation_tokens_total        counter    by tenant
    minikv:tenant_service_tokens          gauge      the fair scheduler's counter of each tenant
    minikv:requests_rejected_total        counter    refused before running, by reason

Gauges are read from the engine when scraped; counters and histograms are fed by the engine loop.

Tenant labels are the server's tenant ids (minikv/serve/tenants.py: a keyed hash, never an API key),
and there are at most MAX_TENANT_LABELS of them: the first tenants seen keep their own label, every
later one counts under tenant="other". A label is cut to MAX_LABEL_CHARS. So /metrics stays small,
whoever sends what.
"""
from __future__ import annotations

import bisect
import threading
from collections import defaultdict

from minikv.engine.core import Usage
from minikv.engine.view import ViewSnapshot

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)  # vLLM's
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
MAX_TENANT_LABELS = 64
MAX_LABEL_CHARS = 64
OTHER = "other"
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(x: float) -> str:
    return repr(float(x)) if x != int(x) or abs(x) >= 1e15 else str(int(x))


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for le, c in zip([*map(str, self.buckets), "+Inf"], self.counts):
            running += c
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        out += [f"{name}_sum {_num(self.sum)}", f"{name}_count {self.count}"]
        return out


class ServerMetrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.finished: dict[str, int] = defaultdict(int)
        self.prompt_tokens: dict[str, int] = defaultdict(int)
        self.generation_tokens: dict[str, int] = defaultdict(int)
        self.rejected: dict[str, int] = defaultdict(int)
        self._labels: dict[str, str] = {}  # tenant -> its label (itself, cut; or OTHER once the labels are full)

    def label(self, tenant: str) -> str:
        """The tenant's label: its own for the first MAX_TENANT_LABELS tenants, then "other"."""
        got = self._labels.get(tenant)
        if got is None:
            own = len(set(self._labels.values()) - {OTHER}) < MAX_TENANT_LABELS
            got = tenant[:MAX_LABEL_CHARS] if own else OTHER
            if len(self._labels) < 16 * MAX_TENANT_LABELS:  # remember some; the rest are "other" anyway
                self._labels[tenant] = got
        return got

    # ---- fed by the engine loop and the handlers --------------------------------------------------
    def tokens_generated(self, tenant: str, n: int) -> None:
        with self._lock:
            self.generation_tokens[self.label(tenant)] += n

    def request_done(self, tenant: str, usage: Usage, reason: str) -> None:
        """A request ended (its usage: the core's last event of it)."""
        times = usage.token_times
        with self._lock:
            self.finished[reason] += 1
            self.prompt_tokens[self.label(tenant)] += usage.prompt_tokens
            if times:
                self.ttft.observe(times[0] - usage.arrival_time)
                self.e2e.observe(times[-1] - usage.arrival_time)
                for a, b in zip(times, times[1:]):
                    self.itl.observe(b - a)

    def rejected_request(self, reason: str) -> None:  # reason: one of the server's own words
        with self._lock:
            self.rejected[reason] += 1

    # ---- the scrape -------------------------------------------------------------------------------
    def render(self, view: ViewSnapshot) -> str:
        """The Prometheus text exposition (version 0.0.4) of everything above; `view`: the engine's
        numbers (EngineView.snapshot(), minikv/engine/view.py)."""
        queries, hits = view.prefix_queries, view.prefix_hits
        out: list[str] = []

        def metric(name: str, kind: str, doc: str, samples: list[tuple[str, float]] | float) -> None:
            out.append(f"# HELP {name} {doc}")
            out.append(f"# TYPE {name} {kind}")
            if not isinstance(samples, list):
                samples = [("", samples)]
            out.extend(f"{name}{labels} {_num(v)}" for labels, v in samples)

        metric("minikv:kv_cache_usage_perc", "gauge",
               "KV-cache usage: fraction of blocks held by requests or pinned (1 = full).",
               view.kv_usage)
        metric("minikv:num_requests_running", "gauge", "Requests in the running batch.", view.num_running)
        metric("minikv:num_requests_waiting", "gauge", "Requests waiting for a seat.",
               view.num_waiting + view.num_swapped)
        metric("minikv:num_preemptions_total", "counter", "Preemptions since start.", view.num_preemptions)
        metric("minikv:engine_steps_total", "counter", "Engine steps since start.", view.num_steps)
        metric("minikv:engine_step_seconds_total", "counter",
               "Seconds the engine spent inside its steps (over wall time: how busy it is; over steps: time per step).",
               view.step_seconds)
        metric("minikv:engine_wait_seconds_total", "counter",
               "Of those seconds, the ones the engine waited for the device (async scheduling: for the previous step's "
               "sampled ids). Steps minus waits is the host's own work: near the steps' total, the host sets the pace.",
               view.wait_seconds)
        metric("minikv:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.", queries)
        metric("minikv:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", hits)
        metric("minikv:prefix_cache_hit_rate", "gauge", "Prefix-cache hits / queries since start.",
               hits / queries if queries else 0.0)
        fair: dict[str, float] = defaultdict(float)
        with self._lock:
            for tenant, value in view.tenant_service.items():
                fair[self.label(str(tenant))] += value
            for name, doc, hist in (
                    ("minikv:time_to_first_token_seconds", "Time to first token.", self.ttft),
                    ("minikv:inter_token_latency_seconds", "Time between consecutive tokens.", self.itl),
                    ("minikv:e2e_request_latency_seconds", "Arrival to last token.", self.e2e)):
                out += [f"# HELP {name} {doc}", f"# TYPE {name} histogram", *hist.lines(name)]
            by = lambda key, d: [(f'{{{key}="{_label(k)}"}}', v) for k, v in sorted(d.items())]  # noqa: E731
            metric("minikv:request_success_total", "counter", "Finished requests by finished_reason.",
                   by("finished_reason", self.finished))
            metric("minikv:prompt_tokens_total", "counter", "Prompt tokens by tenant.",
                   by("tenant", self.prompt_tokens))
            metric("minikv:generation_tokens_total", "counter", "Generated tokens by tenant.",
                   by("tenant", self.generation_tokens))
            metric("minikv:requests_rejected_total", "counter", "Requests refused before running, by reason.",
                   by("reason", self.rejected))
        metric("minikv:tenant_service_tokens", "gauge", "Fair scheduler: weighted tokens served to each tenant.",
               by("tenant", dict(fair)))
        return "\n".join(out) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (for tests, the bench and the notebook)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values
