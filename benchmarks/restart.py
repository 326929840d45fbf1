"""A worker of ``serve --workers 2`` SIGKILLed under load: what the store and the host's
Prometheus counters see while the supervisor restarts it.

One S3 server on loopback (SeaweedFS, or moto with ``--s3 moto``) behind the counting proxy
(``s3proxy.py``), a seeded dataset, and ``serve --workers 2`` reading it through the proxy,
warmed until an epoch reads nothing from the store. Then ``--threads`` clients send random
batches through the public port while a scraper reads the public ``/metrics`` every
``--scrape-every`` seconds; the worker that served the most is SIGKILLed, and the load goes
on until it serves again (after the supervisor's ``--restart-pause``, if given; the
service's default if not) and ``--after`` seconds more.

Printed: the store's GETs (counted by the proxy) while the worker was down and after, the
blocks the survivor read from the dead worker's files, the scrapes in which a counter or
histogram sample of the host went down (what Prometheus reads as a reset) with the largest
drop of ``shardfeed_samples_served_total``, and that total at the end against the samples
the clients received (a batch a dying worker was sending is sent again by another).

    python -m shardfeed.benchmarks.restart --samples 4000 --size 10KiB --restart-pause 3 --memory-cache 0
"""

from __future__ import annotations

import os
import random
import signal
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from shardfeed.benchmarks.common import (
    BENCH_DATA,
    Digests,
    WrongBytes,
    benchmark_parser,
    load_note,
    seeded_s3,
    seeded_s3_arguments,
)
from shardfeed.benchmarks.s3proxy import start_proxy
from shardfeed.client import Client
from shardfeed.process import child_pids, healthy, scrape_metrics, start_service
from shardfeed.seeds.synthetic import DEFAULT_FIELDS, parse_sizes

DATASET = "bench"


class Scraper(threading.Thread):
    """Scrapes ``url/metrics`` until stopped; counts the scrapes in which a counter or
    histogram sample went down from the highest value seen before."""

    def __init__(self, url: str, every: float):
        super().__init__(daemon=True)
        self.url, self.every = url, every
        self.highest: dict[tuple, float] = {}
        self.scrapes = self.dips = 0
        self.largest_drop = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self.stop.wait(self.every):
                try:
                    text = http.get(f"{self.url}/metrics").text
                except httpx.TransportError:
                    continue
                dipped = False
                for family in text_string_to_metric_families(text):
                    if family.type not in ("counter", "histogram"):
                        continue
                    for sample in family.samples:
                        key = (sample.name, tuple(sorted(sample.labels.items())))
                        before = self.highest.get(key, 0.0)
                        if sample.value < before:
                            dipped = True
                            if sample.name == "shardfeed_samples_served_total":
                                self.largest_drop = max(self.largest_drop, before - sample.value)
                        self.highest[key] = max(before, sample.value)
                self.scrapes += 1
                self.dips += dipped


def _load(url: str, digests: Digests, batch: int, stop: threading.Event, received: list[int], seed: int) -> None:
    rng = random.Random(seed)
    with Client(url, route=False) as client:  # the public port only: any worker, as a plain HTTP client
        while not stop.is_set():
            asked = rng.sample(range(digests.samples), batch)
            try:
                received.append(digests.check_batch(asked, client.get_batch(DATASET, asked)))
            except WrongBytes as wrong:
                received.append(-1)  # flagged: main() refuses the run
                print(f"wrong answer: {wrong}", file=sys.stderr)
                return


