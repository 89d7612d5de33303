"""deploy/: the image, the compose file, the Kubernetes manifests and the Grafana dashboard are what they claim.

Nothing is built or pulled: the files are parsed, every command line in them goes through tokenload's real
argument parser (and the process-layout checks `tokenload run` applies), the manifests are validated against
the Kubernetes API's schemas (kubernetes-validate, strict), `docker compose config` checks the compose file
where a compose is installed, and every query of the dashboard names a metric the exporter really serves.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tokenload.cli import build_parser
from tokenload.compat import tomllib
from tokenload.exporter import LiveMetrics
from tokenload.load.runner import ProcessLayout
from tokenload.workload.scenario import load_scenario

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
MANIFESTS = sorted((DEPLOY / "k8s").rglob("*.yaml"))
DASHBOARD = DEPLOY / "grafana" / "tokenload.json"
KEY_VARS = ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "OPENAI_API_KEY")


def parse_command(argv: list[str]) -> Any:
    """`argv` as the `tokenload` console script parses it; a `run`'s layout checked as `tokenload run` does."""
    args = build_parser().parse_args(argv)
    if args.command == "run":
        ProcessLayout(processes=ProcessLayout.process_count(args.processes), master=args.master, worker=args.worker,
                      master_host=args.master_host, master_port=args.master_port,
                      master_bind_host=args.master_bind_host, expect_workers=args.expect_workers)
    return args


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# --- the image -------------------------------------------------------------------------------------------------

def dockerfile_stages() -> list[list[str]]:
    """The Dockerfile's instructions (continuation lines joined), one list per `FROM` stage."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text(encoding="utf-8"))
    stages: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def test_the_image_builds_in_one_stage_and_runs_tokenload_from_a_slim_one_without_a_compiler() -> None:
    build, final = dockerfile_stages()[0], dockerfile_stages()[-1]
    assert len(dockerfile_stages()) >= 2
    assert all("-slim" in stage[0] for stage in dockerfile_stages())
    assert any("gcc" in line for line in build) and any("pip install" in line and " ." in line for line in build)
    assert not any(re.search(r"\b(gcc|cc|build-essential|clang)\b", line) for line in final if not line.startswith("FROM"))
    assert any(line.startswith("COPY --from=") for line in final)
    # Every package directory pyproject installs is copied into the build.
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    copied = {line.split()[1] for line in build if line.startswith("COPY ")}
    roots = {config["tool"]["setuptools"]["package-dir"].get(p, p.replace(".", "/")).split("/")[0]
             for p in config["tool"]["setuptools"]["packages"]}
    assert roots <= copied
    assert all((ROOT / src).exists() for line in build if line.startswith("COPY ") for src in line.split()[1:-1])
    # ENTRYPOINT is the console script pyproject installs; CMD is arguments it accepts.
    (entry,) = [json.loads(line.split(None, 1)[1]) for line in final if line.startswith("ENTRYPOINT")]
    (cmd,) = [json.loads(line.split(None, 1)[1]) for line in final if line.startswith("CMD")]
    assert entry == ["tokenload"] and "tokenload" in config["project"]["scripts"]
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(cmd)
    assert exit_.value.code == 0
    assert any(line.startswith("USER ") and line.split()[1] != "root" for line in final)


# --- docker compose --------------------------------------------------------------------------------------------

def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's `${VAR:-default}` and `${VAR}`, from `env` (unset: the default, else empty)."""
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: env.get(m.group(1)) or (m.group(2) or ""), text)


def compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(interpolate(COMPOSE.read_text(encoding="utf-8"), env or {}))
    return data


