"""router/deploy/: every manifest validates offline against the Kubernetes schemas
(kubernetes-validate ships them), and the invariants a rollout depends on hold: probe paths
are real public routes, the grace period covers preStop + --shutdown-timeout, RBAC is
exactly what the pod watch needs, selectors match pod labels, every flag exists in --help,
and the dashboard and HPA name metrics the servers really export."""

from __future__ import annotations

import json
import re
import tomllib
from typing import Any

import kubernetes_validate
import pytest
import yaml

from radixserve.cli import build_parser as serve_parser
from radixserve.cli import parse_kv_events_config
from radixserve.kv_events.publisher import DEFAULT_BLOCK_SIZE
from router.__main__ import build_parser as router_parser
from tests.repo import REPO_ROOT

DEPLOY = REPO_ROOT / "router" / "deploy"
K8S_VERSION = "1.30.0"  # the oldest release these manifests promise to work on


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def _all() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, d) for p in sorted(DEPLOY.glob("*.yaml")) for d in _docs(p.name)]


def _one(kind: str, name: str) -> dict[str, Any]:
    found = [d for _, d in _all() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _container(deployment: str) -> dict[str, Any]:
    containers = _one("Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_every_manifest_validates_offline() -> None:
    docs = _all()
    assert {d["kind"] for _, d in docs} >= {
        "Deployment", "Service", "ServiceAccount", "Role", "RoleBinding",
        "PodDisruptionBudget", "HorizontalPodAutoscaler", "ConfigMap",
        "PersistentVolumeClaim"}
    for name, doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {e.message}")
    bad = {**_one("Deployment", "radixserve"), "spec": {"replicas": "two"}}
    with pytest.raises(kubernetes_validate.ValidationError):  # the check can fail
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def _serve_help() -> str:
    parser = serve_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["serve"].format_help()  # type: ignore[attr-defined, no-any-return]


def _flags(args: list[str]) -> set[str]:
    return {a for a in args if a.startswith("--")}


def test_every_flag_exists_in_help() -> None:
    serve_help, router_help = _serve_help(), router_parser().format_help()
    replica, router = _container("radixserve"), _container("radixserve-router")
    assert replica["command"] == ["radixserve", "serve"]
    assert router["command"] == ["radixserve-router"]
    scripts = tomllib.loads((DEPLOY.parent.parent / "pyproject.toml").read_text())[
        "project"]["scripts"]
    assert {replica["command"][0], router["command"][0]} <= scripts.keys()
    assert replica["image"] == router["image"]  # one image (router/deploy/Dockerfile)
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "COPY router ./router" in dockerfile and "RUN pip install" in dockerfile
    for flag in _flags(replica["args"]):
        assert re.search(rf"{flag}\b", serve_help), f"radixserve serve has no {flag}"
    for flag in _flags(router["args"]):
        assert re.search(rf"{flag}\b", router_help), f"radixserve-router has no {flag}"
    # The shared KV tier's flag stays commented until `serve --help` lists it.
    text = (DEPLOY / "replicas.yaml").read_text()
    if "--kv-shared-dir" not in serve_help:
        assert all(ln.lstrip().startswith("#") for ln in text.splitlines()
                   if "--kv-shared-dir" in ln)
    # The args parse as the CLIs would parse them.
    serve_parser().parse_args(["serve", *replica["args"]])
    router_parser().parse_args(router["args"])


def test_kv_events_ports_match_the_config() -> None:
    replica = _container("radixserve")
    cfg = parse_kv_events_config(_flag_value(replica["args"], "--kv-events-config"))
    assert cfg.publishes and cfg.replay_endpoint is not None
    ports = {p["containerPort"] for p in replica["ports"]}
    for endpoint in (cfg.endpoint, cfg.replay_endpoint):
        assert int(endpoint.rpartition(":")[2]) in ports
    http = next(p["containerPort"] for p in replica["ports"] if p["name"] == "http")
    assert int(_flag_value(replica["args"], "--port")) == http


def _get_routes(app: Any) -> set[str]:
    return {r.resource.canonical for r in app.router.routes() if r.method == "GET"}


def test_probe_paths_are_public_routes() -> None:
    from radixserve.config import EngineConfig, ServerConfig
    from radixserve.ipc.client import EngineClient
    from radixserve.server.access.middleware import PUBLIC_PATHS
    from radixserve.server.app import create_app
    from radixserve.testing.fake_engine import FakeEngine, InlineTransport
    from router.app import create_app as create_router
    from router.config import RouterConfig

    cfg = ServerConfig(engine=EngineConfig(model="x"))
    replica_routes = _get_routes(create_app(cfg, EngineClient(InlineTransport(
        FakeEngine, cfg.engine, 0.0))))
    router_routes = _get_routes(create_router(RouterConfig()))
    replica = _container("radixserve")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        path = replica[probe]["httpGet"]["path"]
        # Probes send no API key: the path must be public, or --api-key fails every probe.
        assert path in replica_routes and path in PUBLIC_PATHS, (probe, path)
    # Readiness and startup wait for the model (/health: 503 while loading or draining);
    # liveness must not, or a pod busy loading or restarting its engine would be killed.
    assert replica["readinessProbe"]["httpGet"]["path"] == "/health"
    assert replica["startupProbe"]["httpGet"]["path"] == "/health"
    assert replica["livenessProbe"]["httpGet"]["path"] != "/health"
    startup = replica["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # 10 min to load
    router = _container("radixserve-router")
    for probe in ("readinessProbe", "livenessProbe"):
        assert router[probe]["httpGet"]["path"] in router_routes


def test_grace_period_covers_prestop_and_shutdown_timeout() -> None:
    pod = _one("Deployment", "radixserve")["spec"]["template"]["spec"]
    replica = _container("radixserve")
    shutdown = float(_flag_value(replica["args"], "--shutdown-timeout"))
    pre_stop = replica["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > shutdown + float(pre_stop[1])
    assert "resources" in replica and replica["resources"]["requests"]
    strategy = _one("Deployment", "radixserve")["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0


def test_rbac_is_exactly_the_pod_watch() -> None:
    role = _one("Role", "radixserve-router")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]
    assert not [d for _, d in _all() if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    binding = _one("RoleBinding", "radixserve-router")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "radixserve-router"}
    pod = _one("Deployment", "radixserve-router")["spec"]["template"]["spec"]
    assert binding["subjects"] == [{"kind": "ServiceAccount",
                                    "name": pod["serviceAccountName"]}]
    assert _one("ServiceAccount", pod["serviceAccountName"])
    # Sufficient: k8s discovery lists and watches pods in its own namespace, where the
    # Role lives (no --namespace in the args).
    args = _container("radixserve-router")["args"]
    assert _flag_value(args, "--service-discovery") == "k8s" and "--namespace" not in args


def _labels(deployment: str) -> dict[str, str]:
    return _one("Deployment", deployment)["spec"]["template"]["metadata"]["labels"]


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def test_selectors_match_pod_labels() -> None:
    for name in ("radixserve", "radixserve-router"):
        d = _one("Deployment", name)
        assert _matches(d["spec"]["selector"]["matchLabels"], _labels(name))
        pdb = _one("PodDisruptionBudget", name)
        assert _matches(pdb["spec"]["selector"]["matchLabels"], _labels(name))
    assert _matches(_one("Service", "radixserve-headless")["spec"]["selector"],
                    _labels("radixserve"))
    assert _one("Service", "radixserve-headless")["spec"]["clusterIP"] == "None"
    assert _matches(_one("Service", "radixserve-router")["spec"]["selector"],
                    _labels("radixserve-router"))
    # The router's --selector picks the replica pods, and not itself.
    selector = dict(t.split("=") for t in
                    _flag_value(_container("radixserve-router")["args"], "--selector").split(","))
    assert _matches(selector, _labels("radixserve"))
    assert not _matches(selector, _labels("radixserve-router"))
    port = int(_flag_value(_container("radixserve-router")["args"], "--discovery-port"))
    assert port == int(_flag_value(_container("radixserve")["args"], "--port"))
    hpa = _one("HorizontalPodAutoscaler", "radixserve")["spec"]["scaleTargetRef"]
    assert (hpa["kind"], hpa["name"]) == ("Deployment", "radixserve")


def _exported_names() -> set[str]:
    """Every sample name the replica's and the router's /metrics can carry."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from radixserve.server.metrics import ServerMetrics
    from router.config import RouterConfig
    from router.core import Router
    from router.metrics import make_registry

    stats = {"num_running": 1, "num_waiting": 2, "kv_free_tokens": 1, "kv_cached_tokens": 1,
             "kv_held_tokens": 1, "kv_total_tokens": 3, "kv_evictable_tokens": 1,
             "integrity_ok": 1}
    m = ServerMetrics(lambda: stats)
    m.ttft.observe(0.1)
    m.itl.observe(0.01)
    m.key_refused.labels("k", "queue_full").inc()
    m.requests_displaced.labels("k").inc()
    m.engine_restarts.inc()
    router = Router(RouterConfig(workers=("http://a:1",), kv_events=True))
    texts = [generate_latest(m.registry), generate_latest(make_registry(router))]
    return {s.name for t in texts for f in text_string_to_metric_families(t.decode())
            for s in f.samples}


def test_dashboard_and_hpa_use_exported_metrics() -> None:
    names = _exported_names()
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"radixserve(?:_router)?:[a-z_]+", e)}
    assert used and used <= names, used - names
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("time to first token", "inter-token", "hit rate", "kv-cache usage",
                  "queue", "429", "engine restarts", "routing split"):
        assert topic in titles, topic
    rules = yaml.safe_load(_one("ConfigMap", "radixserve-prometheus-adapter-rules")
                           ["data"]["config.yaml"])["rules"]
    series = re.match(r"[a-z_:]+", rules[0]["seriesQuery"])
    assert series is not None and series.group(0) == "radixserve:num_requests_waiting"
    assert series.group(0) in names
    renamed = re.sub(rules[0]["name"]["matches"],
                     rules[0]["name"]["as"].replace("${1}", r"\1"), series.group(0))
    hpa = _one("HorizontalPodAutoscaler", "radixserve")["spec"]["metrics"][0]["pods"]
    assert hpa["metric"]["name"] == renamed == "radixserve_num_requests_waiting"


def test_routers_run_in_the_mode_that_makes_several_agree() -> None:
    """docs/router.md, "Several routers": precise mode with the replicas' tokenizer, ties by hash over
    as many routers as the Deployment runs, a load dead band (tests/router/test_multi.py
    measures their agreement with these very flags)."""
    deployment = _one("Deployment", "radixserve-router")
    args = _container("radixserve-router")["args"]
    replica_args = _container("radixserve")["args"]
    assert "--kv-events" in args and "--enable-kv-events" in replica_args
    assert _flag_value(args, "--tokenizer") == _flag_value(replica_args, "--model")
    assert int(_flag_value(args, "--router-replicas")) == deployment["spec"]["replicas"] > 1
    assert int(_flag_value(args, "--balance-abs-threshold")) > 0
    block = int(_flag_value(args, "--kv-block-size")) if "--kv-block-size" in args else \
        router_parser().get_default("kv_block_size")
    assert block == DEFAULT_BLOCK_SIZE  # the replicas' event blocks
