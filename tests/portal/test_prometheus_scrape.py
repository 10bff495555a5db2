"""Debian's real Prometheus scrapes the portal and an agent, and PromQL reads the running sessions back."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time

import httpx
import pytest
import yaml
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from agents.prometheus import exposition
from provisioner.models import Session
from tests.agents import conftest as agent_fixtures
from tests.agents.conftest import NODE_TOKEN, REPO, workload_spec
from tests.provisioner.factories import catalog_make, node_make, profiles_ensure, session_row, user_make
from tests.stack import free_port

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
PROMETHEUS = shutil.which("prometheus")
start_agent, token_file = agent_fixtures.start_agent, agent_fixtures.token_file  # the agent tests' fixtures


def _query(url: str, promql: str) -> list:
    response = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=5)
    response.raise_for_status()  # a 503 "Service Unavailable" while Prometheus starts: the caller retries
    answer = response.json()
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def _wait_for_value(url: str, promql: str, timeout: float = 60.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = _query(url, promql)
        except httpx.HTTPError:  # still starting
            result = []
        if result:
            return float(result[0]["value"][1])
        time.sleep(0.5)
    raise AssertionError(f"no answer to {promql} within {timeout}s; targets: {_targets(url)}")


def _targets(url: str) -> list:
    return [
        (t["labels"]["job"], t["health"], t.get("lastError"))
        for t in httpx.get(f"{url}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
    ]


@pytest.mark.skipif(
    PROMETHEUS is None, reason="Debian's prometheus binary is not installed (apt install prometheus)"
)
def test_prometheus_scrapes_portal_and_agent_and_promql_counts_running_sessions(
    live_server, start_agent, tmp_path
):
    profiles_ensure()
    model = catalog_make()
    user = user_make()
    node = node_make("scraped-host")
    for profile in ("1/8", "1/4", "whole"):
        Session.objects.filter(pk=session_row(user, profile=profile, model=model).pk).update(
            state=Session.State.RUNNING, node=node
        )
    session_row(user, profile="1/8", model=model)  # queued: not running

    agent = start_agent(tmp_path / "state", "--sandbox", "none", "--vgpu-lib", str(tmp_path / "absent.so"))
    gpu = agent.inventory()["gpus"][0]
    allocation = {"device_uuid": gpu["uuid"], "profile": "1/8", "slot_start": 7, "slot_count": 1,
                  "sharing_policy": "best-effort"}  # fmt: skip
    assert agent.put_workload(workload_spec("scraped-1", allocation)).status_code == 201
    agent.wait_state("scraped-1", ("running",))

    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {
                "job_name": "portal",
                "static_configs": [{"targets": [live_server.url.removeprefix("http://")]}],
            },
            {
                "job_name": "agent",
                "authorization": {"type": "Bearer", "credentials": NODE_TOKEN},
                "static_configs": [{"targets": [agent.url.removeprefix("http://")]}],
            },
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (tmp_path / "prometheus.log").open("wb")  # noqa: SIM115 - closed in the finally below
    server = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        assert _wait_for_value(url, 'sum(suanli_sessions_running{job="portal"})') == 3
        assert _wait_for_value(url, 'suanli_sessions_running{profile="whole"}') == 1
        assert _wait_for_value(url, 'sum(suanli_session_running{job="agent"})') == 1
        assert _wait_for_value(url, 'DCGM_FI_DEV_GPU_UTIL{job="agent", gpu="0"}') == 37
        assert {job: health for job, health, _ in _targets(url)} == {"portal": "up", "agent": "up"}
    finally:
        server.terminate()
        server.wait(10)
        log.close()


@pytest.mark.django_db
def test_the_docs_dashboard_and_scrape_config_name_only_what_is_exported():
    exported = {f.name for f in text_string_to_metric_families(Client().get("/metrics").content.decode())}
    agent_text = exposition(inventory={"gpus": []}, metrics={"gpus": []}, workloads=[], hostname="h").decode()
    exported |= {f.name for f in text_string_to_metric_families(agent_text)}
    dashboard = json.loads((REPO / "docs" / "grafana-dashboard.json").read_text())
    named = {
        name for panel in dashboard["panels"] for target in panel["targets"]
        for name in re.findall(r"\b(?:DCGM_FI_\w+|suanli_\w+)", target["expr"])
    }  # fmt: skip
    assert named and named <= exported, named - exported
    config = yaml.safe_load((REPO / "docs" / "prometheus.yml").read_text())
    assert {job["metrics_path"] for job in config["scrape_configs"]} == {"/metrics"}
    if PROMETHEUS:
        check = subprocess.run(
            ["promtool", "check", "config", "--syntax-only", str(REPO / "docs" / "prometheus.yml")],
            capture_output=True,
            text=True,
        )
        assert check.returncode == 0, check.stdout + check.stderr
