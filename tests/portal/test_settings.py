"""The settings module: importing it computes every value and starts nothing."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_settings_starts_no_embedded_server(tmp_path):
    data = tmp_path / "data"
    code = (
        "import json; from portal import settings as s; "
        "print(json.dumps([s.DATABASES['default']['HOST'], s.REDIS_URL, s.CELERY_BROKER_URL]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "SUANLI_DATA_DIR": str(data)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    database_host, redis_url, broker_url = json.loads(result.stdout.strip().splitlines()[-1])
    # the URLs of the embedded servers, computed from the data directory ...
    assert database_host == str(data.resolve() / "pg")
    assert redis_url == f"unix://{data.resolve() / 'redis' / 'redis.sock'}"
    assert broker_url == f"redis+socket://{data.resolve() / 'redis' / 'redis.sock'}"
    # ... and nothing there: no database cluster, no socket, not even the lock file
    assert not data.exists(), sorted(str(p.relative_to(data)) for p in data.rglob("*"))


def test_a_bad_home_retention_setting_fails_loudly(tmp_path):
    for name, value in (("HOMES_RETENTION_IDLE_DAYS", "-1"), ("HOMES_RETENTION_WARN_DAYS", "0")):
        result = subprocess.run(
            [sys.executable, "-c", "import portal.settings"],
            cwd=ROOT,
            env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "SUANLI_DATA_DIR": str(tmp_path), name: value},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2, (name, result.stderr)
        assert "HOMES_RETENTION_" in result.stderr


def test_every_connection_plans_joins_within_the_collapse_limit(db):
    """A session read joins seven tables; the settings' join_collapse_limit keeps PostgreSQL from
    searching every order of them (docs: README, DATABASE_JOIN_COLLAPSE_LIMIT)."""
    from django.conf import settings
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SHOW join_collapse_limit")
        assert cursor.fetchone()[0] == str(settings.DATABASE_JOIN_COLLAPSE_LIMIT) == "4"


def test_a_database_url_with_its_own_options_keeps_them(tmp_path):
    code = "from portal import settings as s; print(s.DATABASES['default']['OPTIONS']['options'])"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={
            "PATH": "/usr/bin:/bin",
            "HOME": "/tmp",
            "SUANLI_DATA_DIR": str(tmp_path),
            "DATABASE_URL": "postgresql://u@db/suanli?options=-c%20statement_timeout%3D5000",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "-c statement_timeout=5000"
