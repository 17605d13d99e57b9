"""A load ramp against an autoscaled endpoint (``kvserve serve --min-replicas 1
--max-replicas 2``): a burst scales it 1 -> 2, a light load scales it back 2 -> 1.

    phase "burst":   ``burst_clients`` clients, each sending streamed completions of
                     ``burst_tokens`` tokens back to back, until the new replica has
                     served a request (or ``burst_timeout_s``)
    phase "trickle": ``trickle_clients`` clients (fewer ongoing requests than the
                     target keeps on one replica) with ``trickle_tokens`` tokens each,
                     until Serve removed a replica and it is gone, plus ``after_s``
                     seconds of requests to check nothing is routed to it any more

Every request is checked whole: HTTP 200, no error event, ``[DONE]``, and
``usage.completion_tokens == max_tokens`` (``ignore_eos``), so a stream cut by a
scale-down counts as failed. Meanwhile ``/cluster/replicas`` and ``/metrics`` are
polled every ``poll_s`` seconds: the replicas listed (the metrics hub), the
replicas the router holds state for (``router``), each replica's
``num_requests_running`` and ``request_success_total``.

Clocks: times are seconds after the burst began, on this machine's wall clock
(the replicas' ``started_at`` is compared with it, so run on the cluster's machine
for that figure). "First served" is seen through the replicas' metrics pushes
(every 0.5 s) and the poll, so it is late by up to ``0.5 + poll_s`` seconds.
Only ``httpx`` and ``prometheus_client``; no Ray in this process.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Outcome:
    phase: str
    sent_s: float
    ended_s: float
    ok: bool
    error: str = ""


@dataclass
class RampResult:
    """What :func:`run_ramp` saw (times in seconds after the burst began)."""

    first_replica: str
    outcomes: list[Outcome] = field(default_factory=list)
    new_replica: str | None = None
    new_meta: dict[str, Any] = field(default_factory=dict)  # its /cluster/replicas entry
    first_meta: dict[str, Any] = field(default_factory=dict)
    new_listed_s: float | None = None  # the new replica in /cluster/replicas
    new_served_s: float | None = None  # its first finished request seen
    burst_ended_s: float | None = None
    removed_replica: str | None = None
    left_router_s: float | None = None  # the router dropped it (Serve stopped routing)
    gone_s: float | None = None  # out of /cluster/replicas (its actor stopped)
    # its num_requests_running while listed but out of the router: > 0 = it was
    # finishing requests Serve no longer sent it (the drain)
    drained_running: float = 0.0
    # requests it finished after it left the router (its request_success_total)
    drained_finished: float = 0.0
    router_after: list[str] = field(default_factory=list)
    chosen_after_removal: float = 0.0  # times the router ranked it first since it left
    num_listed_max: int = 0

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    burst_began_at: float = 0.0  # wall clock (time.time())

    @property
    def new_started_s(self) -> float | None:
        """When the new replica's constructor began (after the upscale decision and
        the actor process start)."""
        at = self.new_meta.get("started_at")
        return None if at is None else float(at) - self.burst_began_at

    def summary(self) -> dict[str, Any]:
        phases = sorted({o.phase for o in self.outcomes})
        return {
            "requests": {p: sum(o.phase == p for o in self.outcomes) for p in phases},
            "failed": len(self.failures),
            "failures": [f"{o.phase} at {o.sent_s:.1f} s: {o.error}" for o in self.failures][:5],
            "new_replica": self.new_replica,
            "new_replica_constructor_began_s": _r(self.new_started_s),
            "new_replica_constructor_s": self.new_meta.get("startup_s"),
            "new_replica_listed_s": _r(self.new_listed_s),
            "new_replica_first_served_s": _r(self.new_served_s),
            "first_replica_step_fit": self.first_meta.get("step_fit"),
            "new_replica_step_fit": self.new_meta.get("step_fit"),
            "burst_ended_s": _r(self.burst_ended_s),
            "removed_replica": self.removed_replica,
            "removed_left_router_s": _r(self.left_router_s),
            "removed_gone_s": _r(self.gone_s),
            "removed_running_while_draining": self.drained_running,
            "removed_finished_while_draining": self.drained_finished,
            "router_after": self.router_after,
            "chosen_after_removal": self.chosen_after_removal,
        }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _series(text: str, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                key = s.labels.get("replica", "")
                out[key] = out.get(key, 0.0) + s.value
    return out


class _Poll:
    def __init__(self, client: httpx.Client, base: str) -> None:
        self.client, self.base = client, base

    def replicas(self) -> tuple[dict[str, dict[str, Any]], set[str]]:
        body = self.client.get(self.base + "/cluster/replicas", timeout=30).json()
        listed = {r["replica"]: r for r in body["replicas"]}
        return listed, set(body.get("router", []))

    def metrics(self) -> str:
        return self.client.get(self.base + "/metrics", timeout=30).text


def _stream_once(client: httpx.Client, base: str, prompt: str, max_tokens: int) -> str:
    """The empty string when the request streamed whole, else what went wrong."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        with client.stream("POST", base + "/v1/completions", json=body, timeout=120) as resp:
            if resp.status_code != 200:
                return f"HTTP {resp.status_code}: {resp.read()[:200]!r}"
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    if not events or events[-1] != "[DONE]":
        return f"no [DONE] (last: {events[-1:]!r})"
    chunks = [json.loads(e) for e in events[:-1]]
    errors = [c["error"] for c in chunks if "error" in c]
    if errors:
        return f"error event: {errors[0]}"
    usage = next((c["usage"] for c in reversed(chunks) if c.get("usage")), None)
    if usage is None or usage.get("completion_tokens") != max_tokens:
        return f"cut short: usage {usage}"
    return ""


