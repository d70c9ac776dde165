"""Cluster DNS: a small authoritative server for ``cluster.local``, standard library only.

What KubeRay-made pods need (REFERENCE §9): the head service's FQDN resolves
from inside a pod, over the pod's ``/etc/resolv.conf``.  This server answers
from a :data:`Zone` (name -> IPv4 addresses) that :func:`build_zone` derives
from Services and EndpointSlices, the records CoreDNS's ``kubernetes`` plugin
serves:

* ``<svc>.<ns>.svc.cluster.local`` -> the ClusterIP, or for a headless service
  the addresses of its ready endpoints;
* ``<hostname>.<svc>.<ns>.svc.cluster.local`` -> a headless service's endpoint
  whose pod set ``hostname`` and ``subdomain: <svc>`` (EndpointSlice
  ``endpoints[].hostname``);
* ``a-b-c-d.<ns>.pod.cluster.local`` -> a.b.c.d (CoreDNS ``pods insecure``);
* ``<svc>.<ns>.svc`` and ``<svc>.<ns>`` as shorthands of the first form.

Anything else gets NXDOMAIN: nothing is ever forwarded, so no query leaves
the machine.  A name that exists but has no record of the asked type (AAAA,
which glibc asks for alongside A) gets an empty NOERROR, so resolvers do not
give up on the A answer.  UDP answers larger than the client's buffer (512
bytes, or its EDNS size up to 1232) are truncated with TC set; TCP (RFC 7766
length-prefixed, several queries per connection) carries the rest.

The server is a thread of the calling process (:class:`DnsServer`), whose two
sockets are made inside the router namespace by a setns'd helper thread, so
stopping it leaves no process behind and its zone is swapped in memory.
"""
from __future__ import annotations

import argparse
import errno
import ipaddress
import json
import selectors
import socket
import struct
import sys
import threading
from typing import Iterable, Mapping

from clusters.embedded.podnet.model import Endpoint, Service

DOMAIN = "cluster.local"
TTL = 5  # seconds, CoreDNS kubernetes plugin's default
TYPE_A, TYPE_NS, TYPE_SOA, TYPE_AAAA, TYPE_OPT, TYPE_ANY = 1, 2, 6, 28, 41, 255
CLASS_IN = 1
NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP = 0, 1, 2, 3, 4
UDP_LIMIT, EDNS_LIMIT = 512, 1232
EPHEMERAL_PORT_TRIES = 20  # port 0: UDP ports tried until TCP is free on one too
TCP_IDLE_S = 10.0  # socket timeout on an idle TCP client, not a wait

Zone = Mapping[str, tuple[str, ...]]


def resolv_conf(namespace: str, nameserver: str = "198.19.0.10", domain: str = DOMAIN) -> str:
    """``/etc/resolv.conf`` for a pod in ``namespace`` (what the kubelet writes for dnsPolicy ClusterFirst)."""
    return (f"search {namespace}.svc.{domain} svc.{domain} {domain}\n"
            f"nameserver {nameserver}\n"
            "options ndots:5\n")


def build_zone(services: Iterable[Service], endpoints: Mapping[tuple[str, str], list[Endpoint]],
               domain: str = DOMAIN) -> dict[str, tuple[str, ...]]:
    """Fully qualified lowercase name (no trailing dot) -> sorted IPv4 addresses."""
    zone: dict[str, set[str]] = {}
    for svc in services:
        name = f"{svc.name}.{svc.namespace}.svc.{domain}".lower()
        if svc.headless:
            for ep in endpoints.get((svc.namespace, svc.name), []):
                if not ep.ready:
                    continue
                zone.setdefault(name, set()).add(ep.ip)
                if ep.hostname:
                    zone.setdefault(f"{ep.hostname}.{name}".lower(), set()).add(ep.ip)
        elif svc.cluster_ip and svc.type != "ExternalName":
            zone.setdefault(name, set()).add(svc.cluster_ip)
    return {k: tuple(sorted(v, key=ipaddress.ip_address)) for k, v in zone.items()}


# --- wire format (RFC 1035) -------------------------------------------------------------

class _FormatError(ValueError):
    pass


