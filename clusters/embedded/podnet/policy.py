"""NetworkPolicy (networking.k8s.io/v1) compiled to iptables filter rules for the router namespace.

Every pod-to-pod packet crosses the router's FORWARD chain (``nodes/fabric.py``)
after kube-proxy in the sender's node translated any Service address, so one
place sees the real source and destination pod of every connection. On the
platform this engine runs beside kube-router (each node's engine,
``nodes/netpol.py``) only to cut connections opened before a policy
(``--recheck-established``); kube-router keeps them.

The compiled chains (all ``RAYPROOF-*``) are::

    FORWARD -> RAYPROOF-FORWARD
      conntrack ESTABLISHED/RELATED      -> ACCEPT   (see "Existing connections")
      conntrack INVALID                  -> DROP
      -> RAYPROOF-EGRESS   (-s <pod ip> -> RAYPROOF-E-<pod>, for each egress-isolated pod)
      -> RAYPROOF-INGRESS  (-d <pod ip> -> RAYPROOF-I-<pod>, for each ingress-isolated pod)
      (falls through: FORWARD's policy ACCEPT)

A pod chain lists the union of the rules of every policy selecting that pod in
that direction; a rule that allows the packet RETURNs (so egress allowed goes
on to the ingress check: a connection needs both), and the chain ends in DROP,
so a denied connection times out rather than being refused, as with Calico.
An ``ipBlock`` with ``except`` uses a helper chain ``RAYPROOF-X-<hash>`` that
returns early for excepted sources and otherwise sets the mark bit
``0x10000``, which the pod chain tests right after the jump.

Semantics (kubernetes.io/docs/concepts/services-networking/network-policies/):
a pod is isolated in a direction once any policy selecting it has that
direction in ``policyTypes`` (default: Ingress, plus Egress when an ``egress``
section exists); non-isolated directions allow everything; a rule with no
``from``/``to`` matches every peer and one with no ``ports`` every port; a
peer is ``podSelector`` (policy's namespace), ``namespaceSelector`` (all pods
of matching namespaces), both (matching pods of matching namespaces), or
``ipBlock`` with ``except``; ``ports`` have ``protocol`` (TCP default),
numeric or named ``port`` and ``endPort`` (a range; numeric port only).
Named ports resolve against the destination pod's container ports: the
selected pod for ingress, each possible peer pod for egress.  Traffic the
router itself sends or receives (the API server's proxy starts there) never
crosses FORWARD, so this engine never judges it; kube-router in the pod's node
does.

New pods.  A pod's address reaches these rules only once kubelet has
written it to the pod's status and this controller has compiled it, a second
or more after the pod's processes started; until then no chain matches it and
its packets pass here, whatever the policies that select it (real CNIs
isolate a pod before its containers start; on the platform kube-router does,
and this engine runs only beside it, to cut open connections).

Existing connections (REFERENCE §6: implementation defined).  Default
(``recheck_established=False``): like Calico and Antrea, packets of a
connection conntrack already knows are accepted before any policy check, so a
policy only affects connections opened after it is applied; flows opened
earlier keep working.  With ``recheck_established=True`` only *reply*-direction
packets (and ICMP errors, RELATED) skip the checks: every packet the
connection's initiator sends is judged against the current policy, so a new
deny stalls an open connection (its sender retransmits until the policy is
lifted or TCP gives up), like kube-network-policies' strict mode.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from clusters.embedded.podnet.iptables import PREFIX, Table, chain_name, comment
from clusters.embedded.podnet.model import NAMESPACE_NAME_LABEL, Namespace, Pod
from core import selectors

FORWARD = f"{PREFIX}FORWARD"
INGRESS = f"{PREFIX}INGRESS"
EGRESS = f"{PREFIX}EGRESS"
ALLOW_BIT = "0x10000/0x10000"

HOOKS = (("filter", "FORWARD", f"-j {FORWARD}"),)


class PolicyError(ValueError):
    """A NetworkPolicy the API server would have refused (bad selector operator, endPort with a named port…)."""


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """:func:`core.selectors.selector_matches`; a bad operator is a PolicyError."""
    try:
        return selectors.selector_matches(selector, labels)
    except ValueError as exc:
        raise PolicyError(str(exc)) from None


def policy_types(spec: Mapping[str, Any]) -> list[str]:
    types = spec.get("policyTypes")
    if types:
        return list(types)
    return ["Ingress"] + (["Egress"] if spec.get("egress") is not None else [])


@dataclass(frozen=True)
class _PortSpec:
    protocol: str
    port: int | str | None
    end_port: int | None


def _port_specs(ports: list[Mapping[str, Any]] | None, where: str) -> list[_PortSpec] | None:
    """None means "every port and protocol"."""
    if not ports:
        return None
    out = []
    for p in ports:
        proto = (p.get("protocol") or "TCP").upper()
        if proto not in ("TCP", "UDP", "SCTP"):
            raise PolicyError(f"{where}: protocol {proto!r} is not TCP, UDP or SCTP")
        port, end = p.get("port"), p.get("endPort")
        if isinstance(port, str) and port.isdigit():
            port = int(port)
        if end is not None and not isinstance(port, int):
            raise PolicyError(f"{where}: endPort needs a numeric port, got port={port!r}")
        if end is not None and end < port:
            raise PolicyError(f"{where}: endPort {end} is below port {port}")
        out.append(_PortSpec(proto, port, end))
    return out


def _numeric_port_match(spec: _PortSpec, number: int | None = None) -> str:
    proto = spec.protocol.lower()
    port = number if number is not None else spec.port
    if port is None:
        return f"-p {proto}"
    rng = f"{port}:{spec.end_port}" if spec.end_port is not None and number is None else str(port)
    return f"-p {proto} -m {proto} --dport {rng}"


class _Compiler:
    def __init__(self, pods: Iterable[Pod], namespaces: Iterable[Namespace], recheck_established: bool,
                 guarded_nodes: frozenset[str] | None = None):
        self.pods = sorted((p for p in pods if p.ip), key=lambda p: (p.namespace, p.name))
        self.ns_labels = {ns.name: ns.labels for ns in namespaces}
        self.recheck = recheck_established
        self.guarded_nodes = guarded_nodes
        self.table = Table("filter")

    def ns_labels_of(self, name: str) -> Mapping[str, str]:
        return self.ns_labels.get(name) or {NAMESPACE_NAME_LABEL: name}

    def select_peers(self, peer: Mapping[str, Any], policy_ns: str) -> list[Pod]:
        pod_sel, ns_sel = peer.get("podSelector"), peer.get("namespaceSelector")
        out = []
        for pod in self.pods:
            if ns_sel is None:
                if pod.namespace != policy_ns:
                    continue
            elif not selector_matches(ns_sel, self.ns_labels_of(pod.namespace)):
                continue
            if pod_sel is not None and not selector_matches(pod_sel, pod.labels):
                continue
            out.append(pod)
        return out

    def compile(self, policies: Sequence[Mapping[str, Any]]) -> Table:
        t = self.table
        t.chain(FORWARD)
        t.chain(EGRESS)
        t.chain(INGRESS)
        if self.recheck:
            t.add(FORWARD, "-m conntrack --ctstate RELATED -j ACCEPT")
            t.add(FORWARD, "-m conntrack --ctstate ESTABLISHED --ctdir REPLY -j ACCEPT")
        else:
            t.add(FORWARD, "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT")
        t.add(FORWARD, "-m conntrack --ctstate INVALID -j DROP")
        t.add(FORWARD, f"-j {EGRESS}")
        t.add(FORWARD, f"-j {INGRESS}")

        # (pod, direction) -> [(policy label, rule)] in a stable order
        applies: dict[tuple[int, str], list[tuple[str, str, Mapping[str, Any]]]] = {}
        for pol in sorted(policies, key=lambda p: ((p.get("metadata") or {}).get("namespace") or "default",
                                                    p["metadata"]["name"])):
            meta, spec = pol["metadata"], pol.get("spec") or {}
            ns = meta.get("namespace") or "default"
            label = f"{ns}/{meta['name']}"
            types = policy_types(spec)
            for i, pod in enumerate(self.pods):
                if pod.namespace != ns or not selector_matches(spec.get("podSelector"), pod.labels):
                    continue
                if self.guarded_nodes is not None and pod.node not in self.guarded_nodes:
                    continue  # no engine on its node: selected, never enforced
                for direction, key in (("Ingress", "ingress"), ("Egress", "egress")):
                    if direction in types:
                        bucket = applies.setdefault((i, direction), [])
                        bucket += [(label, ns, rule) for rule in spec.get(key) or []]

        for (i, direction), rules in sorted(applies.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            pod = self.pods[i]
            ingress = direction == "Ingress"
            chain = chain_name("I" if ingress else "E", pod.namespace, pod.name, pod.ip or "")
            t.chain(chain)
            where = f"{pod.namespace}/{pod.name}"
            if ingress:
                t.add(INGRESS, f"-d {pod.ip}/32 {comment(where + ' ingress')} -j {chain}")
            else:
                t.add(EGRESS, f"-s {pod.ip}/32 {comment(where + ' egress')} -j {chain}")
            for n, (label, policy_ns, rule) in enumerate(rules):
                self.compile_rule(chain, pod, ingress, f"{label} {direction.lower()}[{n}]", policy_ns, rule)
            t.add(chain, f"{comment(where + ' default deny ' + direction.lower())} -j DROP")
        return t

    def compile_rule(self, chain: str, target: Pod, ingress: bool, label: str, policy_ns: str,
                     rule: Mapping[str, Any]) -> None:
        t = self.table
        peer_flag = "-s" if ingress else "-d"
        ports = _port_specs(rule.get("ports"), label)
        peers = rule.get("from" if ingress else "to")
        note = comment(label)

        def port_matches(dest: Pod | None) -> list[str]:
            """Port matches for traffic to ``dest`` (None: a destination that is not a known pod)."""
            if ports is None:
                return [""]
            out = []
            for spec in ports:
                if isinstance(spec.port, str):
                    resolved = dest.named_ports.get(spec.port) if dest is not None else None
                    if resolved is not None and resolved[1] == spec.protocol:
                        out.append(_numeric_port_match(spec, resolved[0]) + " ")
                else:
                    out.append(_numeric_port_match(spec) + " ")
            return out

        named = ports is not None and any(isinstance(s.port, str) for s in ports)
        # Egress to a named port depends on each destination pod, so the peer
        # must be spelled out as pod addresses.
        per_dest = named and not ingress

        def allow_pods(pods: list[Pod]) -> None:
            for peer in pods:
                for pm in port_matches(peer if per_dest else target):
                    t.add(chain, f"{peer_flag} {peer.ip}/32 {pm}{note} -j RETURN")

        if not peers:
            if per_dest:
                allow_pods(self.pods)
            else:
                for pm in port_matches(target):
                    t.add(chain, f"{pm}{note} -j RETURN")
            return
        for peer in peers:
            block = peer.get("ipBlock")
            if block is None:
                allow_pods(self.select_peers(peer, policy_ns))
                continue
            cidr = ipaddress.ip_network(block["cidr"], strict=False)
            excepts = [ipaddress.ip_network(e, strict=False) for e in block.get("except") or []]
            if cidr.version != 4:
                continue  # the pod network is IPv4 only
            if per_dest:
                inside = [p for p in self.pods if _in(p.ip, cidr) and not any(_in(p.ip, e) for e in excepts)]
                allow_pods(inside)
                continue
            matches = port_matches(target)
            if not excepts:
                for pm in matches:
                    t.add(chain, f"{peer_flag} {cidr} {pm}{note} -j RETURN")
                continue
            helper = chain_name("X", chain, label, str(cidr), *map(str, excepts))
            t.add(helper, f"-j MARK --set-xmark 0x0/{ALLOW_BIT.split('/')[1]}")
            for e in excepts:
                if e.version == 4:
                    t.add(helper, f"{peer_flag} {e} {comment('except')} -j RETURN")
            for pm in matches:
                t.add(helper, f"{pm}-j MARK --set-xmark {ALLOW_BIT}".replace("  ", " "))
            t.add(chain, f"{peer_flag} {cidr} {note} -j {helper}")
            t.add(chain, f"-m mark --mark {ALLOW_BIT} -j RETURN")


def _in(ip: str | None, net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bool:
    return ip is not None and ipaddress.ip_address(ip) in net


def compile_policies(pods: Iterable[Pod], namespaces: Iterable[Namespace], policies: Sequence[Mapping[str, Any]], *,
                     recheck_established: bool = False, guarded_nodes: frozenset[str] | None = None) -> Table:
    """The filter table's ``RAYPROOF-*`` chains enforcing ``policies`` (API-shaped dicts) on ``pods``.

    Pure: no namespace or iptables is touched, so the rules can be checked
    from literals.  Pods without an IP are left out (nothing to match).
    ``guarded_nodes``: the nodes the policy engine runs on (None: every
    node); a policy selecting a pod on another node is accepted and not
    enforced for it, as when the engine's DaemonSet does not tolerate that
    node's taint. Such pods are still peers of the policies that guard others.
    """
    return _Compiler(pods, namespaces, recheck_established, guarded_nodes).compile(policies)
