"""One line on one node, as a new user runs it: ``ShardfeedDataset("s3://...")`` under
``torchrun``, nothing started by hand.

    python -m shardfeed.benchmarks.node [--samples 20000] [--size 16KiB] [--rounds 3]

The stack, all on 127.0.0.1: SeaweedFS holding a synthetic dataset (``seeds/synthetic.py``:
every member's bytes are a pure function of its sample number, so each sample is checked
against its expected bytes), and the counting proxy (``s3proxy.py``, a process of its own)
in front of it, through which everything reads S3. The job is ``JOB`` below, run with
``torchrun --nproc_per_node 2`` on CPU: a ``DataLoader(num_workers=4)`` over
``ShardfeedDataset(URL)`` with a shuffled ``DistributedSampler``, one epoch, each rank
writing what it received. Its first six lines are the whole recipe; the rest measures.

1. **first job**, cold: the first rank to get there starts the node's service; the harness
   checks that exactly one service process tree runs on the node (``shardfeed ps``, and
   every process whose command line is ``shardfeed serve`` in that service's session), that
   every sample came once per epoch, as the sampler ordered, byte for byte;
2. **second job**: the same script again finds the service warm: its S3 requests (counted
   by the proxy) against the first job's, and its samples/s;
3. **by hand**: ``shardfeed serve --dataset bench=URL`` started by hand with the node
   service's settings and warmed by one run, then the same job naming it
   (``ShardfeedDataset("http://...", "bench")``); ``--rounds`` runs of this and of the
   node-service job alternate, and the medians are compared.

Printed: a table of the jobs (torchrun's whole run, the epoch, its samples/s, S3 requests),
the checks, and the ratio of the node service's warm samples/s to the hand-started
service's (target: >= 0.95).
``--json FILE`` writes the figures too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

from shardfeed.benchmarks.common import seed_by_cli, table
from shardfeed.benchmarks.s3proxy import start_proxy_process
from shardfeed.process import free_port, installed_script, start_service, stop_process
from shardfeed.s3server import start_seaweedfs
from shardfeed.seeds.synthetic import member_bytes, parse_sizes

JOB = textwrap.dedent('''
    import sys, torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler
    from shardfeed.client.torch import ShardfeedDataset
    dist.init_process_group("gloo")
    dataset = ShardfeedDataset(*sys.argv[2:])
    loader = DataLoader(dataset, batch_size=64, num_workers=4, sampler=DistributedSampler(dataset), collate_fn=list)
    # Measured: the epoch's time and what arrived, in order, with a digest of each sample's bytes.
    import hashlib, json, time
    began, got = time.perf_counter(), []
    for batch in loader:
        got += [(s["__index__"], hashlib.sha1(s["bin"] + s["cls"]).hexdigest()) for s in batch]
    seconds = time.perf_counter() - began
    order = list(iter(loader.sampler))
    with open(f"{sys.argv[1]}/rank{dist.get_rank()}.json", "w") as out:
        json.dump({"seconds": seconds, "got": got, "order": order}, out)
    dist.destroy_process_group()
''')

FIELDS = ("bin", "cls")


def run_job(env: dict, out: Path, *args: str) -> dict:
    """Run ``JOB`` under torchrun with ``args``; per rank: seconds, (index, digest) received, order."""
    out.mkdir(parents=True, exist_ok=True)
    script = out / "job.py"
    script.write_text(JOB)
    torchrun = installed_script("torchrun") or "torchrun"
    done = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()), str(script),
                           str(out), *args], env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the job failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)}


def check(ranks: dict, samples: int, seed: int, sizes: tuple[int, int]) -> dict:
    """Wrong, lost and duplicate samples against the sampler's order and the expected bytes."""
    wrong = lost = extra = 0
    for result in ranks.values():
        got = [index for index, _ in result["got"]]
        order = result["order"]
        lost += max(0, len(order) - len(got))
        extra += max(0, len(got) - len(order))
        for position, (index, digest) in enumerate(result["got"]):
            want = hashlib.sha1(b"".join(member_bytes(seed, index, f, sizes) for f in FIELDS)).hexdigest()
            if position >= len(order) or order[position] != index or digest != want:
                wrong += 1
    seen = sorted(index for result in ranks.values() for index, _ in result["got"])
    covered = set(seen) == set(range(samples))
    return {"wrong": wrong, "lost": lost, "extra": extra, "every_sample": covered}


def rate(ranks: dict) -> tuple[float, float]:
    """The job's epoch seconds (the slower rank's) and samples per second over both ranks."""
    seconds = max(r["seconds"] for r in ranks.values())
    return seconds, sum(len(r["got"]) for r in ranks.values()) / seconds


def proxy_requests(proxy: str) -> int:
    with urllib.request.urlopen(f"{proxy}/_proxy/counts", timeout=10) as resp:
        return int(json.loads(resp.read()).get("requests", 0))