def _read_name(msg: bytes, pos: int) -> tuple[str, int]:
    labels: list[str] = []
    end = None
    jumps = 0
    while True:
        if pos >= len(msg):
            raise _FormatError("name runs past the message")
        length = msg[pos]
        if length & 0xC0 == 0xC0:
            if pos + 1 >= len(msg) or jumps > 20:
                raise _FormatError("bad compression pointer")
            if end is None:
                end = pos + 2
            pos = ((length & 0x3F) << 8) | msg[pos + 1]
            jumps += 1
            continue
        if length & 0xC0:
            raise _FormatError("unknown label type")
        pos += 1
        if length == 0:
            break
        labels.append(msg[pos:pos + length].decode("ascii", "replace"))
        pos += length
    return ".".join(labels), (end if end is not None else pos)


def _encode_name(name: str) -> bytes:
    out = b""
    for label in name.strip(".").split("."):
        if label:
            raw = label.encode("ascii")
            out += bytes([len(raw)]) + raw
    return out + b"\x00"


def parse_query(msg: bytes) -> tuple[int, int, str, int, int, int]:
    """(id, flags, qname, qtype, qclass, client UDP buffer size) of a one-question query."""
    if len(msg) < 12:
        raise _FormatError("shorter than a DNS header")
    qid, flags, qd, an, ns, ar = struct.unpack("!6H", msg[:12])
    if qd != 1:
        raise _FormatError(f"{qd} questions")
    name, pos = _read_name(msg, 12)
    if pos + 4 > len(msg):
        raise _FormatError("question runs past the message")
    qtype, qclass = struct.unpack("!HH", msg[pos:pos + 4])
    pos += 4
    bufsize = UDP_LIMIT
    # Skip answer/authority records, then look for an EDNS OPT record.
    for i in range(an + ns + ar):
        _, pos = _read_name(msg, pos)
        if pos + 10 > len(msg):
            break
        rtype, rclass, _, rdlen = struct.unpack("!HHIH", msg[pos:pos + 10])
        if i >= an + ns and rtype == TYPE_OPT:
            bufsize = max(UDP_LIMIT, min(rclass, EDNS_LIMIT))
        pos += 10 + rdlen
    return qid, flags, name, qtype, qclass, bufsize


def _header(qid: int, qflags: int, rcode: int, authoritative: bool, an: int, ns: int, truncated: bool = False) -> bytes:
    opcode = qflags & 0x7800
    flags = 0x8000 | opcode | (qflags & 0x0100) | rcode  # QR, opcode, RD copied; RA never (no recursion)
    if authoritative:
        flags |= 0x0400
    if truncated:
        flags |= 0x0200
    return struct.pack("!6H", qid, flags, 1, an, ns, 0)


def _question(name: str, qtype: int, qclass: int) -> bytes:
    return _encode_name(name) + struct.pack("!HH", qtype, qclass)


def _a_record(ip: str) -> bytes:
    # owner name = pointer to the question name at offset 12
    return struct.pack("!HHHIH", 0xC00C, TYPE_A, CLASS_IN, TTL, 4) + ipaddress.IPv4Address(ip).packed


def _soa_record(domain: str) -> bytes:
    rdata = (_encode_name(f"ns.dns.{domain}") + _encode_name(f"hostmaster.{domain}")
             + struct.pack("!5I", 1, 7200, 1800, 86400, TTL))
    return _encode_name(domain) + struct.pack("!HHIH", TYPE_SOA, CLASS_IN, TTL, len(rdata)) + rdata


