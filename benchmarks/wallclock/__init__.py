"""The wall-clock comparison: ``tokenlake serve`` with N pooled instances against N
single-instance servers behind the real SGLang router, real processes, a real streaming client.

JSON lines printed by the bench (and written with ``--json-out FILE``), one object a line:

- ``kind: "point"``, one per (system, model, workload, seed, rate): ``bench``
  ("wallclock-router"), ``kind``, ``system`` ("tokenlake" | "router"), ``model``, ``workload``,
  ``seed``, ``num_instances``, ``rate`` (req/s offered), ``num_requests``, ``attainment``
  (fraction 0..1 of requests meeting the SLO), ``ttft_p90_s``, ``tpot_p90_s``, ``hit_rate``
  (prompt tokens served from a cache over prompt tokens, from the servers' /metrics; the
  router's is the sum over its servers), ``load_cv`` (coefficient of variation of the prefix
  tokens read per instance), ``slo`` ({"ttft_s": .., "tpot_s": ..}: the thresholds).
- ``kind: "goodput"``, one per (system, model, workload, seed): the same identifying keys plus
  ``p90_goodput`` (req/s: the highest rate found with attainment >= 0.9) and
  ``slo_missed_in_sweep`` (bool: some rate missed, so the goodput is where the system failed,
  not a cap of the sweep).

Diagnostics ride along: point lines also carry ``finished``, ``errors``, ``ttft_mean_s``,
``max_gap_p90_s`` and the attainment of each half of the SLO alone (``attainment_ttft_only``,
``attainment_gap_only``); goodput lines carry ``points`` ([rate, attainment] as run), ``slo``
and ``load_avg``.
"""