def _sibling_reads(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "shardfeed_sibling_blocks_total" and s.labels.get("result") == "read")


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, __spec__.name)
    seeded_s3_arguments(parser, samples=4000, shard_size="2MiB")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="clients sending batches (default: %(default)s)")
    parser.add_argument("--restart-pause", type=float, help="passed to serve (default: the service's)")
    parser.add_argument("--memory-cache", help="passed to serve (default: the service's); with 0 every warm "
                                               "block is read from the slabs, its owner's or, while it is "
                                               "down, a sibling's")
    parser.add_argument("--after", type=float, default=2.0, help="seconds of load after the restart")
    parser.add_argument("--scrape-every", type=float, default=0.1, help="seconds between scrapes")
    args = parser.parse_args(argv)
    for flag, value in (("--samples", args.samples), ("--batch", args.batch), ("--threads", args.threads)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, not {value}")
    if args.batch > args.samples:
        parser.error(f"--batch must be at most --samples ({args.samples}), not {args.batch}")
    print(f"{args.samples} samples of {args.size} in shards of {args.shard_size}, batch {args.batch}, "
          f"{args.threads} clients, restart pause {args.restart_pause or 'default'}, memory cache "
          f"{args.memory_cache or 'default'}; {load_note()}")
    digests = Digests(args.samples, parse_sizes(args.size), DEFAULT_FIELDS)
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        s3 = stack.enter_context(seeded_s3(args.s3, args.samples, args.size, args.shard_size))
        proxy = stack.enter_context(start_proxy(s3.env()["AWS_ENDPOINT_URL"]))
        serve = [*([] if args.restart_pause is None else ["--restart-pause", str(args.restart_pause)]),
                 *([] if args.memory_cache is None else ["--memory-cache", args.memory_cache])]
        service = stack.enter_context(start_service(
            {DATASET: BENCH_DATA}, cache_dir=Path(tmp) / "cache", workers=2, args=serve,
            env={**s3.env(), "AWS_ENDPOINT_URL": proxy.url}))
        urls = [w["url"] for w in httpx.get(f"{service.url}/v1/cluster", timeout=10).json()["workers"]]
        order = list(range(args.samples))
        with Client(service.url, route=False) as client:
            for _ in range(10):  # warm: until an epoch reads nothing from the store, and all is on disk
                before = proxy.counts.get("GET", 0)
                for start in range(0, args.samples, args.batch):
                    client.get_batch(DATASET, order[start:start + args.batch])
                own = [scrape_metrics(u) for u in urls]
                if proxy.counts.get("GET", 0) == before and all(
                        m["shardfeed_cache_blocks"] == m["shardfeed_cache_misses_total"] for m in own):
                    break
        scraper = Scraper(service.url, args.scrape_every)
        scraper.start()
        served_before = scrape_metrics(service.url)["shardfeed_samples_served_total"]
        stop, received = threading.Event(), []
        clients = [threading.Thread(target=_load, args=(service.url, digests, args.batch, stop, received, n))
                   for n in range(args.threads)]
        for thread in clients:
            thread.start()
        time.sleep(0.5)
        # The worker that served the most batches dies (the clients keep their connections):
        # workers start in order, so their pids ascend (unless pids wrap around).
        busiest = max(range(len(urls)), key=lambda i: scrape_metrics(urls[i])["shardfeed_samples_served_total"])
        victim = child_pids(service.process.pid)[busiest]
        gets, began = proxy.counts.get("GET", 0), time.monotonic()
        os.kill(victim, signal.SIGKILL)
        while all(healthy(u) for u in urls):
            time.sleep(0.01)
        dead = next(u for u in urls if not healthy(u))
        survivor = next(u for u in urls if u != dead)
        files = _sibling_reads(survivor)
        while not healthy(dead):
            time.sleep(0.01)
        down_seconds, down_gets = time.monotonic() - began, proxy.counts.get("GET", 0) - gets
        down_files = _sibling_reads(survivor) - files
        gets = proxy.counts.get("GET", 0)
        time.sleep(args.after)
        stop.set()
        for thread in clients:
            thread.join()
        after_gets = proxy.counts.get("GET", 0) - gets
        time.sleep(2 * args.scrape_every)
        scraper.stop.set()
        scraper.join()
        if -1 in received:
            raise SystemExit("a batch came back incomplete, out of order or with other bytes than were seeded")
        host = scrape_metrics(service.url)["shardfeed_samples_served_total"] - served_before
        print(f"worker down {down_seconds:.2f} s: store GETs {down_gets}, blocks read from its files by the "
              f"survivor {down_files:.0f}; in the {args.after:g} s after: store GETs {after_gets}")
        print(f"scrapes of the public port {scraper.scrapes}, with a counter down {scraper.dips} (largest drop of "
              f"samples served {scraper.largest_drop:.0f}); samples served by the host {host:.0f}, received "
              f"{sum(received)}")
    print(f"after: {load_note()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
