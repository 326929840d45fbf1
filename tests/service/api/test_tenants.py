"""Tenants (``serve --tokens FILE``): every route group against every kind of token, the file
read again while serving (a broken one keeping the tokens read before), each tenant's own
bound on batches in flight, and no secret in any log line or metric label. A real service
over its socket, datasets and GetBatch buckets on moto."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from shardfeed.process import scrape_metrics, start_service

from common.cli import one_line_error, refusals
from common.datasets import dir_put, make_dataset, s3_put
from common.service import tar_members
from common.wait import wait_until

pytestmark = pytest.mark.xdist_group("tenants")  # one worker: its module services start once

DATA, OTHER = "tn-data", "tn-other"
SECRETS = {"teamA": "alpha-secret-7f3e9c0d", "teamB": "bravo-secret-41aa96e0", "teamC": "charlie-secret-0c5d",
           "ops": "ops-secret-9b2e77a1", "watcher": "watcher-secret-3d1f", "root": "root-secret-e5c0a2"}
"""Every token, by who holds it; ``root`` is a full-access token (``SHARDFEED_TOKENS``)."""

TOKEN_FILE = f"""
# teamA reads train and the {DATA} bucket; two batches in flight at most
[teamA]
secret = "{SECRETS['teamA']}"
scopes = ["dataset:train", "bucket:{DATA}"]
max_inflight_batches = 2

[teamB]  # given by its digest only
sha256 = "{hashlib.sha256(SECRETS['teamB'].encode()).hexdigest()}"
scopes = ["dataset:val", "bucket:{OTHER}"]

[teamC]
secret = "{SECRETS['teamC']}"
scopes = ["dataset:*"]

[ops]
secret = "{SECRETS['ops']}"
scopes = ["admin"]