class Resolver:
    """Answers queries from a zone that can be swapped atomically while serving."""

    def __init__(self, zone: Zone | None = None, domain: str = DOMAIN):
        self.domain = domain.lower()
        self.zone: Zone = dict(zone or {})

    def lookup(self, qname: str) -> tuple[bool, bool, tuple[str, ...]]:
        """(in our zone, name exists, addresses) for ``qname``."""
        name = qname.lower().rstrip(".")
        zone, dom = self.zone, self.domain
        if name == dom or name.endswith("." + dom):
            fqdn = name
        elif name.endswith(".svc") and name.count(".") >= 2:
            fqdn = f"{name}.{dom}"
        elif name.count(".") >= 1 and not name.endswith(".svc"):
            fqdn = f"{name}.svc.{dom}"
            if fqdn not in zone:
                return False, False, ()
        else:
            return False, False, ()
        if fqdn in zone:
            return True, True, zone[fqdn]
        labels = fqdn[: -len(dom) - 1].split(".") if fqdn != dom else []
        if len(labels) == 3 and labels[2] == "pod":
            try:
                return True, True, (str(ipaddress.IPv4Address(labels[0].replace("-", "."))),)
            except ValueError:
                return True, False, ()
        # Empty non-terminals (cluster.local, svc.cluster.local, <ns>.svc.cluster.local) exist.
        suffix = "." + fqdn
        exists = fqdn == dom or any(k.endswith(suffix) for k in zone)
        return True, exists, ()

    def answer(self, msg: bytes, limit: int | None = None) -> bytes | None:
        """The response to one query message; ``limit`` caps its size (UDP), None for TCP."""
        try:
            qid, qflags, name, qtype, qclass, bufsize = parse_query(msg)
        except (_FormatError, struct.error):
            if len(msg) >= 2:
                return struct.pack("!6H", struct.unpack("!H", msg[:2])[0], 0x8000 | FORMERR, 0, 0, 0, 0)
            return None
        if qflags & 0x8000:
            return None  # a response, not a query: never answer (no loops)
        question = _question(name, qtype, qclass)
        if (qflags >> 11) & 0xF != 0:
            return _header(qid, qflags, NOTIMP, False, 0, 0) + question
        in_zone, exists, addrs = self.lookup(name)
        if not in_zone:
            return _header(qid, qflags, NXDOMAIN, False, 0, 0) + question
        if not exists:
            return _header(qid, qflags, NXDOMAIN, True, 0, 1) + question + _soa_record(self.domain)
        answers = [_a_record(ip) for ip in addrs] if qtype in (TYPE_A, TYPE_ANY) and qclass == CLASS_IN else []
        if not answers:
            return _header(qid, qflags, NOERROR, True, 0, 1) + question + _soa_record(self.domain)
        body = b"".join(answers)
        cap = None if limit is None else max(limit, bufsize)
        if cap is not None and 12 + len(question) + len(body) > cap:
            fit = (cap - 12 - len(question)) // 16
            return _header(qid, qflags, NOERROR, True, fit, 0, truncated=True) + question + b"".join(answers[:fit])
        return _header(qid, qflags, NOERROR, True, len(answers), 0) + question + body


# --- server ------------------------------------------------------------------------------

class DnsServer:
    """UDP and TCP port 53 on ``address``, served by threads of this process.

    ``make_sockets`` lets the caller create the sockets elsewhere (the pod
    network creates them inside the router namespace); by default they are made
    in the current namespace, which unit tests use with 127.0.0.1 and port 0.
    """

    def __init__(self, address: str, port: int = 53, zone: Zone | None = None, domain: str = DOMAIN):
        self.address = address
        self.port = port
        self.resolver = Resolver(zone, domain)
        self._udp: socket.socket | None = None
        self._tcp: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._clients: set[socket.socket] = set()
        self._client_threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self.queries = 0

    def make_sockets(self) -> tuple[socket.socket, socket.socket]:
        """UDP and TCP sockets bound to one port. With port 0 the kernel picks
        the UDP port, which another process may hold for TCP: then another."""
        tries = EPHEMERAL_PORT_TRIES if self.port == 0 else 1
        attempt = 1
        while True:
            try:
                return self._bind_pair()
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE or attempt == tries:
                    raise
            attempt += 1

    def _bind_pair(self) -> tuple[socket.socket, socket.socket]:
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            udp.bind((self.address, self.port))
            tcp.bind((self.address, udp.getsockname()[1]))
            tcp.listen(64)
        except OSError:
            udp.close()
            tcp.close()
            raise
        return udp, tcp

    def start(self, sockets: tuple[socket.socket, socket.socket] | None = None) -> "DnsServer":
        self._udp, self._tcp = sockets or self.make_sockets()
        self.port = self._udp.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name=f"podnet-dns-{self.address}", daemon=True)
        self._thread.start()
        return self

    def update(self, zone: Zone) -> None:
        """Swap in a new zone; queries in flight finish with the old one."""
        self.resolver.zone = dict(zone)

    @property
    def threads(self) -> list[threading.Thread]:
        with self._lock:
            return [t for t in [self._thread, *self._client_threads] if t is not None and t.is_alive()]

    def _serve(self) -> None:
        assert self._udp is not None and self._tcp is not None
        sel = selectors.DefaultSelector()
        sel.register(self._udp, selectors.EVENT_READ, "udp")
        sel.register(self._tcp, selectors.EVENT_READ, "tcp")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            while not self._stopping.is_set():
                for key, _ in sel.select():
                    if key.data == "udp":
                        try:
                            msg, peer = self._udp.recvfrom(4096)
                        except OSError:
                            continue
                        self.queries += 1
                        reply = self.resolver.answer(msg, UDP_LIMIT)
                        if reply:
                            try:
                                self._udp.sendto(reply, peer)
                            except OSError:
                                pass
                    elif key.data == "tcp":
                        try:
                            conn, _ = self._tcp.accept()
                        except OSError:
                            continue
                        t = threading.Thread(target=self._serve_tcp, args=(conn,), daemon=True,
                                             name=f"podnet-dns-tcp-{self.address}")
                        with self._lock:
                            self._clients.add(conn)
                            self._client_threads.add(t)
                        t.start()
        finally:
            sel.close()

    def _serve_tcp(self, conn: socket.socket) -> None:
        conn.settimeout(TCP_IDLE_S)
        try:
            while not self._stopping.is_set():
                head = _recv_exact(conn, 2)
                if head is None:
                    return
                msg = _recv_exact(conn, struct.unpack("!H", head)[0])
                if msg is None:
                    return
                self.queries += 1
                reply = self.resolver.answer(msg, None)
                if reply:
                    conn.sendall(struct.pack("!H", len(reply)) + reply)
        except OSError:
            return
        finally:
            conn.close()
            with self._lock:
                self._clients.discard(conn)
                self._client_threads.discard(threading.current_thread())

    def stop(self) -> None:
        """Stop serving and close every socket; safe to repeat.  Callers wait on :attr:`threads`."""
        self._stopping.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        with self._lock:
            for conn in self._clients:
                try:
                    conn.shutdown(socket.SHUT_RDWR)  # wakes the reader thread
                except OSError:
                    pass
        if self._thread is not None:
            self._thread.join()  # the select loop returns as soon as the wake byte lands
        for s in (self._udp, self._tcp, self._wake_r, self._wake_w):
            if s is not None:
                s.close()


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


