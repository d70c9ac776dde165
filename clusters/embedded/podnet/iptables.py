"""Rule sets as data, rendered for ``iptables-restore --noflush``.

The pod network owns only chains named ``RAYPROOF-*``.  A compiler returns a
:class:`Table` (chain name -> rules); :func:`render` turns it into one restore
transaction that (1) declares every wanted chain, which creates or flushes it,
(2) declares and then deletes every ``RAYPROOF-*`` chain of that table that is
no longer wanted, and (3) fills the wanted chains.  The kernel swaps the whole
table at COMMIT, so a half-written rule set is never live, and chains that
other tools own are never touched (``--noflush``).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

PREFIX = "RAYPROOF-"
# iptables allows chain names of at most 28 characters.
MAX_CHAIN = 28


def chain_name(kind: str, *parts: str) -> str:
    """A stable, short chain name for ``parts`` (kube-proxy's hashed KUBE-SVC-… style)."""
    digest = hashlib.sha256("\x00".join(parts).encode()).hexdigest()
    name = f"{PREFIX}{kind}-"
    return name + digest[: MAX_CHAIN - len(name)].upper()


def comment(text: str) -> str:
    """An ``-m comment`` match, quoted for iptables-restore (which splits like a shell)."""
    safe = text.replace('"', "'")[:250]
    return f'-m comment --comment "{safe}"'


@dataclass
class Table:
    """Wanted content of the ``RAYPROOF-*`` chains of one iptables table."""

    name: str
    chains: dict[str, list[str]] = field(default_factory=dict)

    def chain(self, name: str) -> list[str]:
        if len(name) > MAX_CHAIN:
            raise ValueError(f"iptables chain name {name!r} is longer than {MAX_CHAIN} characters")
        return self.chains.setdefault(name, [])

    def add(self, chain: str, rule: str) -> None:
        self.chain(chain).append(rule)

    def rules(self) -> list[str]:
        """``-A chain rule`` lines, in order: what unit tests compare against."""
        return [f"-A {c} {r}" for c, rules in self.chains.items() for r in rules]


def render(table: Table, existing: set[str] = frozenset()) -> str:  # type: ignore[assignment]
    """iptables-restore input that makes the ``RAYPROOF-*`` chains of ``table.name`` equal ``table``.

    ``existing`` is the set of ``RAYPROOF-*`` chains that are in the kernel
    now (from :func:`clusters.embedded.podnet._host.chains_in`).
    """
    wanted = list(table.chains)
    stale = sorted(set(existing) - set(wanted))
    lines = [f"*{table.name}"]
    lines += [f":{c} - [0:0]" for c in wanted + stale]
    lines += table.rules()
    lines += [f"-X {c}" for c in stale]
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"
