"""Bounded memory pressure on a Ray head node, as a data job materialising objects there.

Reproduces the design's head-OOM incident: a driver on the head keeps
``ray.put``-ing chunks (held in the head's object store) and materialising
copies in its own heap, toward ``--target-bytes``.  It prints a progress line
per chunk with what it holds, so whoever ran it can tell how far it got when
the memory limit of the head's container killed it.  It stops by itself at the
target (exit 0) or after ``--max-seconds`` (exit 3).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

EVENT_MARKER = "RAYPROOF_EVENT"


def emit(event: str, **fields) -> None:
    record = {"event": event, "ts": round(time.time(), 3), **fields}
    print(f"{EVENT_MARKER} {json.dumps(record, sort_keys=True)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target-bytes", type=int, required=True)
    p.add_argument("--chunk-bytes", type=int, default=16 * 2**20)
    p.add_argument("--object-store-share", type=float, default=0.25,
                   help="fraction of chunks also put in the object store (0 = heap only)")
    p.add_argument("--max-seconds", type=float, default=300)
    p.add_argument("--no-ray", action="store_true", help="heap only, without connecting to Ray")
    p.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS", "auto"))
    args = p.parse_args(argv)
    if args.target_bytes <= 0 or args.chunk_bytes <= 0 or not 0 <= args.object_store_share <= 1:
        p.error("--target-bytes and --chunk-bytes must be positive, --object-store-share within [0, 1]")

    ray = None
    if not args.no_ray:
        import ray as ray_module

        ray_module.init(address=args.ray_address, log_to_driver=False)
        ray = ray_module
    emit("pressure_start", target_bytes=args.target_bytes, chunk_bytes=args.chunk_bytes, pid=os.getpid())
    heap: list[bytearray] = []
    refs = []
    heap_bytes = store_bytes = 0
    began = time.monotonic()
    every = round(1 / args.object_store_share) if args.object_store_share else 0
    index = 0
    while heap_bytes + store_bytes < args.target_bytes:
        if time.monotonic() - began > args.max_seconds:
            emit("pressure_gave_up", heap_bytes=heap_bytes, object_store_bytes=store_bytes)
            return 3
        chunk = bytearray(os.urandom(1024)) * (args.chunk_bytes // 1024)  # every page touched
        index += 1
        if ray is not None and every and index % every == 0:
            refs.append(ray.put(bytes(chunk)))
            store_bytes += len(chunk)
        heap.append(chunk)
        heap_bytes += len(chunk)
        emit("pressure", held_bytes=heap_bytes + store_bytes, heap_bytes=heap_bytes,
             object_store_bytes=store_bytes, seconds=round(time.monotonic() - began, 2))
    emit("pressure_target_reached", held_bytes=heap_bytes + store_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
