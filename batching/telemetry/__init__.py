"""Telemetry: what the batching loop measures and what /stats, /metrics, /stats/timeline, /health and the
dashboard read, beside the loop rather than in it. The loop (batching/manager.py) makes one call per step and
one per answer into the observer; everything else here is written by the observer or read by a report.

  observer.py      the loop's one entry: fans each step and each answer out to the readers below
  events.py        each request's phase changes (arrived ... finished), a bounded ring
  heartbeat.py     whether the loop still makes progress (/health)
  live.py          the live table, the server's live values in one home: its rows (LIVE_VALUES), the
                   histograms and the window; the engine's figures come from one snapshot of its counters
                   (generate/engine_counters.py), never from its parts
    live_value.py    one row: /stats key, Prometheus name, vLLM's names
    tenant_stats.py  the per-tenant rows, and the view that cuts them to one tenant's
    stats.py         since-start counts and latency percentiles
    histograms.py    request latencies and lengths as Prometheus buckets
    window.py        latency and throughput over the last few seconds
  step_summary.py  what the kept step records say about the loop (step and stage times)
  reports.py       the bodies, computed where the engine is (in this process, or the engine's own):
    server_stats.py  /stats
    metrics.py       /metrics (the project's gpt2_* names and vLLM's)
    timeline.py      /stats/timeline (the dashboard's data)

Layering: this package imports generate/ and the batching modules below the loop (inference.py, admission.py),
never the manager at run time (reports take it as an argument, typed under TYPE_CHECKING).
"""
