"""The demo view's snapshot, read from the running sidecar after a tick (typed, immutable)."""

from __future__ import annotations

import time
from collections.abc import Iterable

from kvpilot.agent.alert_values import AlertView
from kvpilot.agent.cli.demo.view import ActionRow, AlertRow, DemoSnapshot, ServerRow, TrialRow
from kvpilot.agent.state.trials import SqliteTrialStore
from kvpilot.agent.tick.sidecar import Sidecar
from kvpilot.collectors.kvpool.client import KvPoolScrape
from kvpilot.collectors.vllm_metrics import VllmScrape
from kvpilot.tuner.trials import Trial

FRAG_RULE = "fragmentation_kv_blocks"
SHOWN_ALERT_STATES = ("pending", "firing", "resolved")


def frag_state(
    alerts: Iterable[AlertView], instance: str, ratio: float | None, why: str | None = None
) -> tuple[str, str | None]:
    """ok, pending or firing as the kv_blocks rule's alert says; unknown, with the reason,
    while the ratio cannot be computed (`why`: the plugin's; else the rule's)."""
    alert = next(
        (a for a in alerts if a.rule == FRAG_RULE and dict(a.labels).get("instance") == instance),
        None,
    )
    state = alert.state if alert is not None else None
    if ratio is None or (alert is not None and alert.active is None):
        reason = why or (alert.reason if alert is not None else None) or "no free-list figures"
        if state in ("pending", "firing"):
            reason += f" (alert {state})"
        return "unknown", reason
    if state in ("pending", "firing"):
        return state, None
    return "ok", None


def server_rows(sidecar: Sidecar, alerts: list[AlertView]) -> tuple[ServerRow, ...]:
    threshold = sidecar.settings.rules.fragmentation.kv_blocks.threshold_ratio
    rows = []
    for view in sidecar.watched.servers():
        latest = view.state.latest
        vllm = latest.vllm if latest is not None else None
        pool = latest.kvpool if latest is not None else None
        engine = vllm.engines[0] if isinstance(vllm, VllmScrape) and vllm.engines else None
        sample = pool.engines[0] if isinstance(pool, KvPoolScrape) and pool.engines else None
        frag = sample.fragmentation if sample is not None else None
        ratio = frag.ratio if frag is not None else None
        state, reason = frag_state(alerts, view.server, ratio, frag.reason if frag else None)
        try:
            up = sidecar.runtime.status(view.server).state
        except Exception:  # a runtime that cannot say is shown as such, never fatal
            up = "unknown"
        rows.append(
            ServerRow(
                name=view.server,
                role=view.role,
                up=up,
                kv_usage_ratio=engine.kv_usage_ratio if engine else None,
                blocks_total=(sample.blocks_total if sample else None)
                or (engine.blocks_total if engine else None),
                blocks_free=(sample.blocks_free if sample else None)
                if sample
                else (engine.blocks_free if engine else None),
                preemptions_total=engine.preemptions_total if engine else None,
                frag_ratio=ratio,
                frag_threshold=threshold,
                frag_state=state,
                frag_reason=reason,
            )
        )
    return tuple(rows)


def alert_rows(alerts: list[AlertView]) -> tuple[AlertRow, ...]:
    return tuple(
        AlertRow(
            alertname=dict(a.labels).get("alertname", a.rule),
            instance=dict(a.labels).get("instance", "-"),
            state=a.state,
            since_wall_s=a.active_since_wall_s,
        )
        for a in alerts
        if a.state in SHOWN_ALERT_STATES
    )


_SHORT = {"kv_cache_memory_bytes": "kv", "max_num_seqs": "seqs"}


def _knob(name: str, value: object) -> str:
    if name == "kv_cache_memory_bytes" and isinstance(value, int):
        return f"kv {value / 2**20:.1f} MiB"
    return f"{_SHORT.get(name, name)} {value}"


def verdict_of(trial: Trial) -> str | None:
    """The judge's verdict; for a trial that did not complete, why not first (the canary's
    comparison may have passed while the trial itself was refused, e.g. over the SLO)."""
    judged = None
    if trial.judgement is not None:
        judged = f"{trial.judgement.classification.value}: {trial.judgement.reason}"
    if trial.state.value != "complete" and trial.reason:
        return trial.reason if judged is None else f"{trial.reason} (judge: {judged})"
    return judged or trial.reason


def trial_rows(trials: Iterable[Trial]) -> tuple[TrialRow, ...]:
    return tuple(
        TrialRow(
            number=t.number,
            candidate=", ".join(_knob(k, v) for k, v in t.values),
            state=t.state.value,
            verdict=verdict_of(t),
        )
        for t in sorted(trials, key=lambda t: t.number)
    )


def snapshot_of(
    sidecar: Sidecar,
    *,
    title: str,
    phase: str,
    deliveries: tuple[str, ...],
    logs: tuple[str, ...],
) -> DemoSnapshot:
    alerts = sidecar.alerts.alerts()
    store = sidecar.store
    actions = tuple(
        ActionRow(r.wall_s, r.action, r.target, str(r.decision), r.reason)
        for r in store.audit_records(limit=8)
    )
    return DemoSnapshot(
        title=title,
        phase=phase,
        wall_s=time.time(),
        servers=server_rows(sidecar, alerts),
        alerts=alert_rows(alerts),
        actions=actions,
        trials=trial_rows(SqliteTrialStore(store.db).trials()),
        outbox_backlog=store.outbox.backlog(),
        deliveries=deliveries,
        logs=logs,
    )
