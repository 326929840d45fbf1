"""Security: bearer tokens (from the environment too), loopback by default, credentials
that never reach logs, error messages or metrics, datasets confined to their own prefix,
and TLS end to end with a self-signed certificate."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from shardfeed.benchmarks.s3proxy import start_proxy
from shardfeed.client import AsyncClient, Client, ShardfeedConnectionError, ShardfeedHTTPError
from shardfeed.process import ServiceProcess, free_port, start_service
from shardfeed.retry import Backoff
from shardfeed.service.config import ServiceConfig
from shardfeed.service.datasets.index import parquet_bytes

from common.datasets import bucket_dataset, dir_put, make_dataset, s3_put
from common.reliability import expected_members, received_members

pytestmark = pytest.mark.slow  # starts several services, S3 servers or a browser; not in `make check`

SAMPLES = 60  # 3 shards of 20
TOKENS = ("alpha-7f3e9c0d2b", "beta-41aa96e0c5")
SESSION_TOKEN = "FwoGZXIvYXdzEXAMPLESESSIONTOKEN0123456789"


@pytest.fixture(scope="module")
def s3_dataset(moto):
    return bucket_dataset(moto, "secure", samples=SAMPLES, per_shard=20)


def test_tokens_from_the_environment_are_required_on_every_route_but_healthz_and_the_page_html(s3_dataset, moto, tmp_path):
    url, source = s3_dataset
    env = {**moto.env(), "SHARDFEED_TOKENS": f" {TOKENS[0]} ,{TOKENS[1]}, "}
    with start_service({"train": url}, cache_dir=tmp_path / "cache", env=env) as svc:
        assert httpx.get(f"{svc.url}/healthz").status_code == 200
        wrong = [{}, {"Authorization": "Bearer"},
                 {"Authorization": f"Bearer {TOKENS[0]}x"}, {"Authorization": f"Bearer {TOKENS[0][:-1]}"},
                 {"Authorization": f"Basic {TOKENS[0]}"}, {"Authorization": TOKENS[0]},
                 {"Authorization": f"Bearer {TOKENS[0]},{TOKENS[1]}"}, {"X-Token": TOKENS[0]}]
        for path in ("/v1/datasets", "/metrics", "/openapi.json", "/v1/datasets/train/samples/1/bin",
                     f"/v1/datasets?token={TOKENS[0]}", "/v1/stats", f"/v1/stats?token={TOKENS[0]}"):
            for headers in wrong:
                resp = httpx.get(svc.url + path, headers=headers)
                assert resp.status_code == 401, (path, headers)
                assert resp.json() == {"error": {"code": "unauthorized", "message": "missing or wrong bearer token"}}
                assert resp.headers["www-authenticate"] == "Bearer"
        resp = httpx.post(f"{svc.url}/v1/batch", json={"dataset": "train", "indices": [1]})
        assert resp.status_code == 401
        for token in TOKENS:
            ok = httpx.get(f"{svc.url}/v1/datasets/train/samples/3/bin", headers={"Authorization": f"bearer {token}"})
            assert ok.status_code == 200 and ok.content == source[(3, "bin")]
        with Client(svc.url, token=TOKENS[1]) as client:
            assert client.get_batch("train", [5])[0]["bin"] == source[(5, "bin")]
        with Client(svc.url, token="nope") as client, pytest.raises(ShardfeedHTTPError) as err:
            client.get_batch("train", [5])
        assert err.value.status == 401
        text = svc.log() + httpx.get(f"{svc.url}/metrics", headers={"Authorization": f"Bearer {TOKENS[0]}"}).text
        assert not any(token in text for token in TOKENS)


def listening_addresses(port: int) -> set[str]:
    """Local addresses of the sockets listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                # /proc writes each 32-bit word in host (little-endian) order
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(str(ipaddress.ip_address(words)))
    return found


def test_the_service_binds_loopback_unless_told_otherwise(s3_dataset, moto, tmp_path):
    assert ServiceConfig().host == "127.0.0.1"
    with start_service({"train": s3_dataset[0]}, cache_dir=tmp_path / "cache", env=moto.env()) as svc:
        assert listening_addresses(int(svc.url.rsplit(":", 1)[1])) == {"127.0.0.1"}


