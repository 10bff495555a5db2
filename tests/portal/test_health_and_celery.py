import time

import pytest
import redis
from django.conf import settings

from conftest import start_celery, subprocess_env
from portal.tasks import BEAT_PULSE_KEY


@pytest.mark.slow
def test_beat_schedules_a_periodic_task_that_a_real_worker_runs(celery_worker_process, tmp_path):
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(BEAT_PULSE_KEY)
    beat = start_celery("beat", tmp_path, env=subprocess_env(BEAT_PULSE_SECONDS="1"))
    try:
        deadline = time.monotonic() + 60
        pulses = set()
        while time.monotonic() < deadline and len(pulses) < 2:
            value = client.get(BEAT_PULSE_KEY)
            if value:
                pulses.add(value)
            time.sleep(0.2)
        assert len(pulses) >= 2, beat.log.read_text()[-2000:]
    finally:
        beat.stop()


@pytest.mark.slow
def test_healthz_is_ok_with_a_worker(client, celery_worker_process):
    response = client.get("/healthz")
    body = response.json()
    assert response.status_code == 200, body
    assert body["database"]["ok"] and body["redis"]["ok"] and body["celery"]["ok"]
    assert body["celery"]["workers"]


@pytest.mark.django_db
def test_healthz_is_503_when_no_worker_answers(client):
    response = client.get("/healthz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "degraded"
    assert body["database"]["ok"] and body["redis"]["ok"]
    assert body["celery"]["ok"] is False


@pytest.mark.django_db
def test_healthz_is_503_when_redis_is_down(client, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    response = client.get("/healthz")
    assert response.status_code == 503
    assert response.json()["redis"]["ok"] is False
