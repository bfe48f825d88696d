"""Throughput of the reward-model server: dynamic batching vs one request per item.

    .venv/bin/python benchmarks/bench_rm_batching.py [--clients 32] [--items 2000] [--call-ms 5] [--item-ms 0.05]

Starts two servers as subprocesses on free loopback ports, each with a scorer that
simulates a model whose cost is mostly per call (sleeps ``call_ms`` per ``score_batch``
plus ``item_ms`` per item, like a GPU forward dominated by launch and weight reads):

- server A: dynamic batching (``--max-batch-size``, ``--max-wait-ms``);
- server B: ``max_batch_size=1``, the control (concurrency without batching).

and prints scored items/s for (1) one client sending one item per request sequentially
to A, (2) ``--clients`` concurrent clients sending one item per request to B, (3) the same
to A, with A's batch statistics and the ratios, from one run.

Simplified on purpose: the scorer sleeps instead of running a model, so the numbers show
the serving overhead and the batching gain, not a real RM's speed; the clients are
Python threads on the same machine, so on a small machine client-side CPU limits the
batched number.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from nemo_rlhf.reward.batching import ScoreItem  # noqa: E402
from nemo_rlhf.reward.client import RewardModelClient  # noqa: E402


class SimulatedScorer:
    """Sleeps ``call_ms + item_ms * len(items)`` ms per call; score = len(response)."""

    vocab_size = None

    def __init__(self, call_ms: float, item_ms: float) -> None:
        self.call_ms, self.item_ms = call_ms, item_ms

    def score_batch(self, items: list[ScoreItem]) -> list[float]:
        time.sleep((self.call_ms + self.item_ms * len(items)) / 1000.0)
        return [float(len(it.response)) for it in items]

    def metadata(self) -> dict:
        return {"model_name": "simulated", "call_ms": self.call_ms, "item_ms": self.item_ms}


def _serve(args: argparse.Namespace) -> None:
    from nemo_rlhf.reward.server import RMServerConfig, serve

    cfg = RMServerConfig(max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms, address_file=args.address_file)
    serve(lambda: SimulatedScorer(args.call_ms, args.item_ms), cfg)


def _start(args: argparse.Namespace, tmp: str, name: str, max_batch_size: int) -> tuple[subprocess.Popen, RewardModelClient]:
    addr = os.path.join(tmp, f"{name}.addr")
    cmd = [sys.executable, os.path.abspath(__file__), "--serve", "--address-file", addr,
           "--call-ms", str(args.call_ms), "--item-ms", str(args.item_ms),
           "--max-batch-size", str(max_batch_size), "--max-wait-ms", str(args.max_wait_ms)]
    proc = subprocess.Popen(cmd)
    return proc, RewardModelClient.from_address_file(addr, wait_s=60)


def _item(i: int) -> ScoreItem:
    return ScoreItem(prompt=f"prompt {i}", response="r" * (i % 50))


def _sequential(url: str, n: int) -> float:
    with RewardModelClient(url) as c:
        t0 = time.perf_counter()
        for i in range(n):
            c.score([_item(i)])
        return n / (time.perf_counter() - t0)


def _concurrent(url: str, n: int, clients: int) -> float:
    lock = threading.Lock()
    next_i = [0]
    errors: list[BaseException] = []
    start = threading.Barrier(clients + 1)

    def worker() -> None:
        with RewardModelClient(url) as c:
            start.wait()
            while True:
                with lock:
                    i = next_i[0]
                    next_i[0] += 1
                if i >= n:
                    return
                try:
                    assert c.score([_item(i)]) == [float(i % 50)]
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)
                    return

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return n / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=32, help="concurrent clients for the batched run")
    p.add_argument("--items", type=int, default=2000, help="items scored in each concurrent run")
    p.add_argument("--sequential-items", type=int, default=300, help="items scored in the sequential run")
    p.add_argument("--call-ms", type=float, default=5.0, help="simulated cost per score_batch call, ms")
    p.add_argument("--item-ms", type=float, default=0.05, help="simulated cost per item, ms")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--max-wait-ms", type=float, default=2.0)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--address-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        _serve(args)
        return

    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            proc_a, batched = _start(args, tmp, "batched", args.max_batch_size)
            procs.append(proc_a)
            proc_b, unbatched = _start(args, tmp, "unbatched", 1)
            procs.append(proc_b)
            batched.wait_until_healthy(60)
            unbatched.wait_until_healthy(60)
            _sequential(batched.url, 20)  # warm up connections and code paths

            seq = _sequential(batched.url, args.sequential_items)
            conc_unbatched = _concurrent(unbatched.url, args.items, args.clients)
            before = batched.stats()
            conc_batched = _concurrent(batched.url, args.items, args.clients)
            after = batched.stats()
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(10)
    batches = after["batches"] - before["batches"]
    items = after["items_scored"] - before["items_scored"]
    print(f"simulated scorer: {args.call_ms} ms per call + {args.item_ms} ms per item; "
          f"server A max_batch_size={args.max_batch_size} max_wait_ms={args.max_wait_ms}; {os.cpu_count()} CPUs")
    print(f"{'mode':<52} {'items/s':>9}")
    print(f"{'sequential, 1 client, 1 item/request (A)':<52} {seq:>9.1f}")
    print(f"{f'{args.clients} concurrent clients, no batching (B, batch=1)':<52} {conc_unbatched:>9.1f}")
    print(f"{f'{args.clients} concurrent clients, dynamic batching (A)':<52} {conc_batched:>9.1f}")
    print(f"A grouped {items} items into {batches} score_batch calls ({items / max(batches, 1):.1f} items/call, "
          f"largest {after['largest_batch']})")
    print(f"ratio dynamic batching / sequential:          {conc_batched / seq:.1f}x")
    print(f"ratio dynamic batching / concurrent unbatched: {conc_batched / conc_unbatched:.1f}x")


if __name__ == "__main__":
    main()
