"""Kubernetes Events from the node agent (``source.component: kubelet``).

Tests and the suite's evidence capture read pod events (``Pulled``,
``Started``, ``Killing``, ``Unhealthy``, ``BackOff``, ``Failed``...) the way
an operator reads ``kubectl describe pod``. Events are posted from one
background thread per node through a bounded queue, so a slow API server
never holds up a pod's sync loop; repeated events are aggregated by
(object, reason, message) into one Event with a rising ``count``, as
client-go's recorder does. Dropped events (queue full) are counted, not fatal.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import queue
import threading
from typing import Any, Mapping

from clusters.embedded.nodeagent.kube import ApiError, KubeClient

QUEUE_SIZE = 1000


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class EventRecorder:
    """Posts core/v1 Events for one node."""

    def __init__(self, api: KubeClient, node: str):
        self.api = api
        self.node = node
        self.dropped = 0
        self._q: queue.Queue[tuple | None] = queue.Queue(QUEUE_SIZE)
        self._seen: dict[str, tuple[str, int]] = {}  # key -> (event name, count)
        self._thread = threading.Thread(target=self._loop, name=f"events-{node}", daemon=True)

    def start(self) -> "EventRecorder":
        self._thread.start()
        return self

    def stop(self) -> None:
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass

    def pod_event(self, pod: Mapping[str, Any], kind: str, reason: str, message: str,
                  field_path: str | None = None) -> None:
        meta = pod["metadata"]
        ref = {"kind": "Pod", "apiVersion": "v1", "namespace": meta["namespace"], "name": meta["name"],
               "uid": meta["uid"], "resourceVersion": meta.get("resourceVersion")}
        if field_path:
            ref["fieldPath"] = field_path
        self._put((meta["namespace"], ref, kind, reason, message))

    def node_event(self, kind: str, reason: str, message: str) -> None:
        ref = {"kind": "Node", "apiVersion": "v1", "name": self.node, "uid": self.node}
        self._put(("default", ref, kind, reason, message))

    def _put(self, item: tuple) -> None:
        try:
            self._q.put_nowait(item)
        except queue.Full:
            self.dropped += 1

    def _loop(self) -> None:
        while True:
            item = self._q.get()  # sleep-ok: blocks on the event queue, ended by stop()
            if item is None:
                return
            try:
                self._post(*item)
            except (ApiError, OSError, Exception):  # noqa: BLE001 - events are best effort, as upstream
                self.dropped += 1

    def _post(self, namespace: str, ref: dict[str, Any], kind: str, reason: str, message: str) -> None:
        key = hashlib.sha256(f"{ref.get('uid')}|{ref.get('fieldPath')}|{reason}|{message}".encode()).hexdigest()
        now = _now()
        if key in self._seen:
            name, count = self._seen[key]
            count += 1
            try:
                self.api.patch(f"/api/v1/namespaces/{namespace}/events/{name}",
                               {"count": count, "lastTimestamp": now}, kind="merge")
                self._seen[key] = (name, count)
                return
            except ApiError as exc:
                if not exc.not_found:
                    raise
        name = f"{ref['name']}.{hashlib.sha256((key + now).encode()).hexdigest()[:16]}"
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "involvedObject": ref, "reason": reason, "message": message[:1024], "type": kind,
            "source": {"component": "kubelet", "host": self.node},
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
            "eventTime": None, "reportingComponent": "kubelet", "reportingInstance": self.node,
        }
        self.api.post(f"/api/v1/namespaces/{namespace}/events", body)
        if len(self._seen) > 5000:
            self._seen.clear()
        self._seen[key] = (name, 1)
