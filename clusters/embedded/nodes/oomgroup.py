"""``memory.oom.group`` for a real node on cgroup v1: an OOM kill ends the whole container.

On cgroup v2, kubelet (since 1.28) has the kernel kill every process of a
container once it OOM-kills one of them (``memory.oom.group``), so a container
over its memory limit ends ``OOMKilled``, exit 137, and restarts. Cgroup v1 has
no such group: the kernel kills one process (the one it scores highest; Ray
gives its workers ``oom_score_adj`` 1000) and the container lives on without
it, which is not what any cluster on cgroup v2 does, and on this machine's
cgroup v1 the head-OOM clauses' fault would never end the head.

This program runs in a node's namespaces beside its containerd and does what
the kernel would do on v2: it follows containerd's events (``ctr events``),
and on each ``/tasks/oom`` (containerd's runc shim watches every container's
v1 ``memory.oom_control`` for it) kills every process of that container through
containerd (``ctr task kill --all --signal SIGKILL``). containerd already
recorded the OOM, so kubelet reports the container's end as ``OOMKilled``
with exit code 137, exactly as on cgroup v2.

Cgroup v1 reports an OOM to every memory cgroup under the one at its limit.
A pod's cgroup has the sum of its containers' limits, and holds the pause
container too, so when the pod's cgroup is the one at its limit, the OOM is
reported for every container of the pod, the pause container among them. On
cgroup v2 the kernel kills the group of the process it chose (the container's
cgroup, ``memory.oom.group``), never the pod's other containers or its
sandbox. Killing every container reported killed the pause container too:
the pod lost its sandbox, and a container starting then ended ``StartError``
("sandbox container ... is not running"; 17 sandboxes killed in 48 OOMs of
pods of one container on a loaded machine). So a container is killed only
where the kernel's kill was its own: its memory cgroup's ``oom_kill`` count
(``memory.oom_control``, counted in the victim's cgroup and its ancestors,
never its siblings) has risen since the last time this program looked. The
kernel reports the OOM before it kills, so the count is read until it rises
or ``oom_kill_counted`` runs out.

The shim watches a container's ``memory.oom_control`` from its creation, so
an OOM can be reported while the container's start is still under way. A
container whose command OOMed at once, killed at that event, once ended
``StartError`` (exit 128) instead of ``OOMKilled`` (1 run in 4 on a loaded
machine; not seen again in four at once on an idle one). A container created
while this program follows the events is killed only once the shim has
reported it started (``/tasks/start``, which the shim sends once its start
has succeeded); an OOM before that waits for it. The kernel's group kill on
cgroup v2 has no such window.

``python -m clusters.embedded.nodes.oomgroup --ctr PATH --address SOCKET``
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

from core import timeouts
from core.processes import die_with_parent
from core.waiting import WaitTimeout, wait_for

OOM_TOPIC, CREATE_TOPIC, START_TOPIC, EXIT_TOPIC, DELETE_TOPIC = (
    "/tasks/oom", "/tasks/create", "/tasks/start", "/tasks/exit", "/tasks/delete")
KILL_TIMEOUT_S = 30.0
MEMORY_HIERARCHY = Path("/sys/fs/cgroup/memory")  # cgroup v1's memory controller

Container = tuple[str, str]  # (containerd namespace, container id)


def task_event(line: str) -> tuple[str, Container] | None:
    """``(topic, (namespace, container id))`` of a ``ctr events`` line about a task, else None.

    A line is the event's timestamp (several words), its namespace, its topic
    and the event as JSON: ``2026-12-05 07:30:00.1 +0000 UTC k8s.io /tasks/oom {"container_id":"..."}``.
    An exec'd process's exit (a probe's, ``kubectl exec``'s) is not its container's and reads as None.
    """
    words = line.split()
    at = next((i for i, w in enumerate(words) if i > 0 and w.startswith("/tasks/")), None)
    if at is None:
        return None
    try:
        event = json.loads(" ".join(words[at + 1:]) or "{}")
    except ValueError:
        return None
    container = event.get("container_id") if isinstance(event, dict) else None
    if not container or (words[at] == EXIT_TOPIC and event.get("id", container) != container):
        return None
    return words[at], (words[at - 1], container)


def oom_kills(cgroup: Path) -> int | None:
    """The kernel's ``oom_kill`` count of a v1 memory cgroup (None: it is gone)."""
    try:
        text = (cgroup / "memory.oom_control").read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) for line in text.splitlines() if line.startswith("oom_kill ")), None)


