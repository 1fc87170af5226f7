"""deploy/ without Docker: what can be checked by construction.

- the compose file (alone and with each GPU override) validates with `docker compose
  config` or `docker-compose config`, and every service has a health check and a
  restart policy; the GPU overrides map the devices;
- every Dockerfile's COPY/ADD sources exist in the build context compose gives it (and
  are not excluded by .dockerignore); images are pinned;
- the Grafana dashboard loads and queries only metrics (and labels) the services'
  registries export, from datasources that are provisioned;
- Prometheus scrapes the ports the services' --metrics-port flags open, and traces flow
  services -> collector -> Jaeger on matching ports;
- docker-compose.scale.yml puts N `swarmserve serve` pairs behind the SMG gateway;
- deploy/k8s: the core resources validate against the Kubernetes schemas (kubernetes-validate,
  strict), the InferencePool against the inference extension's CRD schema (vendored in
  tests/support/data), and the pieces reference each other consistently (Gateway and HTTPRoute,
  whose CRDs are not vendored, only this way).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from executor_svc.observability.executor_metrics import ExecutorMetrics
from scheduler_svc.metrics import SchedulerMetrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
OVERRIDES = {"cpu": [], "rocm": [DEPLOY / "docker-compose.rocm.yml"], "cuda": [DEPLOY / "docker-compose.cuda.yml"]}
SCALE = DEPLOY / "docker-compose.scale.yml"


def compose_command() -> list[str] | None:
    """`docker compose` (the v2 plugin) if it runs here, else `docker-compose`, else None."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("variant", sorted(OVERRIDES))
