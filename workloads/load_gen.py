"""A bounded HTTP load generator for the Serve application.

Sends ``--rate`` requests per second for ``--duration`` seconds, round-robin
over ``--target`` URLs, with at most ``--concurrency`` requests in flight and a
per-request timeout.  Prints one JSON line per second (successes, failures and
latency percentiles of the requests *started* in that second) and a final
summary with availability, p50 and p99.  It always stops by itself: requests
still in flight at the end are waited for at most one request timeout.
SIGTERM ends it early the same way: no new requests, the seconds begun are
reported and the summary printed (``stopped_early``), so a caller can keep
load on until the event it measures is over.

Imports only the standard library, so it runs anywhere a client would.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

EVENT_MARKER = "RAYPROOF_EVENT"
PAYLOAD = json.dumps({"x": [0.1] * 16}).encode()


def emit(event: str, **fields) -> None:
    record = {"event": event, "ts": round(time.time(), 3), **fields}
    print(f"{EVENT_MARKER} {json.dumps(record, sort_keys=True)}", flush=True)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return round(ordered[index], 2)


def one_request(url: str, timeout_s: float) -> tuple[bool, float, str]:
    began = time.monotonic()
    try:
        req = urllib.request.Request(url, data=PAYLOAD, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = resp.read()
            ok = resp.status == 200 and b"class" in body
            err = "" if ok else f"HTTP {resp.status}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        ok, err = False, f"{type(exc).__name__}: {exc}"[:200]
    return ok, (time.monotonic() - began) * 1000, err


def run(targets: list[str], rate: float, duration: float, concurrency: int, timeout_s: float,
        stop: threading.Event | None = None) -> dict:
    seconds = int(duration)
    stop = stop or threading.Event()
    buckets = [{"ok": 0, "fail": 0, "lat": [], "errors": {}} for _ in range(seconds)]
    lock = threading.Lock()
    in_flight = threading.BoundedSemaphore(concurrency)
    skipped = 0

    def record(second: int, result: tuple[bool, float, str]) -> None:
        ok, ms, err = result
        with lock:
            b = buckets[second]
            if ok:
                b["ok"] += 1
                b["lat"].append(ms)
            else:
                b["fail"] += 1
                b["errors"][err] = b["errors"].get(err, 0) + 1

    start_wall = time.time()
    start = time.monotonic()
    interval = 1.0 / rate
    total = int(rate * seconds)
    pool = ThreadPoolExecutor(max_workers=concurrency)
    reported = 0
    for i in range(total):
        if stop.is_set():
            break
        due = start + i * interval
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # sleep-ok: pacing requests at a fixed rate
        second = min(int((due - start)), seconds - 1)
        # A second is printed once every request started in it has finished
        # or timed out, so its counts are final.
        while reported < second - int(timeout_s) - 1:
            reported = _report_second(buckets, reported, start_wall, lock)
        if not in_flight.acquire(blocking=False):
            # The server is not keeping up and the client is at its limit: a
            # request that cannot be sent counts as a failure, not a wait.
            record(second, (False, 0.0, "client concurrency limit reached"))
            skipped += 1
            continue
        url = targets[i % len(targets)]

        def task(url=url, second=second) -> None:
            try:
                record(second, one_request(url, timeout_s))
            finally:
                in_flight.release()

        pool.submit(task)
    pool.shutdown(wait=True)  # every request has its own timeout, so this is bounded
    stopped_early = stop.is_set()
    if stopped_early:  # only the seconds begun are reported
        seconds = min(seconds, int(time.monotonic() - start) + 1)
        buckets = buckets[:seconds]
    while reported < seconds:
        reported = _report_second(buckets, reported, start_wall, lock)

    ok = sum(b["ok"] for b in buckets)
    fail = sum(b["fail"] for b in buckets)
    lat = [ms for b in buckets for ms in b["lat"]]
    errors: dict[str, int] = {}
    for b in buckets:
        for k, v in b["errors"].items():
            errors[k] = errors.get(k, 0) + v
    summary = {
        "targets": targets, "rate": rate, "duration_s": seconds, "sent": ok + fail, "ok": ok, "failed": fail,
        "availability": round(ok / (ok + fail), 6) if ok + fail else None,
        "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99), "client_limited": skipped,
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
        "started": round(start_wall, 3), "wall_s": round(time.monotonic() - start, 2), "stopped_early": stopped_early,
    }
    emit("summary", **summary)
    return summary


def _report_second(buckets, index: int, start_wall: float, lock) -> int:
    with lock:
        b = buckets[index]
        emit("second", second=index, window_start=round(start_wall + index, 3), ok=b["ok"], fail=b["fail"],
             p50_ms=percentile(b["lat"], 50), p99_ms=percentile(b["lat"], 99))
    return index + 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", action="append", required=True, help="URL to POST to (repeatable)")
    p.add_argument("--rate", type=float, default=20.0, help="requests per second")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--timeout", type=float, default=2.0, help="per-request timeout in seconds")
    args = p.parse_args(argv)
    if args.rate <= 0 or args.duration < 1 or args.concurrency < 1 or args.timeout <= 0:
        p.error("--rate, --duration (>= 1), --concurrency and --timeout must be positive")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    summary = run(args.target, args.rate, args.duration, args.concurrency, args.timeout, stop)
    return 0 if summary["sent"] else 1


if __name__ == "__main__":
    sys.exit(main())