def memory_cgroup(ctr: Sequence[str], namespace: str, container: str) -> Path | None:
    """The v1 memory cgroup of ``container``, from its OCI spec's ``cgroupsPath`` (kubelet's cgroupfs
    driver: a path in each hierarchy); None where containerd no longer has it."""
    done = subprocess.run([*ctr, "-n", namespace, "containers", "info", container], capture_output=True, text=True,
                          timeout=KILL_TIMEOUT_S)
    if done.returncode != 0:
        return None
    path = ((json.loads(done.stdout).get("Spec") or {}).get("linux") or {}).get("cgroupsPath") or ""
    return MEMORY_HIERARCHY / path.lstrip("/") if path.startswith("/") else None


class OomGroup:
    """Which containers to kill, from containerd's task events in their order.

    ``own_kill(container, last_count)`` says whether the kernel's OOM kill was
    in ``container``'s own memory cgroup: ``(yes, the count now)``."""

    def __init__(self, own_kill: Callable[[Container, int], tuple[bool, int]]) -> None:
        self.own_kill = own_kill
        self.starting: set[Container] = set()  # created, not yet reported started
        self.oom_while_starting: set[Container] = set()
        self.kills_counted: dict[Container, int] = {}  # each container's oom_kill count when last looked at

    def on_event(self, topic: str, container: Container) -> list[Container]:
        """The containers to kill now, on ``topic`` about ``container``."""
        if topic == OOM_TOPIC:
            own, self.kills_counted[container] = self.own_kill(container, self.kills_counted.get(container, 0))
            if not own:  # reported as a cgroup under the pod's, at its limit: the kill was another container's
                return []
        if topic == CREATE_TOPIC:
            self.starting.add(container)
        elif topic == START_TOPIC:
            self.starting.discard(container)
            if container in self.oom_while_starting:
                self.oom_while_starting.discard(container)
                return [container]
        elif topic == OOM_TOPIC:
            if container in self.starting:  # its start is under way: killed now, the start would fail
                self.oom_while_starting.add(container)
                return []
            return [container]  # started, or created before this program followed the events
        elif topic in (EXIT_TOPIC, DELETE_TOPIC):
            self.starting.discard(container)
            self.oom_while_starting.discard(container)
            if topic == DELETE_TOPIC:
                self.kills_counted.pop(container, None)
        return []


def counted_kill(ctr: Sequence[str]) -> Callable[[Container, int], tuple[bool, int]]:
    """``own_kill`` for :class:`OomGroup`, from the container's memory cgroup: its ``oom_kill`` count
    rising past ``last`` within ``oom_kill_counted``. A container whose cgroup cannot be found is
    killed, as before this check (it is gone, or not kubelet's)."""
    def own_kill(container: Container, last: int) -> tuple[bool, int]:
        cgroup = memory_cgroup(ctr, *container)
        if cgroup is None or oom_kills(cgroup) is None:
            return True, last
        try:
            count = wait_for(lambda: oom_kills(cgroup), lambda n: n is None or n > last,
                             timeout=timeouts.OOM_KILL_COUNTED, interval=0.05,
                             description=f"the kernel to count an OOM kill in {cgroup} (past {last})")
        except WaitTimeout as exc:
            return False, exc.last_value if isinstance(exc.last_value, int) else last
        return count is not None, count if count is not None else last
    return own_kill


def kill_container(ctr: Sequence[str], namespace: str, container: str) -> subprocess.CompletedProcess[str]:
    """SIGKILL every process of ``container``'s task (runc signals its whole cgroup)."""
    return subprocess.run([*ctr, "-n", namespace, "task", "kill", "--all", "--signal", "SIGKILL", container],
                          capture_output=True, text=True, timeout=KILL_TIMEOUT_S)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ctr", required=True, help="the ctr binary")
    p.add_argument("--address", required=True, help="containerd's socket")
    args = p.parse_args(argv)
    ctr = [args.ctr, "--address", args.address]
    me = os.getpid()
    events = subprocess.Popen([*ctr, "events"], stdout=subprocess.PIPE, text=True, bufsize=1,
                              preexec_fn=lambda: die_with_parent(me))
    print(f"following containerd's events at {args.address} (ctr pid {events.pid})", flush=True)
    assert events.stdout is not None
    group = OomGroup(counted_kill(ctr))
    for line in events.stdout:
        found = task_event(line)
        if found is None:
            continue
        topic, container = found
        kills = group.on_event(topic, container)
        if topic == OOM_TOPIC and not kills:
            print(f"OOM in container {'/'.join(container)}: " + (
                "killed in it while it starts: the rest is killed once it has started"
                if container in group.oom_while_starting else
                "reported under its pod's cgroup at its limit, the kill another container's: left running"), flush=True)
        for namespace, killed in kills:
            done = kill_container(ctr, namespace, killed)
            outcome = "killed" if done.returncode == 0 else f"kill failed ({done.returncode}): {done.stderr.strip()}"
            print(f"OOM kill in container {namespace}/{killed}: its other processes {outcome}", flush=True)
    code = events.wait()
    print(f"ctr events ended (exit {code}); containers over their memory limit keep running on without "
          "the process the kernel killed", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