def test_compose_config_validates(variant, tmp_path):
    command = compose_command()
    if command is None:
        if os.environ.get("CI"):
            pytest.fail("neither `docker compose` nor `docker-compose` is installed (.ci/run installs docker-compose)")
        pytest.skip("no docker compose tool here (apt-get install docker-compose)")
    files = [arg for path in [COMPOSE, *OVERRIDES[variant]] for arg in ("-f", str(path))]
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}  # the defaults, not this machine's settings
    result = subprocess.run([*command, *files, "config"], capture_output=True, text=True, env=env, cwd=DEPLOY)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    services = config["services"]
    assert set(services) == {"executor", "scheduler", "otel-collector", "jaeger", "prometheus", "grafana"}
    for name, service in services.items():
        assert service.get("restart") == "unless-stopped", name
        assert service["healthcheck"]["test"][0] == "CMD", name
    executor = services["executor"]
    assert any(
        str(v).endswith(":/models:ro") or (isinstance(v, dict) and v.get("target") == "/models")
        for v in executor["volumes"]
    )
    assert "--model=default" in executor["command"]
    if variant == "rocm":
        assert sorted(executor["devices"]) == ["/dev/dri", "/dev/kfd"]
        assert len(executor["group_add"]) == 2
        assert executor["build"]["dockerfile"].endswith("Dockerfile.rocm")
    if variant == "cuda":
        (device,) = executor["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert executor["build"]["dockerfile"].endswith("Dockerfile.cuda")
    if variant != "cpu":
        assert "--device=cuda" in executor["command"]
        assert executor["healthcheck"]["test"] == load(COMPOSE)["services"]["executor"]["healthcheck"]["test"]


def compose_builds() -> dict[Path, Path]:
    """Every Dockerfile the compose files build -> its build context."""
    builds = {}
    for path in [COMPOSE, SCALE, *(p for paths in OVERRIDES.values() for p in paths)]:
        for service in load(path)["services"].values():
            build = service.get("build")
            if build is None:
                continue
            if isinstance(build, str):
                build = {"context": build}
            context = (path.parent / build["context"]).resolve()
            builds[(context / build.get("dockerfile", "Dockerfile")).resolve()] = context
    return builds


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    instructions = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    return instructions


def copy_sources(rest: str) -> list[str] | None:
    """The sources of a COPY/ADD, or None for one that copies from another stage/image."""
    if rest.startswith("["):
        args = json.loads(rest)
    else:
        args = rest.split()
    flags = [a for a in args if a.startswith("--")]
    if any(f.startswith("--from") for f in flags):
        return None
    return [a for a in args if not a.startswith("--")][:-1]


def dockerignore_patterns(context: Path) -> list[str]:
    path = context / ".dockerignore"
    if not path.exists():
        return []
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def test_every_dockerfile_copies_what_exists_in_its_context():
    builds = compose_builds()
    dockerfiles = {p.resolve() for p in DEPLOY.rglob("Dockerfile*")}
    assert dockerfiles == set(builds), "every Dockerfile is built by a compose file, and every build has its Dockerfile"
    num_sources = 0
    for dockerfile, context in builds.items():
        instructions = dockerfile_instructions(dockerfile)
        for keyword, rest in instructions:
            if keyword == "FROM":
                image = rest.split()[0]
                assert ":" in image and not image.endswith(":latest"), f"{dockerfile}: unpinned {image}"
            if keyword not in ("COPY", "ADD"):
                continue
            sources = copy_sources(rest)
            if sources is None:
                continue
            for source in sources:
                num_sources += 1
                assert list(context.glob(source)), f"{dockerfile.relative_to(ROOT)}: COPY {source}: not in {context}"
                for pattern in dockerignore_patterns(context):
                    assert not fnmatch.fnmatch(source.rstrip("/"), pattern), (
                        f"{source} is excluded by .dockerignore ({pattern})"
                    )
    assert num_sources >= 3 * 6  # the three swarmserve images copy the package sources
    smg = dockerfile_instructions(DEPLOY / "smg" / "Dockerfile")
    assert ("RUN", "pip install smg==1.13.0") in smg  # the gateway pinned, like every image


def test_compose_images_are_pinned():
    for path in [COMPOSE, SCALE, *(p for paths in OVERRIDES.values() for p in paths)]:
        for name, service in load(path)["services"].items():
            image = service.get("image", "")
            if image:
                assert ":" in image and not image.endswith(":latest"), f"{path.name}: {name}: {image}"


def exported_samples() -> dict[str, set[str]]:
    """Every sample name the two services' registries can export -> the family's label names."""
    samples: dict[str, set[str]] = {}
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "gauge": ("",),
    }
    for registry in (SchedulerMetrics().registry, ExecutorMetrics().registry):
        collectors = registry._names_to_collectors  # name -> the metric object, which knows its label names
        for family in registry.collect():
            labels = set(collectors[family.name]._labelnames)
            for suffix in suffixes[family.type]:
                samples[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return samples


def test_dashboard_queries_only_exported_metrics():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "swarmserve.json").read_text())
    samples = exported_samples()
    datasources = load(DEPLOY / "grafana" / "provisioning" / "datasources" / "datasources.yml")["datasources"]
    uids = {d["uid"] for d in datasources}
    referenced, num_queries = set(), 0
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] in uids, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] in uids
            expr = target.get("expr")
            if expr is None:
                continue
            num_queries += 1
            names = set(re.findall(r"\bswarmserve_[a-z0-9_]+", expr))
            assert names, f"{panel['title']}: {expr}"
            unknown = names - set(samples)
            assert not unknown, f"{panel['title']}: not exported: {unknown}"
            labels = set().union(*(samples[n] for n in names))
            for group in re.findall(r"\bby \(([^)]*)\)", expr):
                for label in (g.strip() for g in group.split(",")):
                    assert label in labels, f"{panel['title']}: no label {label!r} on {names}"
            referenced |= names
    assert num_queries >= 20
    # The panels the issue asks for.
    for name in (
        "swarmserve_scheduler_step_duration_seconds_bucket",
        "swarmserve_scheduler_batch_size_sum",
        "swarmserve_scheduler_draft_tokens_allocated_total",
        "swarmserve_scheduler_draft_tokens_accepted_total",
        "swarmserve_scheduler_kv_blocks_used",
        "swarmserve_scheduler_time_to_first_token_seconds_bucket",
        "swarmserve_scheduler_inter_token_latency_seconds_bucket",
    ):
        assert name in referenced, name
    assert any(p["datasource"]["type"] == "jaeger" for p in dashboard["panels"])  # links to traces
    assert any(t.get("exemplar") for p in dashboard["panels"] for t in p["targets"])
    jaeger = next(d for d in datasources if d["type"] == "prometheus")["jsonData"]["exemplarTraceIdDestinations"]
    assert jaeger[0]["datasourceUid"] in uids


