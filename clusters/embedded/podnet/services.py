"""kube-proxy's iptables mode, reduced to what the embedded platform needs.

ClusterIP services become DNAT rules in the router namespace's nat table,
``PREROUTING -> RAYPROOF-SERVICES -> RAYPROOF-SVC-<hash> -> RAYPROOF-SEP-<hash>``,
with ``-m statistic --mode random`` spreading new connections evenly over the
ready endpoints (the probabilities 1/n, 1/(n-1), …, 1 that kube-proxy uses).
Because the DNAT happens in PREROUTING, the FORWARD chain (NetworkPolicy)
sees the endpoint's address and port, as a CNI's policy does.

Hairpin: a pod that reaches itself through its service would receive a
packet whose source is its own address and drop it (a martian), so such
packets are marked in the SEP chain and SNATed to the router's own address in
POSTROUTING, like kube-proxy's KUBE-MARK-MASQ / KUBE-POSTROUTING.

Headless services (``clusterIP: None``) get no rules: they exist only in DNS.
A service without ready endpoints gets no rule either; the router's ``local``
route for the service range then delivers the packet to the router itself,
where nothing listens, so the client's connect fails at once with "Connection
refused", as with kube-proxy's REJECT.
NodePort (and a LoadBalancer's node ports) is not a rule here: the machine's
root namespace, where ``<node address>:<nodePort>`` lives, gets no iptables
rules, so :mod:`.nodeports` forwards those ports in userspace to the cluster IP
whose chains are compiled here.
Not done: sessionAffinity ClientIP, load-balancer addresses, externalIPs,
internalTrafficPolicy, externalTrafficPolicy Local, terminating-endpoint fallback.
"""
from __future__ import annotations

from typing import Mapping

from clusters.embedded.podnet.iptables import PREFIX, Table, chain_name, comment
from clusters.embedded.podnet.model import Endpoint, Service, ServicePort

SERVICES = f"{PREFIX}SERVICES"
POSTROUTING = f"{PREFIX}POSTROUTING"
MARK_MASQ = f"{PREFIX}MARK-MASQ"
MASQ_MARK = "0x4000/0x4000"

# (table, built-in chain, rule) that send traffic through the chains above;
# installed once when the router namespace is made.
HOOKS = (
    ("nat", "PREROUTING", f"-j {SERVICES}"),
    ("nat", "OUTPUT", f"-j {SERVICES}"),
    ("nat", "POSTROUTING", f"-j {POSTROUTING}"),
)


def _proto_match(protocol: str, port: int | None = None) -> str:
    proto = protocol.lower()
    if port is None:
        return f"-p {proto}"
    return f"-p {proto} -m {proto} --dport {port}"


def ready_endpoints(port: ServicePort, endpoints: list[Endpoint]) -> dict[str, int]:
    """Ready endpoint address -> target port for one service ``port`` (its EndpointSlice port of the same name)."""
    key = (port.name, port.protocol)
    seen: dict[str, int] = {}
    for ep in endpoints:
        if ep.ready and key in ep.ports:
            seen.setdefault(ep.ip, ep.ports[key])
    return seen


def compile_services(services: list[Service], endpoints: Mapping[tuple[str, str], list[Endpoint]], *,
                     snat_ip: str) -> Table:
    """The nat table's ``RAYPROOF-*`` chains for ``services`` and their ready ``endpoints``.

    ``snat_ip`` is the router's own address, the source that hairpin
    connections are rewritten to.
    """
    table = Table("nat")
    table.chain(SERVICES)
    table.add(MARK_MASQ, f"-j MARK --set-xmark {MASQ_MARK}")
    table.add(POSTROUTING, f"-m mark ! --mark {MASQ_MARK} -j RETURN")
    table.add(POSTROUTING, "-j MARK --xor-mark 0x4000")
    table.add(POSTROUTING, f"{comment('hairpin: pod reached itself through a service')} -j SNAT --to-source {snat_ip}")
    for svc in sorted(services, key=lambda s: (s.namespace, s.name)):
        if svc.headless or not svc.cluster_ip or svc.type == "ExternalName":
            continue
        eps = endpoints.get((svc.namespace, svc.name), [])
        for port in svc.ports:
            seen = ready_endpoints(port, eps)
            if not seen:
                continue
            label = f"{svc.namespace}/{svc.name}:{port.name or port.port}"
            svc_chain = chain_name("SVC", svc.namespace, svc.name, port.name, port.protocol)
            table.add(SERVICES, f"-d {svc.cluster_ip}/32 {_proto_match(port.protocol, port.port)} "
                                f"{comment(label + ' cluster IP')} -j {svc_chain}")
            ready = sorted(seen.items())
            for i, (ip, target) in enumerate(ready):
                sep = chain_name("SEP", svc.namespace, svc.name, port.name, port.protocol, ip)
                left = len(ready) - i
                pick = f"-m statistic --mode random --probability {1 / left:.11f} " if left > 1 else ""
                table.add(svc_chain, f"{comment(f'{label} -> {ip}:{target}')} {pick}-j {sep}")
                table.add(sep, f"-s {ip}/32 -j {MARK_MASQ}")
                table.add(sep, f"{_proto_match(port.protocol)} -j DNAT --to-destination {ip}:{target}")
    return table