[watcher]
secret = "{SECRETS['watcher']}"
"""


def auth(who: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {SECRETS[who]}"} if who else {}


@pytest.fixture(scope="module")
def service(moto, tmp_path_factory):
    s3 = moto.client()
    for bucket in (DATA, OTHER):
        moto.create_bucket(bucket)
    make_dataset(s3_put(s3, DATA, "train"), samples=40, per_shard=20)
    make_dataset(s3_put(s3, OTHER, "val"), samples=40, per_shard=20)
    s3.put_object(Bucket=DATA, Key="loose/a.bin", Body=b"a" * 100)
    s3.put_object(Bucket=OTHER, Key="loose/b.bin", Body=b"b" * 100)
    root = tmp_path_factory.mktemp("tenants")
    (root / "tokens.toml").write_text(TOKEN_FILE)
    args = ["--tokens", str(root / "tokens.toml"), "--bucket", DATA, "--bucket", OTHER, "--log-level", "debug"]
    with start_service({"train": f"s3://{DATA}/train", "val": f"s3://{OTHER}/val"}, cache_dir=root / "cache",
                       env={**moto.env(), "SHARDFEED_TOKENS": SECRETS["root"]}, args=args) as svc:
        yield svc


def plan_of(url: str, who: str) -> str:
    """A new plan on ``train`` registered by ``who``: its path."""
    resp = httpx.post(f"{url}/v1/datasets/train/plans", json={"kind": "indices", "indices": [3, 1, 2]},
                      headers=auth(who))
    assert resp.status_code == 201, resp.text
    assert resp.json()["owner"] == who
    return f"/v1/datasets/train/plans/{resp.json()['id']}"


def moss(bucket: str) -> dict:
    return {"in": [{"objname": f"loose/{'a' if bucket == DATA else 'b'}.bin", "bucket": bucket, "provider": "aws"}],
            "mime": ".tar", "strm": True}


@dataclass
class Route:
    method: str
    path: str
    body: dict | None = None
    """JSON body."""
    made_by: str | None = None
    """The path is that of a plan this tenant registers just before (``{plan}`` in ``path``)."""
    headers: dict = field(default_factory=dict)


ANY_TOKEN = {"teamA": 200, "teamB": 200, "ops": 200, "watcher": 200, "root": 200, None: 401}
TRAIN = {"teamA": 200, "teamB": 403, "teamC": 200, "ops": 200, "watcher": 403, "root": 200, None: 401}
ADMIN = {"teamA": 403, "teamC": 403, "watcher": 403, None: 401}

TABLE = [  # route group, request -> status by token (None: no token)
    ("healthz", Route("GET", "/healthz"), dict.fromkeys(["teamA", "watcher", None], 200)),
    ("status page html", Route("GET", "/ui"), dict.fromkeys(["watcher", None], 200)),
    ("metrics", Route("GET", "/metrics"), ANY_TOKEN),
    ("stats", Route("GET", "/v1/stats"), ANY_TOKEN),
    ("cluster", Route("GET", "/v1/cluster"), ANY_TOKEN),
    ("openapi", Route("GET", "/openapi.json"), ANY_TOKEN),
    ("datasets list", Route("GET", "/v1/datasets"), ANY_TOKEN),
    ("dataset info", Route("GET", "/v1/datasets/train"), TRAIN),
    ("dataset info, another", Route("GET", "/v1/datasets/val"),
     {"teamA": 403, "teamB": 200, "teamC": 200, "watcher": 403, "ops": 200}),
    ("unknown dataset", Route("GET", "/v1/datasets/nope"), {"teamA": 403, "teamC": 404, "ops": 404}),
    ("routing", Route("GET", "/v1/datasets/train/routing"), TRAIN),
    ("index columns", Route("GET", "/v1/datasets/train/index"), TRAIN),
    ("index column", Route("GET", "/v1/datasets/train/index/bytes"), TRAIN),
    ("index column, another dataset", Route("GET", "/v1/datasets/val/index/key"),
     {"teamA": 403, "teamB": 200, "watcher": 403, None: 401}),
    ("index shards", Route("GET", "/v1/datasets/train/index/shards"), TRAIN),
    ("sample member", Route("GET", "/v1/datasets/train/samples/1/cls"), TRAIN),
    ("sample tar", Route("GET", "/v1/datasets/train/samples/1"), TRAIN),
    ("batch", Route("POST", "/v1/batch", {"dataset": "train", "indices": [1, 0]}), TRAIN),
    ("batch, another dataset", Route("POST", "/v1/batch", {"dataset": "val", "indices": [1]}),
     {"teamA": 403, "teamB": 200, "watcher": 403, "root": 200}),
    ("getbatch", Route("GET", f"/v1/ml/moss/{DATA}", moss(DATA)),
     {"teamA": 200, "teamB": 403, "teamC": 403, "watcher": 403, "ops": 200, "root": 200, None: 401}),
    ("getbatch, entries' bucket", Route("GET", "/v1/ml/moss", moss(OTHER)),
     {"teamA": 403, "teamB": 200, "ops": 200}),
    ("plans list", Route("GET", "/v1/datasets/train/plans"), TRAIN),
    ("plan create", Route("POST", "/v1/datasets/train/plans", {"kind": "indices", "indices": [1, 2]}),
     {**TRAIN, "teamA": 201, "teamC": 201, "ops": 201, "root": 201}),
    ("plan get", Route("GET", "{plan}", made_by="teamA"), TRAIN),
    ("plan extend, own", Route("POST", "{plan}", {"indices": [4]}, made_by="teamA"), {"teamA": 409}),
    ("plan extend, another's", Route("POST", "{plan}", {"indices": [4]}, made_by="teamA"),
     {"teamC": 403, "ops": 409}),
    ("plan delete, own", Route("DELETE", "{plan}", made_by="teamA"), {"teamA": 204}),
    ("plan delete, another's", Route("DELETE", "{plan}", made_by="teamA"),
     {"teamB": 403, "teamC": 403, "watcher": 403, "ops": 204, "root": 204, None: 401}),
    ("plan delete, admin's", Route("DELETE", "{plan}", made_by="ops"), {"teamA": 403, "teamC": 403}),
    ("relayed plan create", Route("POST", "/v1/datasets/train/plans", {"kind": "indices", "indices": [1]},
                                  headers={"X-Shardfeed-Copy": "node", "X-Shardfeed-Plan-Owner": "teamC"}),
     {"teamA": 403, "teamC": 403}),
    ("reload", Route("POST", "/v1/datasets/train/reload"), {**ADMIN, "ops": 200, "root": 200}),
    ("dataset add", Route("POST", "/v1/datasets", {"name": "x", "url": "relative/path"}), {**ADMIN, "ops": 400}),
    ("dataset remove", Route("DELETE", "/v1/datasets/nope"), {**ADMIN, "ops": 404}),
    ("internal read", Route("POST", "/v1/internal/read", {"dataset": "train", "shard": [], "offset": [], "size": []}),
     {**ADMIN, "ops": 200, "root": 200}),
    ("internal plans", Route("GET", "/v1/internal/plans"), {**ADMIN, "ops": 200}),
    ("internal stats", Route("GET", "/v1/internal/stats?span=10"), {**ADMIN, "ops": 200}),
    ("unknown route", Route("GET", "/v1/nothing-here"), {"teamA": 403, "ops": 404}),
]


@pytest.mark.parametrize("route, expected", [pytest.param(route, expected, id=group) for group, route, expected
                                             in TABLE])
def test_every_route_group_answers_each_token_as_its_scopes_say(service, route, expected):
    for who, status in expected.items():
        path = route.path.format(plan=plan_of(service.url, route.made_by)) if route.made_by else route.path
        resp = httpx.request(route.method, service.url + path, json=route.body,
                             headers={**auth(who), **route.headers}, timeout=30)
        assert resp.status_code == status, (who, resp.text)
        if status == 403:
            error = resp.json()["error"]
            assert error["code"] == "forbidden"
            assert error["message"].startswith(f"token {who!r} may not ") and "scope " in error["message"], error


def test_a_refusal_names_the_tenant_and_the_missing_scope(service):
    def refused(method, path, who, **kwargs) -> str:
        resp = httpx.request(method, service.url + path, headers=auth(who), **kwargs)
        assert resp.status_code == 403
        return resp.json()["error"]["message"]

    assert refused("GET", "/v1/datasets/val", "teamA") == \
        "token 'teamA' may not read dataset 'val' (scope dataset:val needed)"
    assert refused("POST", "/v1/batch", "teamA", json={"dataset": "val", "indices": [0]}) == \
        "token 'teamA' may not read dataset 'val' (scope dataset:val needed)"
    assert refused("GET", f"/v1/ml/moss/{OTHER}", "teamA", json=moss(OTHER)) == \
        f"token 'teamA' may not read bucket '{OTHER}' (scope bucket:{OTHER} needed)"
    assert refused("POST", "/v1/datasets/train/reload", "teamA") == \
        "token 'teamA' may not POST /v1/datasets/train/reload (scope admin needed)"
    plan = plan_of(service.url, "teamA")
    assert refused("DELETE", plan, "teamC") == \
        f"token 'teamC' may not delete plan {plan.rsplit('/', 1)[1]!r}, which 'teamA' made (scope admin needed)"


def test_the_datasets_list_holds_what_the_token_may_read(service):
    def listed(who):
        return sorted(d["name"] for d in httpx.get(f"{service.url}/v1/datasets", headers=auth(who)).json())

    assert (listed("teamA"), listed("teamB"), listed("teamC"), listed("watcher"), listed("ops")) == \
        (["train"], ["val"], ["train", "val"], [], ["train", "val"])


def hog(url: str, who: str) -> socket.socket:
    """A batch request whose body never comes: in flight until the socket closes."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/batch HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer %s\r\nContent-Length: 100\r\n\r\n" % SECRETS[who].encode())
    return sock


