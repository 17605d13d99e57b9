"""``/metrics`` of the scale-out endpoint: every replica's ``kvserve:*`` series with
a ``replica`` label, and the router's own series with an ``ingress`` label (one set
per ingress replica, ``--ingress-replicas``; each ingress routes its own requests).

Router series (``RouterMetrics``):
- ``kvserve:router_decisions_total{policy, reason}``: one per routed request; reasons
  in ``kvserve.cluster.policy.REASONS``.
- ``kvserve:router_matched_prefix_fraction``: histogram of the fraction of the
  request's full blocks that the chosen replica probably held (prefix-aware only).
- ``kvserve:router_resubmitted_total``: requests sent again because their replica
  died before accepting them (nothing had been queued).
- ``kvserve:router_replicas``: replicas heard from (gauge).
- ``kvserve:router_chosen_total{replica}``: times the router ranked a replica first
  (Ray offers the request there unless its queue is full or it is dead).
- ``kvserve:router_excluded_replicas``: replicas heard from before that the metrics
  hub no longer lists (dead, hung), kept out of routing (gauge).
- ``kvserve:cluster_pool_replicas{role}``: live replicas per pool (prefill, decode),
  with prefill/decode pools only (gauge).

With pools, every replica's samples also carry ``role`` (:func:`label_replicas`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvserve.cluster.policy import Decision

FRACTION_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class RouterMetrics:
    """The router's series on their own registry (see the module docstring)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._decisions = Counter(
            "kvserve:router_decisions",
            "Routing decisions by policy and reason.",
            ["policy", "reason"],
            registry=self.registry,
        )
        self._fraction = Histogram(
            "kvserve:router_matched_prefix_fraction",
            "Fraction of a routed request's full blocks the chosen replica probably held.",
            buckets=FRACTION_BUCKETS,
            registry=self.registry,
        )
        self._resubmitted = Counter(
            "kvserve:router_resubmitted",
            "Requests sent again because their replica died before accepting them.",
            registry=self.registry,
        )
        self._replicas = Gauge(
            "kvserve:router_replicas", "Engine replicas heard from.", registry=self.registry
        )
        self._chosen = Counter(
            "kvserve:router_chosen",
            "Times the router ranked a replica first.",
            ["replica"],
            registry=self.registry,
        )
        self._chosen_seen: dict[str, int] = {}
        self._excluded = Gauge(
            "kvserve:router_excluded_replicas",
            "Replicas no longer listed by the metrics hub (dead, hung), kept out of routing.",
            registry=self.registry,
        )
        self._pools = Gauge(
            "kvserve:cluster_pool_replicas",
            "Live replicas per prefill/decode pool.",
            ["role"],
            registry=self.registry,
        )

    def set_pool_sizes(self, sizes: Mapping[str, int]) -> None:
        """Live replicas per role (roles not given keep their last value)."""
        for role, n in sizes.items():
            self._pools.labels(role).set(n)

    def observe(self, decision: Decision) -> None:
        self._decisions.labels(decision.policy, decision.reason).inc()
        if decision.policy == "prefix-aware":
            self._fraction.observe(decision.matched_fraction)

    def count_resubmitted(self) -> None:
        self._resubmitted.inc()

    def set_num_replicas(self, n: int) -> None:
        self._replicas.set(n)

    def sync_chosen(self, counts: Mapping[str, int]) -> None:
        """Bring ``router_chosen_total`` up to ``counts`` (the router's running totals)."""
        for replica, n in counts.items():
            delta = n - self._chosen_seen.get(replica, 0)
            if delta > 0:
                self._chosen.labels(replica).inc(delta)
                self._chosen_seen[replica] = n

    def set_num_excluded(self, n: int) -> None:
        self._excluded.set(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Families:
    """A collector yielding fixed metric families (to render merged ones)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)

    def describe(self) -> Iterator[Metric]:
        return iter(())


def label_replicas(texts: Mapping[str, str], roles: Mapping[str, str] | None = None) -> bytes:
    """Merge replicas' Prometheus texts into one, every sample labelled
    ``replica="<name>"`` (and ``role="<role>"`` for the replicas ``roles`` names;
    :func:`label_texts`)."""
    roles = roles or {}
    return label_texts(texts, "replica", {r: {"role": role} for r, role in roles.items()})


def label_texts(
    texts: Mapping[str, str],
    label: str,
    extra: Mapping[str, Mapping[str, str]] | None = None,
) -> bytes:
    """Merge Prometheus texts into one, every sample of ``texts[name]`` labelled
    ``<label>="<name>"`` plus ``extra[name]``'s labels; families of the same name are
    merged (the text format allows each name once). Raises ValueError (naming the
    source) when a text does not parse. Rule: no text may already carry ``label`` or
    an ``extra`` label (it would be overwritten)."""
    extra = extra or {}
    merged: dict[str, Metric] = {}
    for name, text in sorted(texts.items()):
        try:
            families = list(text_string_to_metric_families(text))
        except Exception as e:  # the parser raises bare ValueError/TypeError/KeyError
            raise ValueError(f"{label} {name}: /metrics text does not parse: {e}") from e
        for family in families:
            out = merged.get(family.name)
            if out is None:
                out = merged[family.name] = Metric(family.name, family.documentation, family.type)
            for s in family.samples:
                labels = {**s.labels, label: name, **extra.get(name, {})}
                out.samples.append(Sample(s.name, labels, s.value, s.timestamp, s.exemplar))
    registry = CollectorRegistry()
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)
