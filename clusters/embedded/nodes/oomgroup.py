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
with exit code 137, exactly as on cgroup v2. The node agent does the same for
its containers (``nodeagent/containers.py``).

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
from typing import Sequence

from core.processes import die_with_parent

OOM_TOPIC, CREATE_TOPIC, START_TOPIC, EXIT_TOPIC, DELETE_TOPIC = (
    "/tasks/oom", "/tasks/create", "/tasks/start", "/tasks/exit", "/tasks/delete")
KILL_TIMEOUT_S = 30.0

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


class OomGroup:
    """Which containers to kill, from containerd's task events in their order."""

    def __init__(self) -> None:
        self.starting: set[Container] = set()  # created, not yet reported started
        self.oom_while_starting: set[Container] = set()

    def on_event(self, topic: str, container: Container) -> list[Container]:
        """The containers to kill now, on ``topic`` about ``container``."""
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
        return []


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
    group = OomGroup()
    for line in events.stdout:
        found = task_event(line)
        if found is None:
            continue
        topic, container = found
        kills = group.on_event(topic, container)
        if topic == OOM_TOPIC and not kills:
            print(f"OOM kill in container {'/'.join(container)} while it starts: the rest is killed once "
                  "it has started", flush=True)
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
