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

``python -m clusters.embedded.nodes.oomgroup --ctr PATH --address SOCKET``
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Sequence

from rayproof.processes import die_with_parent

OOM_TOPIC = "/tasks/oom"
KILL_TIMEOUT_S = 30.0


def oom_event(line: str) -> tuple[str, str] | None:
    """``(namespace, container id)`` of a ``ctr events`` line reporting an OOM kill, else None.

    A line is the event's timestamp (several words), its namespace, its topic
    and the event as JSON: ``2026-12-05 07:30:00.1 +0000 UTC k8s.io /tasks/oom {"container_id":"..."}``.
    """
    words = line.split()
    if OOM_TOPIC not in words[1:]:
        return None
    at = words.index(OOM_TOPIC, 1)
    try:
        event = json.loads(" ".join(words[at + 1:]) or "{}")
    except ValueError:
        return None
    container = event.get("container_id") if isinstance(event, dict) else None
    return (words[at - 1], container) if container else None


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
    for line in events.stdout:
        found = oom_event(line)
        if found is None:
            continue
        namespace, container = found
        done = kill_container(ctr, namespace, container)
        outcome = "killed" if done.returncode == 0 else f"kill failed ({done.returncode}): {done.stderr.strip()}"
        print(f"OOM kill in container {namespace}/{container}: its other processes {outcome}", flush=True)
    code = events.wait()
    print(f"ctr events ended (exit {code}); containers over their memory limit keep running on without "
          "the process the kernel killed", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