def test_credentials_never_reach_logs_errors_or_metrics(s3_dataset, moto, tmp_path):
    """A failing store at debug level: every log line, error body and metric is searched
    for the AWS secret, the access key's signatures and the bearer tokens."""
    url, _ = s3_dataset
    secrets = [moto.secret_key, *TOKENS]
    proxy = start_proxy(moto.endpoint)
    seen = []
    try:
        env = {**moto.env(), "AWS_ENDPOINT_URL": proxy.url, "SHARDFEED_TOKENS": ",".join(TOKENS)}
        auth = {"Authorization": f"Bearer {TOKENS[0]}"}
        with start_service({"train": url}, cache_dir=tmp_path / "cache", cache_size="0", env=env,
                           args=["--log-level", "debug", "--store-retries", "1", "--store-timeout", "0.5"]) as svc:
            for kind in ("503", "500", "reset", "truncate", "stall"):
                proxy.inject(kind, count=None, match="^GET .*shards/", ms=2000)
                for path in ("/v1/datasets/train/samples/1/bin", "/v1/datasets/train/samples/25"):
                    resp = httpx.get(svc.url + path, headers=auth, timeout=30)
                    assert resp.status_code == 503
                    seen.append(resp.text + str(resp.headers))
                resp = httpx.post(f"{svc.url}/v1/batch", json={"dataset": "train", "indices": [2, 30]},
                                  headers=auth, timeout=30)
                seen.append(resp.text + str(resp.headers))
                proxy.clear()
            assert httpx.get(f"{svc.url}/v1/datasets/train/samples/1/bin", headers=auth).status_code == 200
            seen.append(httpx.get(f"{svc.url}/metrics", headers=auth).text)
        seen.append(svc.log())
        assert "DEBUG shardfeed.coalescer store read" in svc.log()  # debug logging was on
        # The same store with a wrong secret and a session token: the service refuses to start,
        # saying why (the session token would appear in botocore's debug output).
        bad = {**moto.env(), "AWS_SECRET_ACCESS_KEY": "wrong-" + moto.secret_key,
               "AWS_SESSION_TOKEN": SESSION_TOKEN}
        with pytest.raises(RuntimeError) as err:
            start_service({"train": url}, cache_dir=tmp_path / "cache2", env=bad, args=["--log-level", "debug"])
        assert "access denied" in str(err.value).lower()
        seen.append(str(err.value))
    finally:
        proxy.stop()
    text = "\n".join(seen)
    for secret in [*secrets, "wrong-" + moto.secret_key, SESSION_TOKEN]:
        assert secret not in text
    assert "Signature=" not in text and "x-amz-security-token" not in text.lower()


def rewrite_shard_paths(index_file: Path, old: str, new: str) -> None:
    table = pq.read_table(index_file)
    shards = pc.replace_substring(table["shard"], old, new)
    index_file.write_bytes(parquet_bytes(table.set_column(table.schema.get_field_index("shard"), "shard", shards)))


def test_a_file_dataset_cannot_expose_files_outside_its_root(tmp_path):
    root = tmp_path / "train"
    source = make_dataset(dir_put(root), samples=SAMPLES, per_shard=20)
    outside = tmp_path / "outside"
    outside.mkdir()
    # The same shard bytes outside the root: a store that followed the link would serve
    # them "correctly", so only confinement explains a refusal.
    shard1 = root / "shards" / "part-0001.tar"
    (outside / "part-0001.tar").write_bytes(shard1.read_bytes())
    shard1.unlink()
    shard1.symlink_to(outside / "part-0001.tar")
    (root / "shards" / "part-0000.tar").rename(outside / "part-0000.tar")
    rewrite_shard_paths(root / "index.parquet", "shards/part-0000.tar", "../outside/part-0000.tar")
    with start_service({"train": root.as_uri()}, cache_dir=tmp_path / "cache") as svc:
        for i in (3, 25):  # shard 0 via "..", shard 1 via a symlink
            resp = httpx.get(f"{svc.url}/v1/datasets/train/samples/{i}/bin")
            assert resp.status_code == 503 and "escapes" in resp.json()["error"]["message"]
        resp = httpx.post(f"{svc.url}/v1/batch", json={"dataset": "train", "indices": [3, 25, 45],
                                                       "continue_on_error": True})
        got, ended = received_members(resp.content)
        assert ended and got == [("__404__/train/3", b""), ("__404__/train/25", b"")] + \
            expected_members(source, "train", [45])


