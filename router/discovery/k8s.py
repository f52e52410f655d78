"""Kubernetes discovery: list + watch the replica pods with the official `kubernetes` client.

Owns: the watch thread (the client is blocking) and the pods it last saw; the rule from a pod
to a worker: `http://<pod IP>:<--discovery-port>`, routable when its Ready condition is True
and it is not being deleted, in the canary group its `--group-label` label names. Does not
know: what a worker is to the router (membership.py applies the set).

The protocol, as the API documents it ("Efficient detection of changes"):
  1. LIST the pods (label selector): the items, and the list's metadata.resourceVersion;
  2. WATCH from that resourceVersion: newline-delimited JSON events ADDED / MODIFIED /
     DELETED (BOOKMARK: only a newer resourceVersion). The server ends a watch after
     timeoutSeconds; we watch again from the last resourceVersion seen;
  3. an ERROR event (or answer) with a Status of code 410 (Gone, "Expired"): that version is
     too old. LIST again: the new list replaces what we knew, so pods deleted meanwhile go.
Any other failure (API server down, 5xx, 403) waits `backoff` (doubling, capped) and lists
again, keeping the last known pods and so the workers: the replicas usually outlive an API
server hiccup, and health checks still take dead ones out.

Threads: the watch thread only reads the API and posts plain PodInfo tuples to the event
loop (call_soon_threadsafe); only the loop touches `pods` and the router.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException

from router.discovery.discovery_config import DiscoveryConfig
from router.discovery.dns import worker_url
from router.discovery.membership import Membership, Target

log = logging.getLogger(__name__)

SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
HTTP_GONE = 410
RECENT_BACKOFFS = 16  # the latest waits after API errors kept, to look at the retry schedule


class PodInfo(NamedTuple):
    name: str
    ip: str | None
    ready: bool
    terminating: bool
    group: str | None


def pod_info(pod: Any, group_label: str) -> PodInfo:
    """The facts discovery needs from a V1Pod."""
    status = pod.status
    conditions = (status.conditions if status is not None else None) or ()
    ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
    labels = pod.metadata.labels or {}
    return PodInfo(pod.metadata.name, status.pod_ip if status is not None else None, ready,
                   pod.metadata.deletion_timestamp is not None, labels.get(group_label))


def desired_targets(pods: Iterable[PodInfo], port: int) -> dict[str, Target]:
    out: dict[str, Target] = {}
    for p in pods:
        if not p.ip:
            continue  # not scheduled yet
        url = worker_url(p.ip, port)
        target = Target(url, p.ready and not p.terminating, p.group)
        if url not in out or target.routable:  # an IP reused by a new pod: the live one
            out[url] = target
    return out


def default_namespace() -> str:
    """The router's own namespace inside a cluster, else "default"."""
    try:
        return SA_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


class K8sDiscovery:
    def __init__(self, cfg: DiscoveryConfig, membership: Membership,
                 configuration: Any = None) -> None:
        """`configuration`: a kubernetes.client.Configuration (tests: host=the fake API);
        None: in-cluster config, else ~/.kube/config."""
        self.cfg = cfg
        self.membership = membership
        self.namespace = cfg.namespace or default_namespace()
        self._configuration = configuration
        self.pods: dict[str, PodInfo] = {}
        self.num_lists = 0
        self.num_expired = 0  # watches ended by 410 Gone (each followed by a list)
        self.num_errors = 0
        # The latest waits after API errors, oldest first; bounded: an outage may last days.
        self.backoffs: deque[float] = deque(maxlen=RECENT_BACKOFFS)
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._watch: Any = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()

    # --- the event loop side ---------------------------------------------------------------

    async def run(self) -> None:
        """Start the watch thread; apply every change until cancelled."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._watch_thread, daemon=True,
                                        name="k8s pod watch")
        self._thread.start()
        try:
            while True:
                await self._changed.wait()
                self._changed.clear()
                await self.membership.apply(desired_targets(self.pods.values(), self.cfg.port))
        finally:
            self.stop()

    def stop(self) -> None:
        """Ask the watch thread to end; it does within the socket shutdown, not at once."""
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()  # shuts the watch's socket down: the blocked read returns

    def join(self, timeout: float) -> bool:
        """Wait for the watch thread (tests); True if it has ended."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _replace_all(self, pods: list[PodInfo]) -> None:
        self.pods = {p.name: p for p in pods}
        self.num_lists += 1
        self._changed.set()

    def _update(self, kind: str, pod: PodInfo) -> None:
        if kind == "DELETED":
            self.pods.pop(pod.name, None)
        else:
            self.pods[pod.name] = pod
        self._changed.set()

    def _count(self, field: str, error: str | None = None) -> None:
        setattr(self, field, getattr(self, field) + 1)
        if error is not None:
            self.last_error = error

    # --- the watch thread ------------------------------------------------------------------

    def _post(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed: nobody left to tell
            self._stop.set()

    def _api(self) -> Any:
        configuration = self._configuration
        if configuration is None:
            try:
                k8s_config.load_incluster_config()
            except k8s_config.ConfigException:
                k8s_config.load_kube_config()
            return k8s_client.CoreV1Api()
        return k8s_client.CoreV1Api(k8s_client.ApiClient(configuration))

    def _watch_thread(self) -> None:
        backoff = self.cfg.backoff_initial_s
        api = None
        while not self._stop.is_set():
            try:
                api = api or self._api()
                resource_version = self._list(api)
                backoff = self.cfg.backoff_initial_s
                self._follow(api, resource_version)
            except ApiException as e:
                if e.status == HTTP_GONE:
                    log.info("pod watch expired (410 Gone): listing again")
                    self._post(self._count, "num_expired")
                    continue
                self._failed(f"API answered {e.status}: {e.reason}", backoff)
            except Exception as e:  # urllib3/socket errors, config errors: all retried
                self._failed(repr(e), backoff)
            else:
                continue
            self._stop.wait(backoff)
            backoff = min(backoff * 2, self.cfg.backoff_max_s)

    def _failed(self, error: str, backoff: float) -> None:
        if self._stop.is_set():
            return
        log.warning("pod watch failed (%s): keeping the last %d pod(s), retrying in %.2fs",
                    error, len(self.pods), backoff)
        self.backoffs.append(backoff)
        self._post(self._count, "num_errors", error)

    def _list(self, api: Any) -> str:
        pods = api.list_namespaced_pod(self.namespace, label_selector=self.cfg.selector,
                                       _request_timeout=(5, 30))
        infos = [pod_info(p, self.cfg.group_label) for p in pods.items or ()]
        self._post(self._replace_all, infos)
        return str(pods.metadata.resource_version)

    def _follow(self, api: Any, resource_version: str) -> None:
        """Watch from `resource_version` until stopped; raises on 410 and on errors."""
        timeout = self.cfg.watch_timeout_s
        while not self._stop.is_set():
            w = self._watch = k8s_watch.Watch()
            stream = w.stream(api.list_namespaced_pod, self.namespace,
                              label_selector=self.cfg.selector,
                              resource_version=resource_version, timeout_seconds=timeout,
                              allow_watch_bookmarks=True, _request_timeout=(5, timeout + 15))
            for event in stream:
                if self._stop.is_set():  # stop() raced the request: no socket to shut yet
                    w.stop()
                    break
                kind = event["type"]
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._post(self._update, kind, pod_info(event["object"],
                                                            self.cfg.group_label))
            resource_version = w.resource_version or resource_version