def inflight(url: str, who: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=auth("watcher")).text
    line = f'shardfeed_tenant_inflight_batches{{tenant="{who}"}} '
    return next((float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(line)), 0.0)


def test_a_tenant_at_its_bound_gets_429_and_the_others_are_served(service):
    def batch(who, dataset):
        return httpx.post(f"{service.url}/v1/batch", json={"dataset": dataset, "indices": [0, 1]}, headers=auth(who))

    assert batch("teamA", "train").status_code == 200  # warm: the instant answerer would serve it
    hogs = [hog(service.url, "teamA") for _ in range(2)]
    try:
        wait_until(lambda: inflight(service.url, "teamA") >= 2, 10, "the held batches counted")
        for _ in range(3):
            refused = batch("teamA", "train")
            assert refused.status_code == 429, refused.text
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"] == {
                "code": "overloaded",
                "message": "token 'teamA' has 2 batch requests in flight, its max_inflight_batches; retry later"}
            assert httpx.request("GET", f"{service.url}/v1/ml/moss/{DATA}", json=moss(DATA),
                                 headers=auth("teamA")).status_code == 429
            assert batch("teamB", "val").status_code == 200
            assert batch("teamC", "train").status_code == 200
            assert batch("root", "train").status_code == 200
        assert httpx.get(f"{service.url}/v1/datasets/train/samples/1/cls", headers=auth("teamA")).status_code == 200
    finally:
        for sock in hogs:
            sock.close()
    wait_until(lambda: batch("teamA", "train").status_code != 429, 10,
               "the slots of batches whose clients went away freed")