def test_an_s3_dataset_cannot_expose_objects_outside_its_prefix(s3_dataset, moto, tmp_path):
    url, source = s3_dataset
    client = moto.client()
    make_dataset(s3_put(client, "secure", "train-secret"), samples=SAMPLES, per_shard=20)  # the sibling
    make_dataset(s3_put(client, "secure", "sneaky"), samples=SAMPLES, per_shard=20)
    index = tmp_path / "index.parquet"
    index.write_bytes(client.get_object(Bucket="secure", Key="sneaky/index.parquet")["Body"].read())
    rewrite_shard_paths(index, "shards/part-0000.tar", "../train-secret/shards/part-0000.tar")
    rewrite_shard_paths(index, "shards/part-0001.tar", "shards/../../train-secret/shards/part-0001.tar")
    client.put_object(Bucket="secure", Key="sneaky/index.parquet", Body=index.read_bytes())
    with start_service({"sneaky": "s3://secure/sneaky"}, cache_dir=tmp_path / "cache", env=moto.env()) as svc:
        for i in (3, 25):
            resp = httpx.get(f"{svc.url}/v1/datasets/sneaky/samples/{i}/bin")
            assert resp.status_code == 503 and "escapes" in resp.json()["error"]["message"]
        assert httpx.get(f"{svc.url}/v1/datasets/sneaky/samples/45/bin").content == \
            source[(45, "bin")]  # its own shards are served


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "shardfeed test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


async def async_batch(url: str, verify: bool | str, indices: list[int]) -> list[dict]:
    async with AsyncClient(url, verify=verify, backoff=Backoff(attempts=1)) as client:
        return await client.get_batch("train", indices)


def test_tls_with_a_self_signed_certificate_works_end_to_end(s3_dataset, moto, tmp_path):
    url, source = s3_dataset
    cert, key = self_signed(tmp_path)
    trusted = ssl.create_default_context(cafile=str(cert))
    port = free_port()
    log_path = tmp_path / "tls.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "shardfeed", "serve", "--port", str(port), "--cache-dir", str(tmp_path / "cache"),
             "--dataset", f"train={url}", "--tls-cert", str(cert), "--tls-key", str(key)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **moto.env()})
    with ServiceProcess(process, f"https://127.0.0.1:{port}", log_path) as svc:
        deadline = time.monotonic() + 60
        while True:  # start_service polls plain HTTP, so wait for the HTTPS health check here
            try:
                if httpx.get(f"{svc.url}/healthz", verify=trusted, timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                assert process.poll() is None and time.monotonic() < deadline, svc.log()
                time.sleep(0.1)
        with httpx.Client(base_url=svc.url, verify=trusted) as https:
            indices = [7, 0, 59, 7]
            resp = https.post("/v1/batch", json={"dataset": "train", "indices": indices})
            assert received_members(resp.content) == (expected_members(source, "train", indices), True)
            assert https.get("/v1/datasets/train/samples/9/bin").content == source[(9, "bin")]
        with Client(svc.url, verify=str(cert)) as client:  # our client, told to trust the certificate
            assert client.get_batch("train", [9])[0]["bin"] == source[(9, "bin")]
        for verify in (str(cert), False):  # the asyncio client's batch transport, trusting it or not checking
            assert asyncio.run(async_batch(svc.url, verify, [9, 3]))[1]["bin"] == source[(3, "bin")]
        with pytest.raises(ShardfeedConnectionError) as err:  # the system's CAs do not trust it
            asyncio.run(async_batch(svc.url, True, [9]))
        assert err.value.connect and "CERTIFICATE_VERIFY_FAILED" in str(err.value)
        with pytest.raises(ShardfeedConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            Client(svc.url, backoff=Backoff(attempts=1)).get_batch("train", [9])
        with pytest.raises(httpx.ConnectError):  # not trusted without the certificate
            httpx.get(f"{svc.url}/healthz")
        with pytest.raises(httpx.TransportError):  # no plain HTTP on the TLS port
            httpx.get(f"http://127.0.0.1:{port}/healthz")