def _flag(command: list[str], name: str) -> str:
    return next(arg.split("=", 1)[1] for arg in command if arg.startswith(f"{name}="))


def test_prometheus_scrapes_the_metrics_ports_and_traces_reach_jaeger():
    services = load(COMPOSE)["services"]
    prometheus = load(DEPLOY / "prometheus" / "prometheus.yml")
    targets = {t for job in prometheus["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    assert targets == {
        f"{name}:{_flag(services[name]['command'], '--metrics-port')}" for name in ("executor", "scheduler")
    }
    collector = load(DEPLOY / "otel-collector" / "config.yaml")
    grpc_port = collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[1]
    for name in ("executor", "scheduler"):
        assert services[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://otel-collector:{grpc_port}"
    pipeline = collector["service"]["pipelines"]["traces"]
    for kind in ("receivers", "processors", "exporters"):
        assert set(pipeline[kind]) <= set(collector[kind])
    assert set(collector["service"]["extensions"]) <= set(collector["extensions"])
    jaeger = load(DEPLOY / "jaeger" / "config.yaml")
    jaeger_port = jaeger["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[1]
    assert collector["exporters"]["otlp/jaeger"]["endpoint"] == f"jaeger:{jaeger_port}"
    ui_port = jaeger["extensions"]["jaeger_query"]["http"]["endpoint"].rsplit(":", 1)[1]
    assert f"127.0.0.1:{ui_port}:{ui_port}" in services["jaeger"]["ports"]
    assert f"http://127.0.0.1:{ui_port}/" in services["jaeger"]["healthcheck"]["test"]
    health_port = collector["extensions"]["health_check"]["endpoint"].rsplit(":", 1)[1]
    assert f"http://127.0.0.1:{health_port}/" in services["otel-collector"]["healthcheck"]["test"]
    for name, mounts in (
        ("otel-collector", "otel-collector/config.yaml"),
        ("jaeger", "jaeger/config.yaml"),
        ("prometheus", "prometheus/prometheus.yml"),
    ):
        assert any(v.startswith(f"./{mounts}:") for v in services[name]["volumes"]), name
    grafana = services["grafana"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert "./grafana/dashboards:/var/lib/grafana/dashboards:ro" in grafana["volumes"]
    assert (DEPLOY / "grafana" / "dashboards" / Path(home).name).exists()
    providers = load(DEPLOY / "grafana" / "provisioning" / "dashboards" / "dashboards.yml")["providers"]
    assert providers[0]["options"]["path"] == str(Path(home).parent)


def test_compose_publishes_on_loopback_only():
    """Issue 12, item 11: nothing is published on every host interface by default."""
    services = load(COMPOSE)["services"]
    published = [(name, port) for name, service in services.items() for port in service.get("ports", [])]
    assert published, "the compose file should publish the scheduler at least"
    for name, port in published:
        assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"


def test_compose_gives_the_scheduler_time_to_drain():
    scheduler = load(COMPOSE)["services"]["scheduler"]
    drain_s = float(next(a.split("=", 1)[1] for a in scheduler["command"] if a.startswith("--drain-timeout-s=")))
    grace = scheduler["stop_grace_period"]
    assert grace.endswith("s") and float(grace[:-1]) > drain_s


def test_compose_scheduler_keeps_its_id_across_container_recreation():
    """The executor serves one scheduler id; the default (host/listen) changes with the container."""
    command = load(COMPOSE)["services"]["scheduler"]["command"]
    assert any(a.startswith("--scheduler-id=") for a in command)


def _compose_config(tmp_path, *files: Path) -> dict:
    command = compose_command()
    if command is None:
        if os.environ.get("CI"):
            pytest.fail("neither `docker compose` nor `docker-compose` is installed (.ci/run installs docker-compose)")
        pytest.skip("no docker compose tool here (apt-get install docker-compose)")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    result = subprocess.run(
        [*command, *(a for f in files for a in ("-f", str(f))), "config"],
        capture_output=True,
        text=True,
        env=env,
        cwd=DEPLOY,
    )
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def test_scale_compose_puts_the_pairs_behind_one_gateway(tmp_path):
    """docker-compose.scale.yml over the base: the single pair off (profile), N pairs each
    running `swarmserve serve` with flags serve accepts, the gateway on the one published
    port pointing at every pair's HTTP front, health checks gating it, traces and metrics
    wired to the same collector and Prometheus."""
    from clients.cli import parse_args

    merged = _compose_config(tmp_path, COMPOSE, SCALE)["services"]  # validates; v2 leaves out inactive profiles
    started = {name for name, service in merged.items() if not service.get("profiles")}
    pairs = sorted(name for name in started if name.startswith("pair-"))
    assert len(pairs) >= 2 and started == {*pairs, "gateway", "otel-collector", "jaeger", "prometheus", "grafana"}
    services = {
        **load(COMPOSE)["services"],
        **load(SCALE)["services"],
    }  # as written (each tool renders ports its own way)
    assert services["executor"]["profiles"] == services["scheduler"]["profiles"] == ["single"]
    for name in started:
        assert merged[name].get("restart") == "unless-stopped", name
        assert merged[name]["healthcheck"]["test"][0] == "CMD", name

    gateway = services["gateway"]
    command = gateway["command"]
    assert command[0] == "launch" and "--policy=cache_aware" in command
    urls = command[command.index("--worker-urls") + 1 :]
    urls = urls[: next((i for i, a in enumerate(urls) if a.startswith("--")), len(urls))]
    published = [p for name in started for p in services[name].get("ports", [])]
    assert [p for p in gateway["ports"]] == ["127.0.0.1:8000:8000"] and all(
        str(p).startswith("127.0.0.1:") for p in published
    )
    assert not any(services[p].get("ports") for p in pairs), "agents reach the pairs only through the gateway"
    pair_ids = set()
    for name in pairs:
        pair = {**services[name], "command": merged[name]["command"]}  # with the variables' defaults in
        assert pair["command"][:2] == ["swarmserve", "serve"]
        config = parse_args(pair["command"][1:]).config  # every flag is one serve accepts
        assert f"http://{name}:{config.http_listen.rsplit(':', 1)[1]}" in urls
        assert gateway["depends_on"][name]["condition"] == "service_healthy"
        drain_s = float(_flag(pair["command"], "--drain-timeout-s"))
        assert drain_s < config.shutdown_grace_s < float(pair["stop_grace_period"].rstrip("s"))
        pair_ids.add(_flag(pair["command"], "--scheduler-id"))
    assert len(urls) == len(pairs) and len(pair_ids) == len(pairs)
    assert "/readiness" in " ".join(gateway["healthcheck"]["test"])

    collector = load(DEPLOY / "otel-collector" / "config.yaml")
    grpc_port = collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[1]
    for name in pairs:
        assert services[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://otel-collector:{grpc_port}"
    assert "--enable-trace" in command and _flag(command, "--otlp-traces-endpoint") == f"otel-collector:{grpc_port}"

    scrape = load(DEPLOY / "prometheus" / "prometheus.scale.yml")
    targets = {t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    metrics_port = int(_flag(services[pairs[0]]["command"], "--metrics-port"))
    assert targets == {f"{p}:{port}" for p in pairs for port in (metrics_port, metrics_port + 1)} | {
        f"gateway:{_flag(command, '--prometheus-port')}"
    }
    assert any(
        v.startswith("./prometheus/prometheus.scale.yml:/etc/prometheus/prometheus.yml")
        for v in services["prometheus"]["volumes"]
    )


K8S = DEPLOY / "k8s"
INFERENCE_POOL_CRD = ROOT / "tests" / "support" / "data" / "inferencepools.crd.yaml"
CORE_GROUPS = ("v1", "apps/v1", "policy/v1", "rbac.authorization.k8s.io/v1")


def k8s_resources() -> dict[tuple[str, str], dict]:
    """(kind, name) -> resource, for every document in deploy/k8s/*.yaml."""
    resources = {}
    for path in sorted(K8S.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            key = (document["kind"], document["metadata"]["name"])
            assert key not in resources, f"{path.name}: {key} twice"
            resources[key] = document
    return resources


def test_k8s_core_resources_validate_against_the_kubernetes_schemas():
    """kubernetes-validate (the Kubernetes OpenAPI schemas, strict: no unknown field)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    resources = k8s_resources()
    core = [r for r in resources.values() if r["apiVersion"] in CORE_GROUPS]
    assert {r["kind"] for r in core} >= {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "ConfigMap",
        "ServiceAccount",
        "Role",
        "RoleBinding",
    }
    for resource in core:
        kubernetes_validate.validate(resource, "1.37.0", strict=True)
    # The validator is strict: a misspelt probe field is refused.
    broken = json.loads(json.dumps(resources[("Deployment", "swarmserve")]))
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grcp"] = {"port": 50052}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.37.0", strict=True)


def _unknown_fields(value, schema: dict, path: str = "") -> list[str]:
    """Fields of `value` its OpenAPI schema does not declare (the API server would prune them)."""
    if isinstance(value, dict) and "properties" in schema:
        found = []
        for key, item in value.items():
            if key not in schema["properties"]:
                found.append(f"{path}.{key}")
            else:
                found += _unknown_fields(item, schema["properties"][key], f"{path}.{key}")
        return found
    if isinstance(value, list) and "items" in schema:
        return [f for i, item in enumerate(value) for f in _unknown_fields(item, schema["items"], f"{path}[{i}]")]
    return []


def test_k8s_inference_pool_validates_against_its_crd_schema():
    """The InferencePool against the inference extension's own CRD schema (JSON Schema, plus no
    undeclared field); Gateway and HTTPRoute, whose CRDs are not vendored, structurally below."""
    import jsonschema

    crd = yaml.safe_load(INFERENCE_POOL_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = version["schema"]["openAPIV3Schema"]
    pools = [r for r in k8s_resources().values() if r["kind"] == "InferencePool"]
    assert len(pools) == 1 and pools[0]["apiVersion"] == f"{crd['spec']['group']}/v1"
    jsonschema.Draft7Validator(schema).validate(pools[0])
    assert _unknown_fields(pools[0], schema) == []
    broken = json.loads(json.dumps(pools[0]))
    del broken["spec"]["targetPorts"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(broken)


def _container(pod_spec: dict, name: str) -> dict:
    return next(c for c in pod_spec["containers"] if c["name"] == name)


def _arg(command: list[str], flag: str) -> str:
    return next(a.split("=", 1)[1] for a in command if a.startswith(flag + "="))


def test_k8s_pieces_fit_together():
    """The pair's flags parse, probes hit the listen ports, the GPU is requested, the grace
    period covers the drain, and every selector and reference points at what exists."""
    from executor_svc.config import EngineConfig
    from executor_svc.flags import build_parser as executor_parser
    from scheduler_svc.load_report import KV_USAGE, RUNNING, WAITING
    from scheduler_svc.main import build_parser as scheduler_parser

    resources = k8s_resources()
    deployment = resources[("Deployment", "swarmserve")]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    pod = deployment["spec"]["template"]["spec"]
    executor, scheduler = _container(pod, "executor"), _container(pod, "scheduler")

    executor_args = executor_parser().parse_args(executor["command"][1:])
    scheduler_args = scheduler_parser().parse_args(scheduler["command"][1:])
    executor_port = int(executor_args.listen.rsplit(":", 1)[1])
    assert scheduler_args.executor == f"127.0.0.1:{executor_port}"  # its own pod's executor
    grpc_port = int(scheduler_args.listen.rsplit(":", 1)[1])
    http_port = int(scheduler_args.http_listen.rsplit(":", 1)[1])
    assert executor["resources"]["limits"]["nvidia.com/gpu"] == 1 and executor_args.device == "cuda"
    for container, port in ((executor, executor_port), (scheduler, grpc_port)):
        assert container["startupProbe"]["grpc"]["port"] == port  # the standard grpc.health.v1 service
    assert executor["livenessProbe"]["grpc"]["port"] == executor_port
    assert scheduler["readinessProbe"]["grpc"]["port"] == grpc_port  # NOT_SERVING while draining
    named_ports = {p["name"]: p["containerPort"] for p in scheduler["ports"]}
    assert named_ports["http"] == http_port and named_ports["grpc"] == grpc_port

    drain_s = scheduler_args.drain_timeout_s
    pre_stop = executor["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep" and float(pre_stop[1]) >= drain_s  # the executor outlives the drain
    assert pod["terminationGracePeriodSeconds"] > float(pre_stop[1])

    service = resources[("Service", "swarmserve")]
    assert service["spec"]["selector"].items() <= labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(named_ports)
    pdb = resources[("PodDisruptionBudget", "swarmserve")]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] < deployment["spec"]["replicas"]

    pool = resources[("InferencePool", "swarmserve")]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [http_port]  # /metrics and the API
    picker = pool["spec"]["endpointPickerRef"]
    epp_service = resources[("Service", picker["name"])]
    assert picker["port"]["number"] in {p["port"] for p in epp_service["spec"]["ports"]}
    epp_deployment = resources[("Deployment", picker["name"])]
    epp_pod = epp_deployment["spec"]["template"]["spec"]
    assert epp_service["spec"]["selector"].items() <= epp_deployment["spec"]["template"]["metadata"]["labels"].items()
    epp = _container(epp_pod, "epp")
    assert _arg(epp["args"], "--pool-name") == pool["metadata"]["name"]
    assert _arg(epp["args"], "--grpc-port") == str(picker["port"]["number"])
    # The gauges it scrapes are the ones swarmserve exports under those names.
    assert _arg(epp["args"], "--total-queued-requests-metric") == WAITING
    assert _arg(epp["args"], "--total-running-requests-metric") == RUNNING
    assert _arg(epp["args"], "--kv-cache-usage-percentage-metric") == KV_USAGE
    assert resources[("ServiceAccount", epp_pod["serviceAccountName"])]
    role = resources[("RoleBinding", "swarmserve-epp")]["roleRef"]["name"]
    granted = {r for rule in resources[("Role", role)]["rules"] for r in rule["resources"]}
    assert {"inferencepools", "pods"} <= granted

    config_path = _arg(epp["args"], "--config-file")
    (mount,) = [m for m in epp["volumeMounts"] if config_path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in epp_pod["volumes"] if v["name"] == mount["name"]]
    picker_config = yaml.safe_load(
        resources[("ConfigMap", volume["configMap"]["name"])]["data"][Path(config_path).name]
    )
    assert picker_config["kind"] == "EndpointPickerConfig"
    defined = {p.get("name", p["type"]) for p in picker_config["plugins"]}
    for profile in picker_config["schedulingProfiles"]:
        assert {p["pluginRef"] for p in profile["plugins"]} <= defined
    prefix = next(p for p in picker_config["plugins"] if p["type"] == "prefix-cache-scorer")
    assert prefix["parameters"]["blockSize"] == EngineConfig.block_size

    route = resources[("HTTPRoute", "swarmserve")]
    (backend,) = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        pool["metadata"]["name"],
    )
    (parent,) = route["spec"]["parentRefs"]
    assert ("Gateway", parent["name"]) in resources
