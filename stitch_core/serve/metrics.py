"""Optional Prometheus metrics of a serving engine's policy version.

* ``stitch_version{run}``            gauge: the version serving;
* ``stitch_lag_versions{run}``       gauge: latest published minus serving;
* ``stitch_apply_seconds{run}``      histogram: duration of each committed apply;
* ``stitch_patch_bytes_total{run}``  counter: bytes of patches applied;
* ``stitch_not_ready_total{run}``    counter: requests refused with HTTP 409;
* ``stitch_follower_health{run}``    gauge: the follower's health, 0 ok, 1 degraded, 2 dead;
* ``stitch_serving{run}``            gauge: 1 while a proven version is served, else 0;
* ``stitch_nats_connected{run}``     gauge: 1 / 0 (absent without NATS).

Without ``prometheus_client`` every method is a no-op. Collectors already registered under these
names in the registry are reused, so several `Metrics` on one registry are fine (tests can also pass
a fresh ``CollectorRegistry`` each).

The default registry is ``prometheus_client.REGISTRY``, which vLLM's ``/metrics`` serves. In
vLLM's multi-process mode (``PROMETHEUS_MULTIPROC_DIR`` set) keep that default: values then go to
the shared directory and vLLM's exposition registry collects them from there.
"""

from __future__ import annotations

import logging
from typing import Any

try:
    import prometheus_client as _prom
except ImportError:  # the main venv has no prometheus_client: every method is a no-op
    _prom = None

log = logging.getLogger("stitch.metrics")

AVAILABLE = _prom is not None
LABELS = ("run",)
HEALTH_CODES = {"ok": 0, "degraded": 1, "dead": 2}
APPLY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def default_registry() -> Any:
    """``prometheus_client.REGISTRY``, or None without prometheus_client."""
    return _prom.REGISTRY if _prom is not None else None


def _collector(registry: Any, cls: Any, name: str, doc: str, **kw: Any) -> Any:
    """The collector registered under `name` in `registry`, created if absent."""

    def existing() -> Any:
        found = getattr(registry, "_names_to_collectors", {}).get(name)
        if found is None:
            return None
        if not isinstance(found, cls) or tuple(getattr(found, "_labelnames", ())) != LABELS:
            raise ValueError(f"metric {name} is already registered with another type or labels")
        return found

    found = existing()
    if found is not None:
        return found
    try:
        return cls(name, doc, labelnames=LABELS, registry=registry, **kw)
    except ValueError:  # registered concurrently (duplicated timeseries)
        found = existing()
        if found is None:
            raise
        return found


class Metrics:
    """Prometheus metrics of one run's serving version (no-op without prometheus_client).

    `registry`: a ``prometheus_client.CollectorRegistry`` (default: ``default_registry()``).
    `run` labels every sample; a `VersionGate` fills it in with its run when left None.
    `enabled=False` (or no prometheus_client) makes every method a no-op.
    """

    def __init__(self, registry: Any = None, *, run: str | None = None, enabled: bool = True):
        self.run = run
        self.enabled = enabled and _prom is not None
        self.registry = None
        if not self.enabled:
            return
        registry = registry if registry is not None else default_registry()
        self.registry = registry
        self._version = _collector(registry, _prom.Gauge, "stitch_version",
                                   "Policy version this engine serves",
                                   multiprocess_mode="mostrecent")
        self._lag = _collector(registry, _prom.Gauge, "stitch_lag_versions",
                               "Latest published policy version minus the one serving",
                               multiprocess_mode="mostrecent")
        self._apply = _collector(registry, _prom.Histogram, "stitch_apply_seconds",
                                 "Seconds each committed version apply took",
                                 buckets=APPLY_BUCKETS)
        self._patch_bytes = _collector(registry, _prom.Counter, "stitch_patch_bytes_total",
                                       "Bytes of weight patches applied")
        self._not_ready = _collector(registry, _prom.Counter, "stitch_not_ready_total",
                                     "Requests refused with HTTP 409 (version not servable)")
        self._health = _collector(registry, _prom.Gauge, "stitch_follower_health",
                                  "Follower health: 0 ok, 1 degraded, 2 dead",
                                  multiprocess_mode="mostrecent")
        self._serving = _collector(registry, _prom.Gauge, "stitch_serving",
                                   "1 while the engine serves a proven version, else 0",
                                   multiprocess_mode="mostrecent")
        self._nats = _collector(registry, _prom.Gauge, "stitch_nats_connected",
                                "1 while the follower's NATS subscription is up, else 0",
                                multiprocess_mode="mostrecent")

    @property
    def _run(self) -> str:
        return self.run or ""

    def set_version(self, version: int | None, latest: int | None) -> None:
        if not self.enabled or version is None:
            return
        self._version.labels(self._run).set(version)
        lag = max(0, latest - version) if latest is not None else 0
        self._lag.labels(self._run).set(lag)

    def applied(self, version: int, seconds: float, patch_bytes: int | None = 0) -> None:
        if not self.enabled:
            return
        self._version.labels(self._run).set(version)
        self._apply.labels(self._run).observe(max(0.0, seconds))
        if patch_bytes:
            self._patch_bytes.labels(self._run).inc(patch_bytes)

    def set_health(self, health: str, serving: bool, nats_connected: bool | None) -> None:
        """The follower's health (ok / degraded / dead), whether a proven version is served,
        and NATS (None: not configured, left unset)."""
        if not self.enabled:
            return
        self._health.labels(self._run).set(HEALTH_CODES.get(health, 2))
        self._serving.labels(self._run).set(1 if serving else 0)
        if nats_connected is not None:
            self._nats.labels(self._run).set(1 if nats_connected else 0)

    def not_ready(self) -> None:
        if not self.enabled:
            return
        self._not_ready.labels(self._run).inc()
