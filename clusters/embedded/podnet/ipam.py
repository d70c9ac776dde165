"""File-backed pod IP allocator, safe across processes and restarts.

The node agent may be restarted while its pods live on; if the allocator were
in memory a new agent would hand out an address that a running pod still has.
So allocations live in ``<state_dir>/ipam.json`` under an exclusive ``flock``
of ``<state_dir>/ipam.lock``, and every call reads and rewrites the file.
Like host-local IPAM (CNI), allocation continues after the last address
handed out rather than taking the lowest free one, so a just-released address
(whose conntrack entries and ARP caches may linger) is reused as late as
possible.
"""
from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
from pathlib import Path
from typing import Iterator


class AddressesExhausted(RuntimeError):
    """Every address of the pod range is allocated."""


class IPAM:
    """Allocates one /32 per pod key from ``cidr``, skipping ``reserved`` addresses."""

    def __init__(self, state_dir: str | Path, cidr: str, reserved: tuple[str, ...] = ()):
        self.dir = Path(state_dir)
        self.net = ipaddress.ip_network(cidr)
        self.reserved = {ipaddress.ip_address(a) for a in reserved}
        self.reserved.update({self.net.network_address, self.net.broadcast_address})
        self._file = self.dir / "ipam.json"
        self._lock = self.dir / "ipam.lock"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict]:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self._lock, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                state = json.loads(self._file.read_text()) if self._file.exists() else {}
            except json.JSONDecodeError as exc:
                raise RuntimeError(f"pod IP allocations in {self._file} are corrupt ({exc}); "
                                   "delete the file only if no pod of this platform is running") from exc
            state.setdefault("cidr", str(self.net))
            state.setdefault("allocations", {})
            if state["cidr"] != str(self.net):
                raise ValueError(f"{self._file} holds allocations from {state['cidr']}, not {self.net}")
            before = json.dumps(state, sort_keys=True)
            yield state
            if json.dumps(state, sort_keys=True) != before:
                tmp = self._file.with_suffix(".tmp")
                tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
                os.replace(tmp, self._file)  # readers never see half a file

    def allocate(self, key: str) -> str:
        """The address of ``key``: the one it already has, or the next free one."""
        with self._locked() as state:
            allocs: dict[str, str] = state["allocations"]
            if key in allocs:
                return allocs[key]
            used = {ipaddress.ip_address(a) for a in allocs.values()} | self.reserved
            size = self.net.num_addresses
            last = state.get("last")
            start = (int(ipaddress.ip_address(last)) - int(self.net.network_address) + 1) if last else 0
            for step in range(size):
                candidate = self.net.network_address + (start + step) % size
                if candidate not in used:
                    allocs[key] = str(candidate)
                    state["last"] = str(candidate)
                    return str(candidate)
            raise AddressesExhausted(f"all {size} addresses of {self.net} are allocated")

    def release(self, key: str) -> str | None:
        """Free ``key``'s address; return it, or None when it had none (safe to repeat)."""
        with self._locked() as state:
            return state["allocations"].pop(key, None)

    def lookup(self, key: str) -> str | None:
        with self._locked() as state:
            return state["allocations"].get(key)

    def allocations(self) -> dict[str, str]:
        with self._locked() as state:
            return dict(state["allocations"])
