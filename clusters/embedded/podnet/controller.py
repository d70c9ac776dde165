"""Keeps the pod network router's NetworkPolicy rules in step with the API server, and serves the
API server's way in (the CONNECT proxy, :mod:`.proxy`).

Two layers, so the logic can be tested without an API server:

* :class:`ClusterState` holds the latest Pods, Namespaces and
  NetworkPolicies as raw API JSON and counts changes (``generation``).
  Anything may feed it: the watch threads, or a test.
* :class:`PodNetworkController` runs one reconcile thread that, after a
  change and a short debounce (a burst of events becomes one apply),
  recompiles the policies from a snapshot and applies the filter table
  (one atomic ``iptables-restore`` commit) when it differs.  A failed apply
  is retried after a back-off.

Services, node ports and cluster DNS are not here: kube-proxy in each node
translates Service addresses and serves node ports, and CoreDNS pods serve
DNS (``nodes/``). The retired node agent's pod network did all three in the
router; the router now holds no nat rule.

The watch layer is deliberately thin: per kind, LIST (raw JSON,
``_preload_content=False``) then WATCH from the list's resourceVersion with
bookmarks; on ``410 Gone`` (an ERROR event or an ApiException) it re-lists,
on any other error it backs off and re-lists.  ``stop()`` shuts the open watch
sockets down, so it returns at once rather than after the watch timeout.
"""
from __future__ import annotations

import functools
import json
import logging
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

from clusters.embedded.podnet.model import Namespace, Pod
from clusters.embedded.podnet.network import POD_CIDR, SERVICE_CIDR, PodNetwork
from clusters.embedded.podnet.policy import PolicyError, compile_policies
from clusters.embedded.podnet.proxy import ClusterProxy
from core.timeouts import PROCESS_EXIT, Tier
from core.waiting import wait_for

log = logging.getLogger(__name__)

KINDS = ("pods", "namespaces", "networkpolicies")

# A change fed to the controller is compiled and applied (its policy rules).
# Belongs in core/timeouts.py with the other tiers; kept here until the
# owner of that module moves it.
POD_NETWORK_SYNC = Tier("pod_network_sync", 30, "a Pod/NetworkPolicy change is live in the pod network")

DEBOUNCE_S = 0.2  # gathers a burst of watch events into one apply
RETRY_S = 2.0  # back-off after a failed apply or a broken watch
WATCH_S = 300  # server-side timeout of one watch request; it is then renewed
LIST_TIMEOUT_S = 60  # client-side timeout of one LIST request


def cluster_proxy_socket(state_dir: str | Path) -> Path:
    """Where the controller's CONNECT proxy listens: the kube-apiserver egress selector's ``udsName``."""
    return Path(state_dir) / "cluster-proxy.sock"


def _key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace') or ''}/{meta['name']}"


class ClusterState:
    """The latest objects of each kind, by namespace/name; thread-safe."""

    def __init__(self) -> None:
        self._objects: dict[str, dict[str, dict]] = {k: {} for k in KINDS}
        self.listed: set[str] = set()  # kinds listed at least once
        self._lock = threading.Lock()
        self.generation = 0
        self.changed = threading.Event()

    def _bump(self) -> None:
        self.generation += 1
        self.changed.set()

    def touch(self) -> None:
        """Count a change that is not an object (a setting): the next apply recompiles."""
        with self._lock:
            self._bump()

    def replace(self, kind: str, objects: list[dict]) -> None:
        """Set every object of ``kind`` (after a LIST)."""
        fresh = {_key(o): o for o in objects}
        with self._lock:
            self.listed.add(kind)
            if fresh != self._objects[kind]:
                self._objects[kind] = fresh
                self._bump()

    def apply(self, kind: str, event: str, obj: dict) -> None:
        """One watch event: ADDED, MODIFIED or DELETED."""
        key = _key(obj)
        with self._lock:
            objs = self._objects[kind]
            if event == "DELETED":
                if objs.pop(key, None) is None:
                    return
            else:
                if objs.get(key) == obj:
                    return
                objs[key] = obj
            self._bump()

    def snapshot(self) -> tuple[int, dict[str, list[dict]]]:
        with self._lock:
            return self.generation, {k: list(v.values()) for k, v in self._objects.items()}


def _parse(items: list[dict], parse: Callable[[dict], Any], what: str) -> list[Any]:
    out = []
    for obj in items:
        try:
            out.append(parse(obj))
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("ignoring malformed %s %s: %s", what, (obj.get("metadata") or {}).get("name"), exc)
    return out


