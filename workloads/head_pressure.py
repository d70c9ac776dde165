"""Bounded memory pressure on a Ray head node, as a data job materialising objects there.

Reproduces the design's head-OOM incident: a driver on the head keeps
materialising blocks of ``--chunk-bytes`` in its own heap and ``ray.put``-ing
a share of them (held in the head's object store), toward ``--target-bytes``.
It prints a progress line per block with what it holds, so whoever ran it can
tell how far it got when the memory limit of the head's container killed it.
It stops by itself at the target (exit 0) or after ``--max-seconds`` (exit 3).

The pressure runs in a child process of its own session, which the command
waits for and whose end it reports (137 when the kernel killed it). That is
memory on the head Ray cannot take back, as when the GCS itself grows: Ray's
memory monitor, which sees the head's cgroup limit on a real node, kills Ray
workers -- among them the job's supervisor, whose death kills its driver's
process group -- but never this child, so the head's memory limit is what
ends it. Without a limit it still stops at the target or ``--max-seconds``.

Each block's pages are written by the kernel in one call
(``madvise(MADV_POPULATE_WRITE)``), no code of the program running between
them. At its memory limit a container's kernel reclaims the file pages the
head's processes run from before it OOM-kills anything; written page by page
between Python steps, a block let those processes fault their pages back in as
fast as they were reclaimed, and a head with Serve's busy processes on it was
seen thrashing at its limit for minutes (6.5 million failed charges) with no
OOM kill.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time
import traceback
from typing import Callable

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

EVENT_MARKER = "RAYPROOF_EVENT"
MADV_POPULATE_WRITE = 23  # Linux 5.14 on; Python 3.11's mmap module does not name it


def emit(event: str, **fields) -> None:
    record = {"event": event, "ts": round(time.time(), 3), **fields}
    print(f"{EVENT_MARKER} {json.dumps(record, sort_keys=True)}", flush=True)


def materialise(size: int) -> mmap.mmap:
    """``size`` bytes of anonymous memory with every page written: by the kernel in one
    ``madvise`` where it can, else one write per page."""
    block = mmap.mmap(-1, size)
    try:
        block.madvise(MADV_POPULATE_WRITE)
    except OSError:  # a kernel before 5.14
        for offset in range(0, size, mmap.PAGESIZE):
            block[offset] = 1
    return block


def in_own_session(work: Callable[[], int]) -> int:
    """Run ``work`` in a forked child that starts a session of its own; wait for it and
    return its exit code (128 + the signal when a signal ended it)."""
    child = os.fork()
    if child == 0:
        code = 1
        try:
            os.setsid()
            code = work()
        except BaseException:  # noqa: BLE001 - reported here, as the child never returns
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target-bytes", type=int, required=True)
    p.add_argument("--chunk-bytes", type=int, default=256 * 2**20)
    p.add_argument("--object-store-share", type=float, default=0.25,
                   help="fraction of blocks put in the object store rather than held in the heap (0 = heap only)")
    p.add_argument("--max-seconds", type=float, default=300)
    p.add_argument("--no-ray", action="store_true", help="heap only, without connecting to Ray")
    p.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS", "auto"))
    args = p.parse_args(argv)
    if args.target_bytes <= 0 or args.chunk_bytes <= 0 or not 0 <= args.object_store_share <= 1:
        p.error("--target-bytes and --chunk-bytes must be positive, --object-store-share within [0, 1]")
    return in_own_session(lambda: pressure(args))


def pressure(args: argparse.Namespace) -> int:
    """Hold memory toward ``args.target_bytes``; 0 at the target, 3 after ``args.max_seconds``."""
    ray = None
    if not args.no_ray:
        import ray as ray_module

        ray_module.init(address=args.ray_address, log_to_driver=False)
        ray = ray_module
    emit("pressure_start", target_bytes=args.target_bytes, chunk_bytes=args.chunk_bytes, pid=os.getpid())
    heap: list[mmap.mmap] = []
    refs = []
    heap_bytes = store_bytes = 0
    began = time.monotonic()
    every = round(1 / args.object_store_share) if args.object_store_share else 0
    index = 0
    while heap_bytes + store_bytes < args.target_bytes:
        if time.monotonic() - began > args.max_seconds:
            emit("pressure_gave_up", heap_bytes=heap_bytes, object_store_bytes=store_bytes)
            return 3
        block = materialise(args.chunk_bytes)
        index += 1
        if ray is not None and every and index % every == 0:
            refs.append(ray.put(block.read()))  # a copy in the object store
            block.close()
            store_bytes += args.chunk_bytes
        else:
            heap.append(block)
            heap_bytes += args.chunk_bytes
        emit("pressure", held_bytes=heap_bytes + store_bytes, heap_bytes=heap_bytes,
             object_store_bytes=store_bytes, seconds=round(time.monotonic() - began, 2))
    emit("pressure_target_reached", held_bytes=heap_bytes + store_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