def service_trees(env: dict) -> tuple[list[dict], set[int]]:
    """The node's services (``shardfeed ps --json``) and the sessions of every ``shardfeed serve --node``
    process of this run (its run directory in its environment: another job's node service, as a
    parallel test suite starts, is not ours)."""
    ours = f"SHARDFEED_RUN_DIR={env['SHARDFEED_RUN_DIR']}".encode()
    listed = subprocess.run([sys.executable, "-m", "shardfeed", "ps", "--json"], env=env, capture_output=True,
                            text=True, check=True).stdout
    sessions = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"shardfeed" in b" ".join(argv) and b"serve" in argv and b"--node" in argv \
                    and ours in (proc / "environ").read_bytes().split(b"\0"):
                sessions.add(os.getsid(int(proc.name)))
        except (OSError, ProcessLookupError):
            continue
    return [json.loads(line) for line in listed.splitlines()], sessions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardfeed.benchmarks.node", description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--size", default="16KiB", help="sample payload size (or a range, 1KiB-16KiB)")
    parser.add_argument("--shard-size", default="16MiB")
    parser.add_argument("--rounds", type=int, default=3,
                        help="warm runs of each service, alternating (0: the node service's jobs only)")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="shardfeed-node-bench-"))
    seed, sizes = 0, parse_sizes(args.size)
    s3 = start_seaweedfs(work / "seaweedfs")
    proxy, proxy_process = start_proxy_process(s3.endpoint, 0, work / "proxy.log")
    hand = None
    env = {**os.environ, **s3.env(), "AWS_ENDPOINT_URL": proxy, "SHARDFEED_RUN_DIR": str(work / "run"),
           "XDG_CACHE_HOME": str(work / "xdg")}
    env.pop("SHARDFEED_SERVE_ARGS", None)
    url = "s3://bench/data"
    try:
        s3.create_bucket("bench")
        seed_by_cli(url, args.samples, args.size, shard_size=args.shard_size, fields=FIELDS, seed=seed, env=s3.env())
        jobs, checks = [], {}

        def job(name: str, *job_args: str) -> dict:
            before, began = proxy_requests(proxy), time.monotonic()
            ranks = run_job(env, work / name, *job_args)
            seconds, per_second = rate(ranks)
            jobs.append({"job": name, "wall_s": round(time.monotonic() - began, 2), "seconds": round(seconds, 2),
                         "samples_per_s": round(per_second), "s3_requests": proxy_requests(proxy) - before})
            checks[name] = check(ranks, args.samples, seed, sizes)
            print(f"{name}: {seconds:.1f} s, {per_second:,.0f} samples/s, {jobs[-1]['s3_requests']} S3 requests, "
                  f"{checks[name]}", file=sys.stderr)
            return jobs[-1]

        first = job("first job (starts the service)", url)
        services, sessions = service_trees(env)
        one_tree = len(services) == 1 and sessions == {services[0]["pid"]}
        second = job("second job (warm)", url)
        node_rates, hand_rates = [second["samples_per_s"]], []
        if args.rounds:  # by hand, with the node service's settings (its cache directory aside): the defaults
            hand = start_service({"bench": url}, cache_dir=work / "hand-cache", port=free_port(), env=env,
                                 workers=os.cpu_count() or 1)
            job("by hand, warming", hand.url, "bench")
        for round_ in range(args.rounds):
            hand_rates.append(job(f"by hand, warm {round_ + 1}", hand.url, "bench")["samples_per_s"])
            if round_ < args.rounds - 1:
                node_rates.append(job(f"node service, warm {round_ + 2}", url)["samples_per_s"])
        ratio = statistics.median(node_rates) / statistics.median(hand_rates) if hand_rates else None
        requests_ratio = second["s3_requests"] / max(1, first["s3_requests"])
        print("\n" + table(["job", "torchrun s", "epoch s", "samples/s", "S3 requests"],
                           [[r["job"], f"{r['wall_s']:.1f}", f"{r['seconds']:.1f}", f"{r['samples_per_s']:,}",
                             f"{r['s3_requests']:,}"] for r in jobs]))
        all_exact = all(c["wrong"] == c["lost"] == c["extra"] == 0 and c["every_sample"] for c in checks.values())
        print(f"\none service process tree on the node after the first job: {one_tree} "
              f"({len(services)} listed, sessions {sorted(sessions)})")
        print(f"every sample once per epoch, in the sampler's order, byte-exact, in every job: {all_exact}")
        print(f"second job's S3 requests / first job's: {requests_ratio:.2%} (target <= 1%)")
        if ratio is not None:
            print(f"node service warm / by hand warm, samples/s (medians of {len(node_rates)} and {len(hand_rates)}): "
                  f"{ratio:.2f}x (target >= 0.95x)")
        if args.json:
            args.json.write_text(json.dumps({"jobs": jobs, "checks": checks, "one_tree": one_tree,
                                             "requests_ratio": requests_ratio, "warm_ratio": ratio}, indent=1))
        return 0 if one_tree and all_exact and requests_ratio <= 0.01 and (ratio is None or ratio >= 0.95) else 1
    finally:
        if hand is not None:
            hand.stop()
        subprocess.run([sys.executable, "-m", "shardfeed", "stop", "--all"], env=env, capture_output=True)
        stop_process(proxy_process)
        s3.stop()


if __name__ == "__main__":
    sys.exit(main())
