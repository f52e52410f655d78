"""router/deploy/tensor-parallel.yaml: two nodes of one tensor-parallel model. It validates
offline, its args are the CLI's exact flags and give each pod its node's config, rank 0's
rendezvous address resolves to pod 0 through the headless Service, and HTTP reaches pod 0
only."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import yaml

from radixserve.cli import build_config, build_parser
from tests.repo import REPO_ROOT

MANIFEST = REPO_ROOT / "router" / "deploy" / "tensor-parallel.yaml"


def _docs() -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d
            for d in yaml.safe_load_all(MANIFEST.read_text()) if d}


def _args_of_pod(container: dict[str, Any], index: int) -> list[str]:
    """The args as the kubelet expands them: $(POD_INDEX) is the pod's ordinal."""
    return [a.replace("$(POD_INDEX)", str(index)) for a in container["args"]]


def test_manifest_validates_and_each_pod_gets_its_node_rank() -> None:
    docs = _docs()
    for doc in docs.values():
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
    sts = docs[("StatefulSet", "radixserve-tp")]
    container = sts["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['apps.kubernetes.io/pod-index']"
    nodes = sts["spec"]["replicas"]
    configs = []
    for index in range(nodes):
        args = build_parser().parse_args(["serve", *_args_of_pod(container, index)])
        configs.append(build_config(args, {}).engine)
    assert [c.node_rank for c in configs] == list(range(nodes))
    assert {(c.tensor_parallel_size, c.nnodes) for c in configs} == {(2, nodes)}
    # The exact flags of docs/hardware.md: --tensor-parallel-size, --nnodes, --node-rank,
    # --dist-init-addr.
    for flag in ("--tensor-parallel-size", "--nnodes", "--node-rank", "--dist-init-addr"):
        assert flag in container["args"]
    # Rank 0's address is pod 0's stable name under the headless Service, on a pod port.
    host, _, port = configs[0].dist_init_addr.rpartition(":")
    nodes_svc = docs[("Service", "radixserve-tp-nodes")]
    assert host == f"{sts['metadata']['name']}-0.{sts['spec']['serviceName']}"
    assert nodes_svc["metadata"]["name"] == sts["spec"]["serviceName"]
    assert nodes_svc["spec"]["clusterIP"] == "None"
    assert nodes_svc["spec"]["publishNotReadyAddresses"] is True
    assert int(port) in {p["containerPort"] for p in container["ports"]}
    # HTTP: pod 0 only (node 1 runs workers, no server).
    http = docs[("Service", "radixserve-tp")]["spec"]
    assert http["selector"] == {**sts["spec"]["selector"]["matchLabels"],
                                "apps.kubernetes.io/pod-index": "0"}
    assert http["ports"][0]["port"] == int(container["args"][container["args"].index(
        "--port") + 1])
