"""There is no Docker engine on these machines: check what the compose file and Procfile promise."""

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_runs_every_production_process():
    services = _compose()["services"]
    assert {"postgres", "redis", "web", "worker", "beat", "agent", "migrate"} <= set(services)
    web = services["web"]["command"]
    assert web[:2] == ["sh", "-c"] and web[2].startswith("exec uvicorn portal.asgi:application ")
    assert '--workers "${WEB_CONCURRENCY:-$(nproc)}"' in web[2].replace("$$", "$")  # one per core by default
    assert services["worker"]["command"][:4] == ["celery", "-A", "portal", "worker"]
    assert services["beat"]["command"][:4] == ["celery", "-A", "portal", "beat"]
    assert services["agent"]["command"] == ["python", "-m", "agents"]
    assert services["agent"]["runtime"] == "nvidia"
    assert services["agent"]["profiles"] == ["gpu"]


def test_compose_points_every_app_process_at_the_servers_and_forbids_the_default_secret():
    services = _compose()["services"]
    for name in ("web", "worker", "beat", "migrate"):
        environment = services[name]["environment"]
        assert environment["DEBUG"] == "0"
        assert (
            environment["DATABASE_URL"].startswith("postgresql://")
            and "@postgres:5432/" in environment["DATABASE_URL"]
        )
        assert environment["REDIS_URL"] == "redis://redis:6379/0"
        assert ":?" in environment["SECRET_KEY"]  # compose refuses to start without one
        assert services[name]["depends_on"]


def test_the_dockerfile_installs_the_project_and_serves_asgi():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11", dockerfile, re.M)
    assert "pip install ." in dockerfile
    assert "portal.asgi:application" in dockerfile


def test_the_procfile_runs_web_worker_and_beat():
    procfile = dict(
        line.split(":", 1)
        for line in (ROOT / "Procfile").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert {"web", "worker", "beat"} <= set(procfile)
    assert "uvicorn portal.asgi:application" in procfile["web"]


def test_every_way_of_serving_the_portal_relays_jupyter_websockets_as_bytes():
    """portal/ws_relay.py: without it a kernel's messages are parsed and framed again in the portal."""
    relay = "--ws portal.ws_relay:WebSocketRelay"
    assert relay in (ROOT / "Procfile").read_text()
    assert relay in _compose()["services"]["web"]["command"][2]
    assert '"--ws", "portal.ws_relay:WebSocketRelay"' in (ROOT / "Dockerfile").read_text()