@pytest.mark.parametrize("env", [{}, {"WORKERS": "4", "RUN": "ramp-7", "SCENARIO": "smoke"}])
def test_every_compose_command_parses_and_master_and_workers_agree(env: dict[str, str]) -> None:
    services = compose(env)["services"]
    commands = {name: [str(a) for a in service["command"]] for name, service in services.items()}
    for argv in commands.values():
        parse_command(argv)
    master, worker, sim = commands["master"], commands["worker"], commands["sim"]
    assert "--master" in master and "--worker" in worker and sim[0] == "sim"
    assert flag(master, "--out") == flag(worker, "--out") == f"/runs/{env.get('RUN', 'run')}"
    assert master[1] == worker[1] == env.get("SCENARIO", "ramp")
    assert flag(worker, "--master-host") == "master" and flag(master, "--master-bind-host") == "0.0.0.0"
    assert int(flag(master, "--expect-workers")) == int(services["worker"]["deploy"]["replicas"]) == \
        int(env.get("WORKERS", "2"))
    assert services["master"]["ports"] == [f"9464:{flag(master, '--prometheus-port')}"]
    assert flag(master, "--prometheus-host") == "0.0.0.0"
    # The default channel is the simulator service, on the port and model it serves.
    channel = services["master"]["environment"]
    assert channel["ANTHROPIC_BASE_URL"] == f"http://sim:{flag(sim, '--port')}/api"
    assert channel["ANTHROPIC_MODEL"] == flag(sim, "--model")
    # Only the master has the run directory's volume: workers send their records over Locust's connection.
    assert services["master"]["volumes"] == ["runs:/runs"] and "volumes" not in services["worker"]
    for name in ("master", "worker"):
        assert all(not services[name]["environment"][k] for k in KEY_VARS if k in services[name]["environment"])


def test_compose_passes_keys_through_and_writes_none() -> None:
    raw = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    environment = raw["x-tokenload"]["environment"]
    assert environment["ANTHROPIC_API_KEY"] == "${ANTHROPIC_API_KEY:-}"
    assert environment["ANTHROPIC_AUTH_TOKEN"] == "${ANTHROPIC_AUTH_TOKEN:-}"
    keyed = compose({"ANTHROPIC_API_KEY": "sk-from-the-shell"})["services"]
    assert keyed["worker"]["environment"]["ANTHROPIC_API_KEY"] == "sk-from-the-shell"


