"""The tuner's families, and the Tuning panels over recorded runs backfilled into Prometheus.

Three histories, each under its own instance:
* `tests/fixtures/tuning_live/`: a real `kvpilot tune` session on the CPU vLLM, with the
  judge's verdicts on real canary and baseline samples (see its README);
* `tests/fixtures/tuning/`: trials replayed from the measured grid (see its README), which
  has no canary judgements;
* the replay's best trial with a judgement made from hand-written samples.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from dashboard_queries import annotation_queries, fill, panel_queries, variable_queries
from prometheus_server import PROMTOOL, PrometheusServer

from kvpilot.dashboards.build import build_dashboards
from kvpilot.dashboards.tuning import UID
from kvpilot.dashboards.tuning_metrics import (
    BEST_GOODPUT,
    CANARY_METRIC,
    LIVE_FLAGS_INFO,
    SPECS,
    TRIAL_GOODPUT,
    TRIAL_INFO,
    TRIAL_PREEMPTION_RATE,
    TRIALS_TOTAL,
    UNJUDGED,
    FlagSource,
    LiveFlags,
    exposition_text,
    flags_text,
    openmetrics_history,
    tuning_families,
)
from kvpilot.tuner.judge.evidence import Counts
from kvpilot.tuner.judge.judgement import DEFAULT_METRICS, judge
from kvpilot.tuner.trials import Trial, TrialState, trial_from_dict, trial_to_dict

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "tuning"
LIVE_FIXTURE = ROOT / "tests" / "fixtures" / "tuning_live"
RECORDED = "recorded:9400"
JUDGED = "judged:9400"
LIVE = "live:9400"
CANARY_PANEL = "Canary against baseline: "  # dashboards/tuning.py, one panel per metric
HOUR_S = 3600.0


def _rows() -> list[dict]:
    return [json.loads(line) for line in (FIXTURE / "trials.jsonl").read_text().splitlines()]


def _trials() -> list[Trial]:
    return [trial_from_dict(row) for row in _rows()]


def _live(fixture: Path = FIXTURE) -> LiveFlags:
    data = json.loads((fixture / "live_flags.json").read_text())
    return LiveFlags(data["server"], data["flags"], FlagSource(data["source"]))


def _live_run() -> list[Trial]:
    lines = (LIVE_FIXTURE / "trials.jsonl").read_text().splitlines()
    return [trial_from_dict(json.loads(line)) for line in lines]


def _script() -> ModuleType:
    path = ROOT / "scripts" / "record_tuning_fixture.py"
    spec = importlib.util.spec_from_file_location("record_tuning_fixture", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _judged(best: Trial) -> Trial:
    """The best trial again, judged by the judge on hand-written canary and baseline samples."""
    base = {
        "ttft_s": [0.80, 0.82, 0.79, 0.85, 0.81, 0.83, 0.80],
        "inter_token_s": [0.0130, 0.0128, 0.0131, 0.0127, 0.0129, 0.0132],
        "e2e_s": [2.10, 2.05, 2.20, 2.15, 2.08, 2.12],
        "preemptions_per_request": Counts(0.0, 600.0),
        "goodput_tokens_per_s": [300.0, 305.0, 298.0, 302.0, 301.0, 299.0],
        "kv_usage_ratio": [0.40, 0.42, 0.41, 0.39, 0.43, 0.40],
        "errors_ratio": [0.0] * 600,  # enough requests to show no more failures (550 a side)
    }
    canary = {
        "ttft_s": [0.78, 0.80, 0.79, 0.81, 0.77, 0.80, 0.82],
        "inter_token_s": [0.0126, 0.0129, 0.0127, 0.0128, 0.0130, 0.0126],
        "e2e_s": [2.00, 2.07, 2.02, 2.11, 2.04, 2.06],
        "preemptions_per_request": Counts(0.0, 600.0),
        "goodput_tokens_per_s": [303.0, 300.0, 304.0, 299.0, 302.0, 301.0],
        "kv_usage_ratio": [0.41, 0.43, 0.40, 0.42, 0.40, 0.41],
        "errors_ratio": [0.0] * 600,  # enough requests to show no more failures (550 a side)
    }
    judgement = judge(canary, base)
    return dataclasses.replace(best, trial_id="judged-001", judgement=judgement)


def _best(trials: list[Trial]) -> Trial:
    complete = [t for t in trials if t.state is TrialState.COMPLETE and t.result]
    return max(complete, key=lambda t: t.result.goodput_tokens_per_s or 0.0)  # type: ignore[union-attr]


def _by_name(families: tuple) -> dict[str, list]:
    return {f.spec.name: list(f.samples) for f in families}


# --- the fixture and the families (fast) -----------------------------------------------


def test_fixture_is_what_the_script_replays_from_the_measured_grid() -> None:
    rows = _rows()
    assert [trial_to_dict(trial_from_dict(row)) for row in rows] == rows
    script = _script()
    replayed = script.replay(
        script.TABLE, trials=len(rows), seed=0, start_wall_s=rows[0]["created_wall_s"]
    )
    assert [json.loads(json.dumps(trial_to_dict(t))) for t in replayed] == rows
    table = script.read_rows(script.TABLE)
    for trial in _trials():
        values = dict(trial.values)
        row = table[(values["kv_cache_memory_bytes"], values["max_num_seqs"])]
        assert trial.result is not None
        assert trial.result.goodput_tokens_per_s == float(row["goodput_tokens_per_s"])
        assert (trial.state is TrialState.COMPLETE) == (row["feasible"] == "1")
        assert trial.judgement is None  # the grid has no canary samples


def test_the_live_fixture_is_a_judged_kvpilot_tune_session() -> None:
    trials = _live_run()
    assert [t.number for t in trials] == list(range(1, len(trials) + 1)) and len(trials) >= 4
    assert len({t.fingerprint for t in trials}) == 1
    assert all(t.state in (TrialState.COMPLETE, TrialState.INFEASIBLE) for t in trials)
    judged = [t for t in trials if t.judgement is not None]
    assert judged, "a session whose canaries were never judged"
    for trial in judged:
        assert trial.result is not None and trial.result.metrics is not None
        assert trial.result.metrics.source == "client"  # the load generator's own timings
        counts = {v.canary_count for v in trial.judgement.metrics if v.canary_count}
        assert counts and min(counts) >= 5  # samples, not a made-up summary


def test_from_db_reads_the_trials_a_state_database_holds(tmp_path: Path) -> None:
    from kvpilot.agent.state.db import DB_FILENAME, Database
    from kvpilot.agent.state.trials import SqliteTrialStore

    db = Database.open(tmp_path / "state")
    store = SqliteTrialStore(db)
    for trial in _trials():
        store.add(trial)
    db.close()
    script = _script()
    out = tmp_path / "fixture"
    database = str(tmp_path / "state" / DB_FILENAME)
    assert script.main(["--from-db", database, "--out", str(out)]) == 0
    assert (out / "trials.jsonl").read_text() == (FIXTURE / "trials.jsonl").read_text()
    assert script.main(["--from-db", str(tmp_path / "missing.db"), "--out", str(out)]) == 2


def test_families_follow_the_trials() -> None:
    trials = _trials()
    families = _by_name(tuning_families(trials, [_live()]))
    assert {spec.name for spec in SPECS} == set(families)
    goodput = {dict(s.labels)["trial"]: s.value for s in families[TRIAL_GOODPUT]}
    assert goodput == {t.trial_id: t.result.goodput_tokens_per_s for t in trials if t.result}
    assert {dict(s.labels)["verdict"] for s in families[TRIAL_GOODPUT]} == {UNJUDGED}
    totals = {dict(s.labels)["state"]: s.value for s in families[TRIALS_TOTAL]}
    assert totals["complete"] == sum(t.state is TrialState.COMPLETE for t in trials)
    assert sum(totals.values()) == len(trials)
    (best,) = families[BEST_GOODPUT]
    assert best.value == _best(trials).result.goodput_tokens_per_s  # type: ignore[union-attr]
    info = {dict(s.labels)["trial"]: dict(s.labels) for s in families[TRIAL_INFO]}
    first = trials[0]
    assert info[first.trial_id]["flags"] == flags_text(first.values)
    assert info[first.trial_id]["reason"] == first.reason
    rates = {dict(s.labels)["trial"]: s.value for s in families[TRIAL_PREEMPTION_RATE]}
    metrics = first.result.metrics  # type: ignore[union-attr]
    assert rates[first.trial_id] == metrics.preemptions_total / metrics.duration_s
    assert families[CANARY_METRIC] == []
    assert all(s.timestamp_s is None for samples in families.values() for s in samples)


def test_canary_medians_come_from_the_judgement() -> None:
    judged = _judged(_best(_trials()))
    families = _by_name(tuning_families([judged], [], at_wall_s=1000.0))
    got = {
        (dict(s.labels)["metric"], dict(s.labels)["side"]): s.value for s in families[CANARY_METRIC]
    }
    assert judged.judgement is not None
    for verdict in judged.judgement.metrics:
        assert got[(verdict.name, "canary")] == verdict.canary_median
        assert got[(verdict.name, "baseline")] == verdict.baseline_median
    assert {name for name, _ in got} == {spec.name for spec in DEFAULT_METRICS}
    assert got[("ttft_s", "canary")] == statistics.median(
        [0.78, 0.80, 0.79, 0.81, 0.77, 0.80, 0.82]
    )
    (goodput,) = families[TRIAL_GOODPUT]
    assert dict(goodput.labels)["verdict"] == judged.judgement.classification.value
    assert goodput.timestamp_s == 1000.0


@pytest.mark.skipif(shutil.which(PROMTOOL) is None, reason="promtool not installed")
def test_promtool_check_metrics_is_clean() -> None:
    trials = [*_trials(), _judged(_best(_trials()))]
    text = exposition_text(tuning_families(trials, [_live()]))
    assert f"# TYPE {TRIALS_TOTAL} counter" in text
    result = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_history_has_a_sample_per_series_at_each_trial_end() -> None:
    trials = _trials()
    start = 1_000_000.0
    text = openmetrics_history(trials, _live(), start_wall_s=start)
    assert text.endswith("# EOF\n")
    ends = sorted(t.updated_wall_s - trials[0].created_wall_s + start for t in trials)
    series: dict[str, list[float]] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _value, stamp = line.rsplit(" ", 2)
        series.setdefault(key, []).append(float(stamp))
    for times in series.values():
        assert times == sorted(times) and len(set(times)) == len(times)
    total_key = next(k for k in series if k.startswith(TRIALS_TOTAL) and 'state="complete"' in k)
    assert series[total_key] == pytest.approx(ends)
    first = trials[0]
    goodput_key = next(k for k in series if k.startswith(TRIAL_GOODPUT) and first.trial_id in k)
    assert len(series[goodput_key]) == len(trials)  # the first trial ends first
    last_goodput = next(
        k for k in series if k.startswith(TRIAL_GOODPUT) and trials[-1].trial_id in k
    )
    assert len(series[last_goodput]) == 1


def test_a_promoting_judgement_changes_the_live_flags_in_the_history() -> None:
    judged = _judged(_best(_trials()))
    assert judged.judgement is not None and judged.judgement.promote
    text = openmetrics_history([judged], _live(), start_wall_s=2_000_000.0)
    live = [line for line in text.splitlines() if line.startswith(LIVE_FLAGS_INFO)]
    assert len(live) == 1
    assert 'source="promoted"' in live[0]
    assert f'flags="{flags_text(judged.values)}"' in live[0]


# --- the panels over a real Prometheus (slow) -------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Backfilled:
    prometheus: PrometheusServer
    windows: dict[str, tuple[float, float]]  # instance -> first and last sample time


def _backfill(folder: Path, name: str, text: str) -> None:
    source = folder / f"{name}.om"
    source.write_text(text)
    result = subprocess.run(
        [PROMTOOL, "tsdb", "create-blocks-from", "openmetrics", str(source), str(folder / "data")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _window(text: str) -> tuple[float, float]:
    times = [float(line.split()[-1]) for line in text.splitlines() if not line.startswith("#")]
    return min(times), max(times)


@pytest.fixture(scope="module")
def backfilled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backfilled]:
    if shutil.which(PROMTOOL) is None:
        pytest.skip("promtool not installed")
    folder = tmp_path_factory.mktemp("tuning-prometheus")
    trials = _trials()
    # Recent enough for Prometheus's retention; the judged example follows the run.
    recorded = openmetrics_history(
        trials,
        _live(),
        start_wall_s=time.time() - 4 * HOUR_S,
        target_labels={"job": "kvpilot", "instance": RECORDED},
    )
    judged = openmetrics_history(
        [_judged(_best(trials))],
        _live(),
        start_wall_s=time.time() - 2 * HOUR_S,
        target_labels={"job": "kvpilot", "instance": JUDGED},
    )
    live = openmetrics_history(
        _live_run(),
        _live(LIVE_FIXTURE),
        start_wall_s=time.time() - 1 * HOUR_S,
        target_labels={"job": "kvpilot", "instance": LIVE},
    )
    _backfill(folder, "recorded", recorded)
    _backfill(folder, "judged", judged)
    _backfill(folder, "live", live)
    prometheus = PrometheusServer(folder, [], None)
    prometheus.start()
    windows = {RECORDED: _window(recorded), JUDGED: _window(judged), LIVE: _window(live)}
    yield Backfilled(prometheus, windows)
    prometheus.stop()


def _tuning() -> dict:
    (tuning,) = (d for d in build_dashboards() if d.uid == UID)
    return tuning.model()


def _for(expr: str, instance_regex: str) -> str:
    """The query as Grafana sends it with these instances chosen and every server."""
    expr = expr.replace("$instance", instance_regex).replace("$server", ".*")
    return fill(expr, rate_interval="5m")


def _returns_data(backfilled: Backfilled, expr: str, instance: str, instant: bool) -> dict:
    start, end = backfilled.windows[instance]
    if instant:
        return backfilled.prometheus.api("query", {"query": expr, "time": end})
    params = {"query": expr, "start": start, "end": end, "step": 30}
    return backfilled.prometheus.api("query_range", params)


@pytest.mark.slow
def test_every_tuning_panel_query_returns_data(backfilled: Backfilled) -> None:
    model = _tuning()
    tables = {
        p["title"] for p in model["panels"] if p["type"] == "table"
    }  # instant queries: Grafana asks at the end of the range
    queries = panel_queries(model)
    assert len(queries) >= 10
    empty, refused = [], []
    for query in queries:
        canary = CANARY_METRIC in query.expr
        # The recorded run feeds every panel but the canary ones (it has no judgements).
        instance = JUDGED if canary else RECORDED
        expr = _for(query.expr, re.escape(instance))
        answer = _returns_data(backfilled, expr, instance, query.panel in tables)
        if answer["status"] != "success":
            refused.append((query.panel, query.expr, answer.get("error")))
        elif not answer["data"]["result"]:
            empty.append((query.panel, query.ref_id, instance))
        if canary:
            expr = _for(query.expr, re.escape(RECORDED))
            recorded = _returns_data(backfilled, expr, RECORDED, False)
            assert recorded["status"] == "success" and recorded["data"]["result"] == []
    assert not refused, refused
    assert not empty, empty


@pytest.mark.slow
def test_every_tuning_panel_query_returns_data_on_the_live_session(
    backfilled: Backfilled,
) -> None:
    model = _tuning()
    tables = {p["title"] for p in model["panels"] if p["type"] == "table"}
    # The session was judged before goodput was a judged metric and before preemptions were
    # counted per finished request: a metric its judgements never compared has nothing to
    # show, and nothing must be made up for it.
    judged = {m.name for t in _live_run() if t.judgement for m in t.judgement.metrics}
    unjudged = {f"{CANARY_PANEL}{m.name}" for m in DEFAULT_METRICS if m.name not in judged}
    empty, refused, made_up = [], [], []
    for query in panel_queries(model):
        expr = _for(query.expr, re.escape(LIVE))
        answer = _returns_data(backfilled, expr, LIVE, query.panel in tables)
        if answer["status"] != "success":
            refused.append((query.panel, query.expr, answer.get("error")))
        elif query.panel in unjudged:
            if answer["data"]["result"]:
                made_up.append((query.panel, query.ref_id))
        elif not answer["data"]["result"]:
            empty.append((query.panel, query.ref_id))
    assert not refused, refused
    assert not empty, empty
    assert not made_up, made_up
    # Re-record the session to cover these two.
    assert unjudged == {
        f"{CANARY_PANEL}goodput_tokens_per_s",
        f"{CANARY_PANEL}preemptions_per_request",
    }


@pytest.mark.slow
def test_panels_show_the_recorded_run(backfilled: Backfilled) -> None:
    trials = _trials()
    best = backfilled.prometheus.api(
        "query",
        {
            "query": f'{BEST_GOODPUT}{{instance="{RECORDED}"}}',
            "time": backfilled.windows[RECORDED][1],
        },
    )["data"]["result"]
    assert float(best[0]["value"][1]) == _best(trials).result.goodput_tokens_per_s  # type: ignore[union-attr]
    rows = backfilled.prometheus.api(
        "query",
        {
            "query": f'{TRIAL_INFO}{{instance="{RECORDED}"}}',
            "time": backfilled.windows[RECORDED][1],
        },
    )["data"]["result"]
    assert {r["metric"]["trial"] for r in rows} == {t.trial_id for t in trials}
    live = backfilled.prometheus.api(
        "query",
        {"query": LIVE_FLAGS_INFO, "time": backfilled.windows[JUDGED][1]},
    )["data"]["result"]
    assert {r["metric"]["instance"]: r["metric"]["source"] for r in live} == {
        JUDGED: "promoted"
    }  # the recorded run's last sample is older than the lookback at this time


@pytest.mark.slow
def test_template_variables_find_the_instances_and_servers(backfilled: Backfilled) -> None:
    start = min(w[0] for w in backfilled.windows.values())
    end = max(w[1] for w in backfilled.windows.values())
    for query in variable_queries(_tuning()):
        selector = _for(query.removeprefix("label_values(").rsplit(",", 1)[0], ".*")
        answer = backfilled.prometheus.api(
            "series", {"match[]": selector, "start": start, "end": end}
        )
        assert answer["status"] == "success", (query, answer)
        assert {s["instance"] for s in answer["data"]} == {RECORDED, JUDGED, LIVE}, query


@pytest.mark.slow
def test_trials_and_promotions_are_marked_on_the_backfilled_runs(backfilled: Backfilled) -> None:
    annotations = {q.panel: q.expr for q in annotation_queries(_tuning())}

    def marked(name: str, instance: str) -> list[dict]:
        # Over the run and the minute after it, where the last trial's mark lies.
        start, end = backfilled.windows[instance]
        params = {"query": _for(annotations[name], re.escape(instance)), "step": 30}
        params |= {"start": start, "end": end + 60}
        answer = backfilled.prometheus.api("query_range", params)
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    # Every finished trial of the recorded run is marked when its record first appears.
    trials = marked("kvpilot trials", RECORDED)
    assert {r["metric"]["trial"] for r in trials} == {t.trial_id for t in _trials()}
    first = min(float(v[0]) for r in trials for v in r["values"])
    assert first == backfilled.windows[RECORDED][0]  # the first trial's end, not before
    # The judged trial's promotion is marked with its flags; the configured run has none.
    (promotion,) = marked("kvpilot promotions", JUDGED)
    assert promotion["metric"]["flags"] == flags_text(_judged(_best(_trials())).values)
    assert marked("kvpilot promotions", RECORDED) == []