# --- client (tests and debugging) ---------------------------------------------------------

def query(server: str, name: str, qtype: int = TYPE_A, *, port: int = 53, tcp: bool = False,
          timeout: float = 2.0) -> tuple[int, list[str], bool]:
    """Ask ``server`` one question; return (rcode, A addresses, authoritative).

    ``timeout`` is the socket timeout of this one exchange.
    """
    qid = 0x5250
    msg = struct.pack("!6H", qid, 0x0100, 1, 0, 0, 0) + _question(name, qtype, CLASS_IN)
    family = socket.AF_INET
    if tcp:
        with socket.create_connection((server, port), timeout=timeout) as s:
            s.sendall(struct.pack("!H", len(msg)) + msg)
            head = _recv_exact(s, 2)
            if head is None:
                raise ConnectionError(f"{server}:{port} closed the TCP connection without answering")
            reply = _recv_exact(s, struct.unpack("!H", head)[0]) or b""
    else:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.settimeout(timeout)
            s.sendto(msg, (server, port))
            reply, _ = s.recvfrom(65535)
    rid, flags, qd, an, _, _ = struct.unpack("!6H", reply[:12])
    if rid != qid:
        raise ValueError(f"answer id {rid:#x} does not match query id {qid:#x}")
    pos = 12
    for _ in range(qd):
        _, pos = _read_name(reply, pos)
        pos += 4
    addrs = []
    for _ in range(an):
        _, pos = _read_name(reply, pos)
        rtype, _, _, rdlen = struct.unpack("!HHIH", reply[pos:pos + 10])
        pos += 10
        if rtype == TYPE_A and rdlen == 4:
            addrs.append(str(ipaddress.IPv4Address(reply[pos:pos + 4])))
        pos += rdlen
    return flags & 0xF, addrs, bool(flags & 0x0400)


def main(argv: list[str] | None = None) -> int:
    """``python -m clusters.embedded.podnet.dns NAME`` asks the cluster DNS from inside a pod."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("name")
    ap.add_argument("--server", default="198.19.0.10")
    ap.add_argument("--port", type=int, default=53)
    ap.add_argument("--tcp", action="store_true")
    ap.add_argument("--type", default="A", choices=["A", "AAAA", "ANY"])
    args = ap.parse_args(argv)
    qtype = {"A": TYPE_A, "AAAA": TYPE_AAAA, "ANY": TYPE_ANY}[args.type]
    rcode, addrs, aa = query(args.server, args.name, qtype, port=args.port, tcp=args.tcp)
    json.dump({"rcode": rcode, "addresses": addrs, "authoritative": aa}, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