def test_no_secret_reaches_a_log_line_or_a_metric_label(service):
    for who in [*SECRETS, None]:
        for method, path, body in [("GET", "/v1/datasets/train", None), ("GET", "/v1/datasets/val/samples/0/cls", None),
                                   ("POST", "/v1/batch", {"dataset": "val", "indices": [0]}),
                                   ("POST", "/v1/datasets/train/reload", None)]:
            httpx.request(method, service.url + path, json=body, headers=auth(who))
    httpx.get(f"{service.url}/v1/stats", headers={"Authorization": "Bearer not-a-token-5be1"})
    metrics = httpx.get(f"{service.url}/metrics", headers=auth("ops")).text
    counted = [line for line in metrics.splitlines() if line.startswith("shardfeed_tenant_requests_total{")]
    assert any('tenant="teamA"' in line and 'status="403"' in line for line in counted), counted
    assert any('tenant="full-access"' in line for line in counted), counted
    log = service.log()
    assert "DEBUG" in log and "refused" in log  # the log was at its most verbose
    for secret in [*SECRETS.values(), "not-a-token-5be1", hashlib.sha256(SECRETS["teamB"].encode()).hexdigest()]:
        assert secret not in log and secret not in metrics
        assert secret[:12] not in log and secret[:12] not in metrics


def write(path, text: str) -> None:
    """Replace the file as an editor or a ConfigMap update does (a new file renamed over it)."""
    path.with_suffix(".new").write_text(text)
    os.replace(path.with_suffix(".new"), path)


def wait_for(url: str, who: str, secret: str, status: int, seconds: float = 6) -> None:
    def answered() -> bool:
        return httpx.get(f"{url}/v1/datasets", headers={"Authorization": f"Bearer {secret}"}).status_code == status

    wait_until(answered, seconds, f"{who} answered {status}")


@pytest.mark.slow  # five rounds of the service's 2 s poll of the file
def test_the_token_file_is_read_again_and_a_broken_one_keeps_the_tokens_read_before(tmp_path):
    data = tmp_path / "data"
    make_dataset(dir_put(data), samples=10, per_shard=10)
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[one]\nsecret = "first-secret-1"\nscopes = ["dataset:*"]\n')
    with start_service({"train": data.as_uri()}, cache_dir=tmp_path / "cache",
                       args=["--tokens", str(tokens)]) as svc:
        wait_for(svc.url, "one", "first-secret-1", 200, 0)
        write(tokens, '[two]\nsecret = "second-secret-2"\nscopes = ["dataset:*"]\n')
        wait_for(svc.url, "two", "second-secret-2", 200)
        wait_for(svc.url, "one", "first-secret-1", 401, 0)

        write(tokens, '[three]\nsecret = "third-secret-3"\nscopes = ["dataset:*", "read:everything"]\n')
        wait_until(lambda: "unknown scope 'read:everything'" in svc.log(), 6, "the broken file reported")
        wait_for(svc.url, "two", "second-secret-2", 200, 0)
        wait_for(svc.url, "three", "third-secret-3", 401, 0)
        assert "the tokens read before stay (tenants: two)" in svc.log()

        # SIGHUP reads it even when the poll cannot tell it changed (same size, inode and time).
        write(tokens, '[four]\nsecret = "fourth-secret-4"\nscopes = ["dataset:*"]\n')
        wait_for(svc.url, "four", "fourth-secret-4", 200)
        stamp = tokens.stat().st_mtime_ns
        tokens.write_text('[four]\nsecret = "fourth-secret-X"\nscopes = ["dataset:*"]\n')
        os.utime(tokens, ns=(stamp, stamp))
        time.sleep(2.5)  # not a wait for an event: a poll or two that must not see the change
        wait_for(svc.url, "four, its first secret", "fourth-secret-4", 200, 0)
        svc.process.send_signal(signal.SIGHUP)
        wait_for(svc.url, "four, its new secret", "fourth-secret-X", 200, 2)
        wait_for(svc.url, "four, its first secret", "fourth-secret-4", 401, 0)
        log = svc.log()
    for secret in ("first-secret-1", "second-secret-2", "third-secret-3", "fourth-secret"):
        assert secret not in log