def _clients(
    base: str,
    phase: str,
    num_clients: int,
    max_tokens: int,
    max_per_client: int,
    stop: threading.Event,
    t0: float,
    out: list[Outcome],
) -> ThreadPoolExecutor:
    lock = threading.Lock()

    def client(k: int) -> None:
        with httpx.Client() as http:
            for i in range(max_per_client):
                if stop.is_set():
                    return
                sent = time.monotonic() - t0
                err = _stream_once(http, base, f"{phase} {k}.{i}: count on", max_tokens)
                with lock:
                    out.append(Outcome(phase, sent, time.monotonic() - t0, not err, err))

    pool = ThreadPoolExecutor(num_clients, thread_name_prefix=f"ramp-{phase}")
    for k in range(num_clients):
        pool.submit(client, k)
    return pool


def run_ramp(
    base: str,
    *,
    burst_clients: int = 4,
    burst_tokens: int = 16,
    trickle_clients: int = 2,
    trickle_tokens: int = 48,
    burst_timeout_s: float = 120.0,
    trickle_timeout_s: float = 120.0,
    after_s: float = 2.0,
    max_per_client: int = 400,
    poll_s: float = 0.2,
    log: Callable[[str], None] = print,
) -> RampResult:
    """Run the ramp against ``base`` (module docstring). Caller rules: the endpoint
    serves one replica now (the min), autoscales to at most 2, and its target keeps
    ``trickle_clients`` ongoing requests on one replica but not ``burst_clients``.
    Every load loop is bounded by ``max_per_client`` requests and its timeout."""
    with httpx.Client() as http:
        poll = _Poll(http, base)
        deadline = time.monotonic() + 120
        while True:
            listed, _ = poll.replicas()
            if len(listed) == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if len(listed) != 1:
            raise RuntimeError(f"the ramp starts at one replica; {sorted(listed)} are listed")
        (first,) = listed
        result = RampResult(first_replica=first, first_meta=dict(listed[first]))
        outcomes: list[Outcome] = result.outcomes
        t0 = time.monotonic()
        result.burst_began_at = time.time()

        # ---- burst: 1 -> 2
        stop = threading.Event()
        pool = _clients(
            base, "burst", burst_clients, burst_tokens, max_per_client, stop, t0, outcomes
        )
        try:
            while time.monotonic() - t0 < burst_timeout_s:
                listed, _ = poll.replicas()
                result.num_listed_max = max(result.num_listed_max, len(listed))
                new = [r for r in listed if r != first]
                if new and result.new_replica is None:
                    result.new_replica = new[0]
                    result.new_listed_s = time.monotonic() - t0
                    log(f"ramp: new replica {new[0]} listed at {result.new_listed_s:.1f} s")
                if result.new_replica is not None:
                    result.new_meta = dict(listed.get(result.new_replica, result.new_meta))
                    done = _series(poll.metrics(), "kvserve:request_success_total")
                    if done.get(result.new_replica, 0.0) > 0:
                        result.new_served_s = time.monotonic() - t0
                        log(f"ramp: new replica served at {result.new_served_s:.1f} s")
                        break
                time.sleep(poll_s)
        finally:
            stop.set()
            pool.shutdown(wait=True)
        result.burst_ended_s = time.monotonic() - t0
        if result.new_served_s is None:
            log("ramp: no second replica served within the burst")
            return result

        # ---- trickle: 2 -> 1, drained
        stop = threading.Event()
        pool = _clients(
            base, "trickle", trickle_clients, trickle_tokens, max_per_client, stop, t0, outcomes
        )
        chosen_at_left = done_at_left = 0.0
        try:
            end = time.monotonic() + trickle_timeout_s
            gone_at: float | None = None
            while time.monotonic() < end:
                listed, router = poll.replicas()
                text = poll.metrics()
                victim = result.removed_replica
                if victim is None and len(router) == 1 and len(listed) == 2:
                    # listed (alive) but out of the router: Serve is stopping it
                    (victim,) = [r for r in listed if r not in router]
                if victim is None and len(listed) == 1 and result.new_replica is not None:
                    victim = ({first, result.new_replica} - set(listed)).pop()
                if victim is not None and result.removed_replica is None:
                    result.removed_replica = victim
                    result.left_router_s = time.monotonic() - t0
                    chosen_at_left = _series(text, "kvserve:router_chosen_total").get(victim, 0.0)
                    done_at_left = _series(text, "kvserve:request_success_total").get(victim, 0.0)
                    log(f"ramp: {victim} left the router at {result.left_router_s:.1f} s")
                if victim is not None and victim in listed:
                    running = _series(text, "kvserve:num_requests_running").get(victim, 0.0)
                    result.drained_running = max(result.drained_running, running)
                    finished = _series(text, "kvserve:request_success_total").get(victim, 0.0)
                    result.drained_finished = max(result.drained_finished, finished - done_at_left)
                if victim is not None and victim not in listed and gone_at is None:
                    gone_at = time.monotonic()
                    result.gone_s = gone_at - t0
                    log(f"ramp: {victim} gone at {result.gone_s:.1f} s")
                if gone_at is not None and time.monotonic() - gone_at >= after_s:
                    result.router_after = sorted(router)
                    chosen = _series(text, "kvserve:router_chosen_total").get(victim or "", 0.0)
                    result.chosen_after_removal = chosen - chosen_at_left
                    break
                time.sleep(poll_s)
        finally:
            stop.set()
            pool.shutdown(wait=True)
        return result