def compose_cli() -> list[str] | None:
    """`docker compose` (the plugin), else the standalone `docker-compose`, else None."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_docker_compose_config_validates_the_file() -> None:
    cli = compose_cli()
    if cli is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed here")
    env = {k: v for k, v in os.environ.items() if k not in KEY_VARS and not k.startswith(("ANTHROPIC_", "OPENAI_"))}
    result = subprocess.run([*cli, "-f", str(COMPOSE), "--profile", "sim", "config"], capture_output=True, text=True,
                            env={**env, "WORKERS": "3"}, timeout=60)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)["services"]
    assert set(resolved) == {"master", "worker", "sim"}
    assert flag([str(a) for a in resolved["master"]["command"]], "--expect-workers") == "3"


# --- Kubernetes ------------------------------------------------------------------------------------------------

def manifests() -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in manifests() if doc["kind"] == kind}


def test_every_manifest_is_valid_against_the_kubernetes_schemas() -> None:
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    assert len(manifests()) >= 8
    for doc in manifests():
        kubernetes_validate.validate(doc, version, strict=True)


def container(kind: str, name: str) -> dict[str, Any]:
    spec = by_kind(kind)[name]["spec"]["template"]["spec"] if kind != "Pod" else by_kind(kind)[name]["spec"]
    (only,) = spec["containers"]
    return dict(only)


def expanded(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' `$(VAR)` expansion of a container's args from its environment."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def test_every_k8s_command_parses_and_master_and_workers_agree() -> None:
    env = by_kind("ConfigMap")["tokenload-env"]["data"]
    master = expanded(container("Job", "tokenload-master")["args"], env)
    worker = expanded(container("Deployment", "tokenload-worker")["args"], env)
    sim = container("Deployment", "tokenload-sim")["args"]
    for argv in (master, worker, sim):
        parse_command(argv)
    assert flag(master, "--out") == flag(worker, "--out") == f"/runs/{env['RUN_NAME']}"
    assert int(flag(master, "--expect-workers")) == by_kind("Deployment")["tokenload-worker"]["spec"]["replicas"]
    service = by_kind("Service")[flag(worker, "--master-host")]
    job_labels = by_kind("Job")["tokenload-master"]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= job_labels.items()
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert ports == {"locust": int(flag(master, "--master-port") if "--master-port" in master else 5557),
                     "metrics": int(flag(master, "--prometheus-port"))}
    # The run directory's volume is the master's alone; a worker's /runs is its own.
    volumes = {kind: {v["name"]: v for v in by_kind(kind)[name]["spec"]["template"]["spec"]["volumes"]}
               for kind, name in (("Job", "tokenload-master"), ("Deployment", "tokenload-worker"))}
    assert volumes["Job"]["runs"]["persistentVolumeClaim"]["claimName"] in by_kind("PersistentVolumeClaim")
    assert volumes["Deployment"]["runs"] == {"name": "runs", "emptyDir": {}}
    annotations = by_kind("Job")["tokenload-master"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == flag(master, "--prometheus-port")
    # The default channel is the simulator's Service, on the port and model it serves.
    sim_service = by_kind("Service")["tokenload-sim"]
    assert env["ANTHROPIC_BASE_URL"] == f"http://tokenload-sim:{sim_service['spec']['ports'][0]['port']}/api"
    assert env["ANTHROPIC_MODEL"] == flag(sim, "--model") and flag(sim, "--port") == "8000"


def test_k8s_scenario_loads_and_the_key_comes_from_a_secret_not_in_the_repository(tmp_path: Path) -> None:
    scenario = tmp_path / "scenario.toml"
    scenario.write_text(by_kind("ConfigMap")["tokenload-scenario"]["data"]["scenario.toml"])
    assert load_scenario(str(scenario)).name == "k8s-ramp"
    for kind, name in (("Job", "tokenload-master"), ("Deployment", "tokenload-worker")):
        spec = container(kind, name)
        assert flag(spec["args"], "run") == "/etc/tokenload/scenario.toml"
        assert {"secretRef": {"name": "tokenload-channel", "optional": True}} in spec["envFrom"]
        assert {"configMapRef": {"name": "tokenload-env"}} in spec["envFrom"]
        assert "env" not in spec
    assert "Secret" not in {doc["kind"] for doc in manifests()}
    assert not any(k in by_kind("ConfigMap")["tokenload-env"]["data"] for k in KEY_VARS)


# --- Grafana ---------------------------------------------------------------------------------------------------

def exported_names() -> set[str]:
    """Every sample name the exporter serves once it has seen a record (histograms: _bucket, _count, _sum)."""
    metrics = LiveMetrics("r")
    metrics.observe([{"status": "ok", "step": 1, "output_tokens": 3, "ttft_s": 0.1, "tpot_s": 0.01,
                      "itl_p50_s": 0.01, "e2e_s": 0.2}])
    metrics.set_active_users(1)
    return {s.name for family in metrics.registry.collect() for s in family.samples}


def test_the_dashboard_queries_only_what_the_exporter_serves_and_all_of_it() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\btokenload_\w+", expr)}
    served = exported_names()
    assert used <= served, used - served
    for base in ("ttft", "tpot", "itl", "e2e"):
        assert f"tokenload_{base}_seconds_bucket" in used
    assert {"tokenload_requests_total", "tokenload_output_tokens_total", "tokenload_active_users"} <= used
    for base in ("ttft", "tpot"):  # percentiles from the histogram's buckets, not from averages
        assert any(f"histogram_quantile(0.99, sum by (le) (rate(tokenload_{base}_seconds_bucket" in e for e in exprs)
    assert any("sum by (status, error_kind)" in e for e in exprs)
    # One dashboard for a run and a watch: a run picker, a rate window long enough for a watch, a data source.
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "run_id", "window"} <= set(variables)
    assert "1h" in variables["window"]["query"].split(",")
    assert all('run_id=~"$run_id"' in e and ("[$window]" in e or "rate" not in e) for e in exprs)
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"])
    assert any("offset 1d" in e for e in exprs) and any(p["type"] == "heatmap" for p in dashboard["panels"])