BAD_TOKEN_FILES = [
    ('[a]\nsecret = "s3cret-value"\nscopes = ["datasets:train"]\n',
     "tenant 'a': unknown scope 'datasets:train' (scopes: admin, dataset:NAME, bucket:NAME"),
    ('[a]\nsecret = "s3cret-value"\nscope = ["dataset:train"]\n', "tenant 'a': unknown key 'scope'"),
    ('[a]\nsecret = "s3cret-value"\nscopes = ["dataset:train"\n', "is not TOML: "),
    ('[a]\nscopes = ["admin"]\n', "tenant 'a': give its secret or its sha256, one of the two"),
    ('[a]\nsecret = "s3cret-value"\n[b]\nsecret = "s3cret-value"\n', "tenant 'b' has the secret of 'a'"),
    ('[a]\nsecret = "s3cret-value"\nmax_inflight_batches = 0\n', "max_inflight_batches must be a whole number"),
    ('[full-access]\nsecret = "s3cret-value"\n', "the name is reserved"),
    ('secret = "s3cret-value"\n', "tenant 'secret' is not a table"),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """``serve`` with each of ``BAD_TOKEN_FILES`` (by its text), and with a good one on replicas
    (``"peers"``), all in one process."""
    root = tmp_path_factory.mktemp("refused")
    files = [root / f"tokens-{i}.toml" for i in range(len(BAD_TOKEN_FILES) + 1)]
    for path, text in zip(files, [text for text, _ in BAD_TOKEN_FILES] + ['[a]\nsecret = "s3cret-value"\n']):
        path.write_text(text)
    serve = [["serve", "--tokens", str(path), "--port", "0", "--cache-dir", str(root / "cache")] for path in files]
    serve[-1] += ["--node-id", "a", "--peers", "a=http://127.0.0.1:1,b=http://127.0.0.1:2"]
    keys = [text for text, _ in BAD_TOKEN_FILES] + ["peers"]
    return {key: (path, run) for key, path, run in zip(keys, files, refusals(serve))}


@pytest.mark.parametrize("text, message", BAD_TOKEN_FILES)
def test_a_bad_token_file_stops_serve_at_start_with_the_reason(refused, text, message):
    tokens, run = refused[text]
    error = one_line_error(run)
    assert error.startswith(f"shardfeed: error: --tokens {tokens}")
    assert message in error and "s3cret-value" not in error


def test_replicas_with_tenants_need_a_shared_full_access_token(refused):
    error = one_line_error(refused["peers"][1])
    assert "--tokens with --peers needs a full-access token" in error


@pytest.mark.slow  # two workers, as in the other tests of --workers N
def test_workers_with_tenants_reach_each_other_and_serve_a_tenant_whole_batches(tmp_path):
    data = tmp_path / "data"
    source = make_dataset(dir_put(data), samples=40, per_shard=5)
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[teamA]\nsecret = "{SECRETS["teamA"]}"\nscopes = ["dataset:train"]\n')
    with start_service({"train": data.as_uri()}, cache_dir=tmp_path / "cache", workers=2,
                       args=["--tokens", str(tokens)]) as svc:
        resp = httpx.post(f"{svc.url}/v1/batch", json={"dataset": "train", "indices": list(range(40))},
                          headers=auth("teamA"), timeout=30)
        assert resp.status_code == 200, resp.text
        assert len(tar_members(resp.content)) == len(source)
        # The sibling answered for its shards (with the workers' own token), not the store in its place.
        assert scrape_metrics(svc.url, token=SECRETS["teamA"])["shardfeed_peer_fallbacks_total"] == 0
        plan = plan_of(svc.url, "teamA")
        workers = httpx.get(f"{svc.url}/v1/cluster", headers=auth("teamA")).json()["workers"]
        assert len(workers) == 2
        for worker in workers:  # the registration was relayed to both, as admin
            own = f"http://127.0.0.1:{worker['url'].rsplit(':', 1)[1]}"
            assert httpx.get(own + plan, headers=auth("teamA")).status_code == 200
            assert httpx.get(f"{own}/v1/internal/plans", headers=auth("teamA")).status_code == 403
        assert "refused" not in svc.log()
