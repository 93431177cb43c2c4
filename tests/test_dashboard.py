"""The Grafana dashboard (deploy/grafana/pipecast-dashboard.json) is valid and queries only metrics the code
defines: every metric name in every PromQL expression is a series some Counter, Gauge, Histogram or Summary
of pipecast/ or control_plane/ exposes, the definitions found by reading the source."""

import ast
import json
import re

import pytest

from tests.support import REPO

DASHBOARD = REPO / "deploy" / "grafana" / "pipecast-dashboard.json"
SOURCES = (REPO / "pipecast", REPO / "control_plane")

# The series each kind of metric exposes (prometheus_client: a counter's samples end in _total, a histogram's
# in _bucket, _sum and _count; _created is the time a child was created).
SERIES_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
}
CONSTRUCTORS = {
    "Counter": "counter", "CounterMetricFamily": "counter",
    "Gauge": "gauge", "GaugeMetricFamily": "gauge",
    "Histogram": "histogram", "HistogramMetricFamily": "histogram",
    "Summary": "summary", "SummaryMetricFamily": "summary",
}
# Hand-written text exposition, should any module render its metrics itself.
TYPE_LINE = re.compile(r"# TYPE (pipecast_\w+) (counter|gauge|histogram|summary)")


def _loop_names(function: ast.AST, variable: str) -> list[str]:
    """Metric names bound to ``variable`` by a loop over literal tuples, ``for name, ... in (("pipecast_x",
    ...), ...)``, in ``function``."""
    names = []
    for loop in ast.walk(function):
        if not isinstance(loop, ast.For) or not isinstance(loop.iter, (ast.Tuple, ast.List)):
            continue
        targets = loop.target.elts if isinstance(loop.target, ast.Tuple) else [loop.target]
        position = next((i for i, t in enumerate(targets) if isinstance(t, ast.Name) and t.id == variable), None)
        if position is None:
            continue
        for item in loop.iter.elts:
            value = item.elts[position] if isinstance(item, (ast.Tuple, ast.List)) else item
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                names.append(value.value)
    return names


def defined_metrics() -> dict[str, str]:
    """Metric name -> kind, for every metric the source defines."""
    found: dict[str, str] = {}
    for root in SOURCES:
        for path in root.rglob("*.py"):
            if "v1" in path.relative_to(REPO).parts:
                continue  # generated gRPC code
            text = path.read_text()
            found.update(TYPE_LINE.findall(text))
            tree = ast.parse(text)
            for function in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                                                 ast.AsyncFunctionDef)))]:
                for call in ast.walk(function):
                    if not isinstance(call, ast.Call) or not call.args:
                        continue
                    callee = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
                    kind = CONSTRUCTORS.get(callee)
                    if kind is None:
                        continue
                    first = call.args[0]
                    if isinstance(first, ast.Constant) and isinstance(first.value, str):
                        names = [first.value]
                    elif isinstance(first, ast.Name) and function is not tree:
                        names = _loop_names(function, first.id)
                    else:
                        names = []
                    for name in names:
                        # prometheus_client drops a counter's _total suffix from its name and adds it back
                        found[name.removesuffix("_total") if kind == "counter" else name] = kind
    return found


def exposed_series(metrics: dict[str, str]) -> set[str]:
    return {name + suffix for name, kind in metrics.items() for suffix in SERIES_SUFFIXES[kind]}


# Everything in a PromQL expression that is not a metric name, removed before the names are read.
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")  # label matchers (their values are gone with the strings)
_RANGE = re.compile(r"\[[^\]]*\]")  # [5m], [$__rate_interval], subqueries' [1h:1m]
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
_IDENTIFIER = re.compile(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
            "unless", "atan2", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (functions, aggregations, labels, strings, ranges and
    Grafana variables left out)."""
    for pattern in (_STRING, _MATCHERS, _RANGE, _LABEL_LIST, _VARIABLE):
        expr = pattern.sub(" ", expr)
    return {name for name, call in _IDENTIFIER.findall(expr) if not call and name.lower() not in KEYWORDS}


def test_metric_names_are_read_from_promql_without_functions_labels_or_ranges():
    expr = ('histogram_quantile(0.99, sum by (instance, le) (rate(pipecast_serve_ttft_seconds_bucket{job=~"a|b", '
            'x!="y"}[$__rate_interval]))) / ignoring(le) group_left max without (q) (pipecast_x offset 5m) '
            'and on() vector(1) > bool 2e3 or sum(rate(c_total[1h:1m])) * ${factor}')
    assert metric_names(expr) == {"pipecast_serve_ttft_seconds_bucket", "pipecast_x", "c_total"}
    assert metric_names('{__name__="pipecast_y"}') == set()  # only named selectors are checked


def test_the_metric_definitions_are_found_with_their_kinds():
    metrics = defined_metrics()
    assert metrics["pipecast_router_ttft_seconds"] == "histogram"
    assert metrics["pipecast_scaler_decisions"] == "counter"
    assert metrics["pipecast_serve_blocks_present"] == "gauge"  # defined in a loop over literal names
    assert metrics["pipecast_control_replans"] == "counter"  # a collector's family
    series = exposed_series(metrics)
    assert {"pipecast_scaler_decisions_total", "pipecast_router_ttft_seconds_bucket"} <= series
    assert not {"pipecast_scaler_decisions", "pipecast_router_ttft_seconds"} & series  # not series of their own


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(panels: list[dict]) -> list[dict]:
    """Every panel, those inside collapsed rows too."""
    return [p for panel in panels for p in (panel, *_panels(panel.get("panels", [])))]


def test_the_dashboard_is_a_grafana_model_with_unique_panel_ids_and_a_datasource_variable(dashboard):
    panels = _panels(dashboard["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), ids
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"] and dashboard["title"]
    [variable] = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert variable["name"] == "DS_PROMETHEUS" and variable["query"] == "prometheus"
    for panel in panels:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
            assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
            # a metric named only in a matcher would escape the check below
            assert not any("__name__" in t["expr"] for t in panel["targets"]), panel["title"]
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs)), panel["title"]


def test_every_metric_the_dashboard_queries_is_defined_in_the_code(dashboard):
    series = exposed_series(defined_metrics())
    used = {}
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            for name in metric_names(target["expr"]):
                used.setdefault(name, panel["title"])
    assert used, "no metric found in the dashboard"
    unknown = {name: title for name, title in used.items() if name not in series}
    assert not unknown, f"metrics the code does not define (series name: panel): {unknown}"
