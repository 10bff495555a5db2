import time

import pytest
import redis
from django.conf import settings

from conftest import start_celery, subprocess_env
from portal.tasks import BEAT_PULSE_KEY, WORKER_PULSE_KEY


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
def test_readiness_names_the_running_worker_from_its_pulse_quickly(client, celery_worker_process):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        started = time.perf_counter()
        response = client.get("/readyz")
        took = time.perf_counter() - started
        body = response.json()
        if body["celery"]["workers"]:
            break
        time.sleep(0.5)
    assert response.status_code == 200, body
    assert body["database"]["ok"] and body["redis"]["ok"] and body["celery"]["ok"], body
    assert any(name.startswith("test-") for name in body["celery"]["workers"]), body
    assert took < 0.5, f"readiness took {took:.2f} s"  # no broadcast ping to wait on


@pytest.mark.django_db
def test_readiness_is_200_but_degraded_when_no_worker_pulses(client):
    redis.Redis.from_url(settings.REDIS_URL).delete(WORKER_PULSE_KEY, BEAT_PULSE_KEY)
    response = client.get("/healthz")  # the older name of /readyz
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "degraded"
    assert body["database"]["ok"] and body["redis"]["ok"]
    assert body["celery"] == {"ok": False, "workers": []}
    assert body["beat"] == {"ok": False, "pulse_age_seconds": None}