class PodNetworkController:
    """Watches the API server and keeps ``network``'s policy rules current.

    ``kubeconfig`` None runs without watches: feed :attr:`state` directly
    (tests, or a caller with its own informers).  ``state_dir`` defaults to
    ``<kubeconfig's directory>/podnet`` (the platform's run directory).
    ``recheck_established``: see :mod:`.policy` ("Existing connections").
    """

    def __init__(self, kubeconfig: str | Path | None, platform_name: str, *, state_dir: str | Path | None = None,
                 network: PodNetwork | None = None, recheck_established: bool = False,
                 debounce_s: float = DEBOUNCE_S, proxy_tcp_port: int | None = None,
                 enforce_policies: bool = True, policy_nodes: frozenset[str] | None = None):
        if network is None:
            if state_dir is None:
                if kubeconfig is None:
                    raise ValueError("give state_dir (or network) when running without a kubeconfig")
                state_dir = Path(kubeconfig).parent / "podnet"
            network = PodNetwork(platform_name, state_dir)
        self.kubeconfig = None if kubeconfig is None else Path(kubeconfig)
        self.network = network
        self.state = ClusterState()
        self._recheck_established = recheck_established
        # False: a CNI without NetworkPolicy support (flannel): policies are
        # accepted by the API server and silently not enforced.
        self.enforce_policies = enforce_policies
        # The nodes the policy engine runs on (None: all); see compile_policies.
        self.policy_nodes = policy_nodes
        self.debounce_s = debounce_s
        self.applied_generation = -1
        self.last_error: BaseException | None = None
        self.policy_errors: list[str] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._responses: dict[str, Any] = {}
        self._resp_lock = threading.Lock()
        self._last: dict[str, Any] = {}
        self._reconcile_lock = threading.Lock()
        self.proxy = ClusterProxy(network.router, (POD_CIDR, SERVICE_CIDR),
                                  unix_path=cluster_proxy_socket(network.state_dir), tcp_port=proxy_tcp_port)

    @property
    def recheck_established(self) -> bool:
        """Whether a new policy also cuts connections opened before it (see :mod:`.policy`)."""
        return self._recheck_established

    @recheck_established.setter
    def recheck_established(self, value: bool) -> None:
        self._recheck_established = value
        self.state.touch()

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> "PodNetworkController":
        """Open the network, serve the proxy, start reconciling and (with a kubeconfig) watching."""
        self.network.open()
        self.proxy.start()
        self._stop.clear()
        self._last.clear()  # maybe a rebuilt router: apply everything
        self.state.changed.set()  # first apply even with nothing fed yet
        self._spawn(self._reconcile_loop, "podnet-reconcile")
        if self.kubeconfig is not None:
            from kubernetes import config  # only needed when watching

            # Read now, so a bad kubeconfig fails start() rather than a thread.
            api = config.new_client_from_config(config_file=str(self.kubeconfig))
            for kind in KINDS:
                self._spawn(functools.partial(self._watch_kind, api, kind), f"podnet-watch-{kind}")
        return self

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    @property
    def threads(self) -> list[threading.Thread]:
        """Live threads of this controller, the proxy's included (what stop() must end)."""
        return [t for t in self._threads if t.is_alive()] + self.proxy.threads

    def stop(self) -> None:
        """Stop watching, reconciling and serving the proxy; rules stay as they are.  Safe to repeat."""
        self._stop.set()
        self.state.changed.set()
        with self._resp_lock:
            for resp in self._responses.values():
                _shutdown(resp)
        self.proxy.stop()
        wait_for(lambda: [t.name for t in self._threads + self.proxy.threads if t.is_alive()],
                 lambda alive: not alive, timeout=PROCESS_EXIT, description="pod network controller threads to end",
                 interval=0.05)
        self._threads.clear()

    def close(self) -> None:
        """stop(), then remove every namespace and chain of the network."""
        self.stop()
        self.network.close()

    def __enter__(self) -> "PodNetworkController":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reconcile ---------------------------------------------------------------------

    def reconcile(self) -> int:
        """Compile the current state and apply what changed; return the generation applied."""
        with self._reconcile_lock:
            return self._reconcile()

    def _reconcile(self) -> int:
        generation, snap = self.state.snapshot()
        pods = _parse(snap["pods"], Pod.from_api, "Pod")
        namespaces = _parse(snap["namespaces"], Namespace.from_api, "Namespace")
        policies = []
        errors = []
        for pol in snap["networkpolicies"] if self.enforce_policies else []:
            try:  # one invalid policy must not stop every other one from applying
                compile_policies(pods, namespaces, [pol])
                policies.append(pol)
            except (PolicyError, KeyError, TypeError, ValueError) as exc:
                errors.append(f"{_key(pol)}: {exc}")
        if errors:
            log.warning("NetworkPolicies not enforced: %s", "; ".join(errors))
        self.policy_errors = errors

        filt = compile_policies(pods, namespaces, policies, recheck_established=self._recheck_established,
                                guarded_nodes=self.policy_nodes)
        if filt.rules() != self._last.get("filter"):
            self.network.apply_table(filt)
            self._last["filter"] = filt.rules()
        self.applied_generation = generation
        return generation

    def _reconcile_loop(self) -> None:
        while not self._stop.is_set():
            self.state.changed.wait()  # set by every change, and by stop()
            if self._stop.is_set():
                return
            self._stop.wait(self.debounce_s)  # let a burst of events land first
            self.state.changed.clear()
            try:
                self.reconcile()
                self.last_error = None
            except Exception as exc:  # noqa: BLE001 - kept for wait_synced, retried
                self.last_error = exc
                log.warning("pod network apply failed, retrying in %ss: %s", RETRY_S, exc)
                if not self._stop.wait(RETRY_S):
                    self.state.changed.set()

    def wait_synced(self, timeout: Tier = POD_NETWORK_SYNC) -> int:
        """Wait until everything fed so far is applied; return that generation."""
        want = self.state.generation
        wait_for(lambda: (self.applied_generation, self.last_error), lambda v: v[0] >= want, timeout=timeout,
                 description=f"pod network to apply state generation {want}", interval=0.05)
        return self.applied_generation

    def wait_ready(self, timeout: Tier = POD_NETWORK_SYNC) -> int:
        """Wait until every kind has been listed from the API server and that state is applied."""
        wait_for(lambda: sorted(set(KINDS) - self.state.listed), lambda missing: not missing, timeout=timeout,
                 description="the pod network controller to list every kind it watches", interval=0.05)
        return self.wait_synced(timeout)

    # -- watch -------------------------------------------------------------------------

    def _watch_kind(self, api: Any, kind: str) -> None:
        self._watch_loop(kind, _list_function(api, kind))

    def _watch_loop(self, kind: str, list_fn: Callable[..., Any]) -> None:
        from kubernetes.client.exceptions import ApiException
        from kubernetes.watch.watch import iter_resp_lines

        while not self._stop.is_set():
            try:
                resp = list_fn(_preload_content=False, _request_timeout=LIST_TIMEOUT_S)
                try:
                    data = json.loads(resp.data)
                finally:
                    resp.release_conn()
                self.state.replace(kind, data.get("items") or [])
                rv = data["metadata"]["resourceVersion"]
                while not self._stop.is_set():
                    resp = list_fn(watch=True, resource_version=rv, allow_watch_bookmarks=True,
                                   timeout_seconds=WATCH_S, _preload_content=False,
                                   _request_timeout=(10, WATCH_S + 30))
                    with self._resp_lock:
                        self._responses[kind] = resp
                    try:
                        if self._stop.is_set():
                            return
                        for line in iter_resp_lines(resp):
                            event = json.loads(line)
                            etype, obj = event.get("type"), event.get("object") or {}
                            if etype == "ERROR":
                                if obj.get("code") == 410:
                                    raise _Gone(obj.get("message", "410 Gone"))
                                raise RuntimeError(f"watch {kind} error: {obj}")
                            rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                            if etype in ("ADDED", "MODIFIED", "DELETED"):
                                self.state.apply(kind, etype, obj)
                    finally:
                        with self._resp_lock:
                            self._responses.pop(kind, None)
                        # Close, never pool: a watch left mid-stream would hand the
                        # next LIST a connection whose server side is still streaming.
                        resp.close()
            except _Gone as exc:
                log.info("watch %s: %s; re-listing", kind, exc)
            except ApiException as exc:
                if exc.status != 410 and not self._stop.is_set():
                    log.warning("watch %s failed (%s); re-listing in %ss", kind, exc.status, RETRY_S)
                    self._stop.wait(RETRY_S)
            except Exception as exc:  # noqa: BLE001 - connection reset, API server restart, …
                if self._stop.is_set():
                    return
                log.warning("watch %s broke (%s: %s); re-listing in %ss", kind, type(exc).__name__, exc, RETRY_S)
                self._stop.wait(RETRY_S)


def _list_function(api: Any, kind: str) -> Callable[..., Any]:
    """The client's list-all-namespaces call for ``kind``.

    Building the generated API classes imports large modules (about a second
    each on two cores), so each watch thread does it itself, off start()'s path.
    """
    from kubernetes import client

    if kind == "networkpolicies":
        return client.NetworkingV1Api(api).list_network_policy_for_all_namespaces
    core = client.CoreV1Api(api)
    return {"pods": core.list_pod_for_all_namespaces, "namespaces": core.list_namespace}[kind]


class _Gone(Exception):
    """The watch's resourceVersion is too old (410): re-list."""


def _shutdown(resp: Any) -> None:
    """Make a thread blocked reading ``resp`` return now (urllib3 >= 2.3)."""
    try:
        resp.shutdown()
    except (AttributeError, ValueError, RuntimeError, OSError):  # no socket, or already released
        try:
            resp.close()
        except OSError:
            pass
