"""What the reliability tests (faults, fuzzing, load, security) share: checking served
bytes against the independent source, reading cut-short tar streams, a steady client
that runs beside an attack, and the service's peak memory."""

from __future__ import annotations

import io
import random
import tarfile
import threading
import time
from dataclasses import dataclass, field

import httpx

from shardfeed.faults import cached_blocks, damage_block, peak_rss_mib  # noqa: F401 (re-exported)


def expected_members(source: dict, dataset: str, indices, fields=None) -> list[tuple[str, bytes]]:
    """Members of a correct batch response: ``<key>.<field>`` in request order, and a
    zero-length ``__404__/<dataset>/<i>`` for a sample lacking a requested field."""
    present = sorted({f for (_, f) in source})
    out = []
    for i in indices:
        wanted = [f.lower() for f in fields] if fields is not None else [f for f in present if (i, f) in source]
        if all((i, f) in source for f in wanted):
            out += [(f"sample{i:06d}.{f}", source[(i, f)]) for f in wanted]
        else:
            out.append((f"__404__/{dataset}/{i}", b""))
    return out


def received_members(data: bytes) -> tuple[list[tuple[str, bytes]], bool]:
    """The complete members at the start of a possibly cut-short tar stream, read with
    Python's own tarfile, and whether the stream ended with a proper end-of-archive."""
    members = []
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as tar:
            for member in tar:
                payload = tar.extractfile(member).read() if member.isfile() else b""
                if len(payload) != member.size:
                    return members, False
                members.append((member.name, payload))
    except (tarfile.ReadError, EOFError):
        return members, False
    # tarfile stops quietly at EOF: a proper archive has its two zero blocks at the end.
    return members, data.endswith(b"\0" * 1024) and len(data) % 512 == 0


def wrong_members(got: list[tuple[str, bytes]], want: list[tuple[str, bytes]]) -> int:
    """How many received members differ from the expected ones at the same position
    (a stream cut short may stop early, but what it did deliver must be exact)."""
    wrong = sum(1 for g, w in zip(got, want) if g != w)
    return wrong + max(0, len(got) - len(want))


@dataclass
class Tally:
    """Requests made, failures a client saw, and members with wrong bytes."""

    requests: int = 0
    failures: int = 0
    wrong: int = 0
    errors: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.failures += 1
        if len(self.errors) < 5:
            self.errors.append(what)


class SteadyClient(threading.Thread):
    """A well-behaved client: random batches and per-sample GETs in a loop, every byte checked.

    Runs beside whatever a test does to the service; ``stop()`` returns its ``Tally``.
    """

    def __init__(self, url: str, dataset: str, source: dict, samples: int, *, headers=None, seed: int = 0):
        super().__init__(daemon=True)
        self.url, self.dataset, self.source, self.samples = url, dataset, source, samples
        self.headers = headers or {}
        self.rng = random.Random(seed)
        self.tally = Tally()
        self._halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30, headers=self.headers) as http:
            while not self._halt.is_set():
                self.tally.requests += 1
                try:
                    if self.rng.random() < 0.5:
                        self._batch(http)
                    else:
                        self._sample(http)
                except httpx.HTTPError as err:
                    self.tally.fail(f"{type(err).__name__}: {err}")
                time.sleep(0.005)

    def _batch(self, http: httpx.Client) -> None:
        indices = [self.rng.randrange(self.samples) for _ in range(self.rng.randint(1, 40))]
        resp = http.post("/v1/batch", json={"dataset": self.dataset, "indices": indices})
        if resp.status_code != 200:
            return self.tally.fail(f"batch: HTTP {resp.status_code} {resp.text[:200]}")
        got, ended = received_members(resp.content)
        want = expected_members(self.source, self.dataset, indices)
        self.tally.wrong += wrong_members(got, want)
        if not ended or len(got) != len(want):
            self.tally.fail("batch: incomplete tar stream")

    def _sample(self, http: httpx.Client) -> None:
        i = self.rng.randrange(self.samples)
        resp = http.get(f"/v1/datasets/{self.dataset}/samples/{i}/bin")
        if resp.status_code != 200:
            return self.tally.fail(f"sample: HTTP {resp.status_code} {resp.text[:200]}")
        self.tally.wrong += resp.content != self.source[(i, "bin")]

    def stop(self) -> Tally:
        self._halt.set()
        self.join(60)
        return self.tally
