"""A Redis load generator (redis-py) for the client host, and its host-side wrapper.

Debian has ``redis-benchmark`` but no per-second figures from it in a form worth
parsing, and no memtier_benchmark, so livemig brings a small client:

- ``load``: fill ``keys`` keys ``k:<i>`` with ``value``-byte values (deterministic
  from ``i``: half text-like, half random bytes, so memory looks like real data); a
  marker key says the dataset is complete, so a second run skips this;
- ``run``: ``clients`` connections, each doing ``reads`` % GETs of random ``k:`` keys
  (checked against the expected value) and the rest SETs of ``w:<i>`` keys (a write
  set of the same size, each write a new version the client remembers); one JSON line
  per second ``{"t", "ops", "errors", "disconnects", "lat_ms"}``;
- on SIGINT or the end of ``--seconds``: ``check`` reads every ``k:`` key and every
  ``w:`` key written, compares with what must be there, and prints
  ``{"check": {"keys": N, "bad": M, "missing": K}}``.

Run as ``python -m livemig.services.redisload --host H ...`` (inside the client's
network namespace).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from livemig.services.client import ClientSeries, LoadProcess, Tick

MARKER = "livemig:dataset"
BATCH = 500


def value_for(kind: str, i: int, version: int, size: int) -> bytes:
    """A deterministic value: a text-like half and a pseudo-random half."""
    seed = hashlib.blake2b(f"{kind}:{i}:{version}".encode(), digest_size=16).digest()
    rnd = random.Random(seed).randbytes(size - size // 2)
    text = (f"{kind}{i} v{version} row of a cache entry; " * (size // 32 + 1)).encode()
    return text[: size // 2] + rnd


class Load:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.ops = 0
        self.errors = 0
        self.disconnects = 0
        self.lat_sum = 0.0
        self.lat_n = 0
        self.written: dict[int, int] = {}  # w:<i> -> version last acknowledged
        self.unsure: dict[int, int] = {}  # w:<i> -> version sent when its reply was lost
        self.stop = asyncio.Event()

    def client(self) -> Any:
        import redis.asyncio as aioredis
        return aioredis.Redis(host=self.a.host, port=self.a.port, socket_timeout=30,
                              socket_connect_timeout=10)

    async def load(self) -> None:
        r = self.client()
        want = f"{self.a.keys}:{self.a.value}"
        if (await r.get(MARKER)) == want.encode():
            await r.aclose()
            return
        for start in range(0, self.a.keys, BATCH):
            pipe = r.pipeline(transaction=False)
            for i in range(start, min(start + BATCH, self.a.keys)):
                pipe.set(f"k:{i}", value_for("k", i, 0, self.a.value))
            await pipe.execute()
        await r.set(MARKER, want)
        await r.aclose()
        print(json.dumps({"loaded": self.a.keys}), flush=True)

    async def worker(self, seed: int) -> None:
        import redis.exceptions as rexc
        rng = random.Random(seed)
        r = self.client()
        version = 0
        own = max(1, (self.a.keys - seed + 1 + self.a.clients - 1) // self.a.clients)
        while not self.stop.is_set():
            t0 = time.perf_counter()
            pending: tuple[int, int] | None = None
            try:
                if rng.randrange(100) < self.a.reads:
                    i = rng.randrange(self.a.keys)
                    got = await r.get(f"k:{i}")
                    if got != value_for("k", i, 0, self.a.value):
                        self.errors += 1
                        print(json.dumps({"error": f"k:{i} has a wrong value"}), flush=True)
                else:
                    # connection n owns the w: keys i with i % clients == n - 1, so
                    # the last acknowledged write of a key is exactly known
                    i = rng.randrange(own) * self.a.clients + seed - 1
                    version += 1
                    pending = (i, version)
                    await r.set(f"w:{i}", value_for("w", i, version, self.a.value))
                    self.written[i] = version
                    pending = None
                self.ops += 1
                self.lat_sum += time.perf_counter() - t0
                self.lat_n += 1
            except (rexc.ConnectionError, rexc.TimeoutError, OSError) as e:
                self.disconnects += 1
                if pending is not None:  # the server may or may not have applied it
                    self.unsure[pending[0]] = pending[1]
                print(json.dumps({"error": f"connection: {e}"}), flush=True)
                await asyncio.sleep(0.2)
                r = self.client()

    async def reporter(self) -> None:
        last = 0
        next_t = time.monotonic() + 1.0
        while not self.stop.is_set():
            await asyncio.sleep(max(0.0, next_t - time.monotonic()))
            next_t += 1.0
            lat = 1000.0 * self.lat_sum / self.lat_n if self.lat_n else None
            self.lat_sum, self.lat_n = 0.0, 0
            print(json.dumps({"t": time.time(), "ops": self.ops - last, "errors": self.errors,
                              "disconnects": self.disconnects, "lat_ms": lat}), flush=True)
            last = self.ops

    async def check(self) -> dict[str, int]:
        r = self.client()
        bad = missing = 0
        for start in range(0, self.a.keys, BATCH):
            idx = range(start, min(start + BATCH, self.a.keys))
            for i, got in zip(idx, await r.mget([f"k:{i}" for i in idx]), strict=True):
                if got is None:
                    missing += 1
                elif got != value_for("k", i, 0, self.a.value):
                    bad += 1
        items = sorted(self.written.items())
        for start in range(0, len(items), BATCH):
            chunk = items[start:start + BATCH]
            got_all = await r.mget([f"w:{i}" for i, _ in chunk])
            for (i, v), got in zip(chunk, got_all, strict=True):
                if got is None:
                    missing += 1
                elif got != value_for("w", i, v, self.a.value) and not (
                        i in self.unsure
                        and got == value_for("w", i, self.unsure[i], self.a.value)):
                    bad += 1
        await r.aclose()
        return {"keys": self.a.keys + len(items), "bad": bad, "missing": missing}

    async def main(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop.set)
        await self.load()
        tasks = [asyncio.create_task(self.worker(n + 1)) for n in range(self.a.clients)]
        tasks.append(asyncio.create_task(self.reporter()))
        try:
            await asyncio.wait_for(self.stop.wait(), self.a.seconds)
        except TimeoutError:
            self.stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        print(json.dumps({"check": await self.check()}), flush=True)
        return 0


def parse_line(line: str, now: float, series: ClientSeries) -> None:
    """One JSON line of the generator (see the module doc)."""
    msg = json.loads(line)
    if "ops" in msg:
        series.ticks.append(Tick(now, float(msg["ops"]), msg.get("lat_ms")))
        series.errors = int(msg.get("errors", 0))
        series.disconnects = int(msg.get("disconnects", 0))
    elif "error" in msg:
        series.note(str(msg["error"]))
    elif "check" in msg:
        series.check = {k: int(v) for k, v in msg["check"].items()}


def command(python: str, host: str, keys: int, clients: int, value: int, reads: int,
            seconds: int = 3600) -> list[str]:
    return [python, "-m", "livemig.services.redisload", "--host", host, "--keys", str(keys),
            "--clients", str(clients), "--value", str(value), "--reads", str(reads),
            "--seconds", str(seconds)]


def start(prefix: list[str], host: str, keys: int, clients: int, value: int, reads: int,
          seconds: int = 3600) -> LoadProcess:
    lp = LoadProcess("redisload", prefix + command(sys.executable, host, keys, clients,
                                                   value, reads, seconds), parse_line)
    lp.start()
    return lp


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="livemig.services.redisload",
                                description="Redis load generator with per-second figures")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, default=6379)
    p.add_argument("--keys", type=int, default=200_000)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--value", type=int, default=1024)
    p.add_argument("--reads", type=int, default=80)
    p.add_argument("--seconds", type=float, default=3600.0)
    a = p.parse_args(argv)
    return asyncio.run(Load(a).main())


if __name__ == "__main__":
    sys.exit(main())
