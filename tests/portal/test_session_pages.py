"""The session pages: launch shows the price, card burn, runway and whether it starts now; a launch lands on
its live page; strangers get 404; the operators' page shows the slot map and Q = C · N · u."""

from __future__ import annotations

import pytest
from django.core.cache import cache
from django.test import Client

from billing.services.pricing import burn_rate_set, price_set
from billing.services.topups import wallet_credit_promotion
from portal.services import user_create
from provisioner.models import Device, Environment, GpuModel, Profile, Session
from provisioner.services.nodes import node_enroll

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet(settings):
    GpuModel.objects.create(name="T4", memory_mib=15360, peak_tflops=65.0, profiles=["whole", "1/2"])
    for name, kind, eighths in (("whole", "whole", 8), ("1/2", "slice", 4)):
        Profile.objects.get_or_create(
            name=name, defaults={"kind": kind, "eighths": eighths, "quota_eighths": eighths}
        )
    Environment.objects.get_or_create(name="python-3.11", defaults={"python": "/usr/bin/python3"})
    node = node_enroll(name="node-t", address="http://127.0.0.1:9").node
    model = GpuModel.objects.get(name="T4")
    device = Device.objects.create(
        node=node, uuid="GPU-t4-0", index=0, gpu_model=model, nvml_name="Tesla T4", memory_mib=15360,
        last_metrics={"gpu_util_percent": 50, "memory_used_mib": 1000},
    )  # fmt: skip
    price_set(gpu_model="T4", profile="whole", price_micros_per_hour=2_000_000)
    burn_rate_set(gpu_model="T4", multiplier_milli=500)
    return device


def _user(name: str, *, funded: int = 0, staff: bool = False):
    user = user_create(username=name, email=f"{name}@example.com", password="pw-123456789", is_staff=staff)
    if funded:
        wallet_credit_promotion(account=user.account, amount_micros=funded, idempotency_key=f"fund-{name}")
    client = Client()
    client.force_login(user)
    return user, client


def test_the_launch_page_shows_price_burn_runway_and_that_it_starts_now(fleet):
    _user_obj, client = _user("ada", funded=4_000_000)
    page = client.get("/launch/?gpu_model=T4&profile=1/2").content.decode()
    assert "1.00" in page  # half of 2.00/h
    assert "0.25" in page  # 1/2 × 0.5 card-hours per hour
    assert "4 h" in page or "4h" in page  # 4.00 of wallet at 1.00/h
    assert 'data-testid="starts"><span class="badge ok">' in page


def test_a_launch_lands_on_its_live_page_and_a_stranger_gets_404(fleet, django_capture_on_commit_callbacks):
    user, client = _user("ada", funded=4_000_000)
    with django_capture_on_commit_callbacks(execute=False):
        response = client.post(
            "/launch/",
            {"gpu_model": "T4", "profile": "1/2", "environment": "python-3.11", "idempotency_key": "k-1"},
        )
    session = Session.objects.get(owner=user)
    assert response.status_code == 302 and response["Location"] == f"/sessions/{session.id}/"
    assert session.state == Session.State.PLACING and session.slot_count == 4
    page = client.get(response["Location"]).content.decode()
    assert "Placing" in page and "7680 MiB" in page and "50% of the SMs" in page
    assert client.get(f"/sessions/{session.id}/live").status_code == 200

    _stranger, other = _user("eve")
    assert other.get(f"/sessions/{session.id}/").status_code == 404
    assert other.post(f"/sessions/{session.id}/stop").status_code == 404
    session.refresh_from_db()
    assert session.state == Session.State.PLACING


def test_a_launch_without_money_says_so_and_creates_nothing(fleet):
    user, client = _user("bob")
    response = client.post("/launch/", {"gpu_model": "T4", "profile": "whole", "environment": "python-3.11"})
    assert response.status_code == 200
    assert Session.objects.filter(owner=user).count() == 0
    assert "no funds" in response.content.decode() or "funds" in response.content.decode().lower()


def test_operations_is_for_staff_and_shows_slots_and_q(fleet):
    _user_obj, client = _user("ada")
    assert client.get("/operations/").status_code == 302  # to the admin login
    _admin, staff = _user("root", staff=True)
    page = staff.get("/operations/").content.decode()
    assert "node-t" in page and 'class="slotmap"' in page
    assert "32.5 TFLOPS" in page  # 65 TFLOPS × 50 %


def test_the_landing_page_lists_prices_for_anyone(fleet):
    page = Client().get("/").content.decode()
    assert 'data-testid="prices"' in page and "T4" in page and "2.00" in page


def test_a_launch_form_posted_twice_makes_one_session(fleet, django_capture_on_commit_callbacks):
    user, client = _user("ada", funded=4_000_000)
    form = {"gpu_model": "T4", "profile": "1/2", "environment": "python-3.11", "idempotency_key": "same"}
    with django_capture_on_commit_callbacks(execute=False):
        first = client.post("/launch/", form)
        second = client.post("/launch/", form)
    assert first["Location"] == second["Location"]
    assert Session.objects.filter(owner=user).count() == 1


def test_launches_from_the_page_are_throttled_past_the_launch_rate(
    fleet, settings, django_capture_on_commit_callbacks
):
    settings.SESSION_LAUNCH_RATE = (2, 60)
    user, client = _user("ada", funded=40_000_000)
    cache.delete(f"launch:user:{user.pk}")  # a count left by an earlier run's user of the same id
    form = {"gpu_model": "T4", "profile": "1/2", "environment": "python-3.11"}
    with django_capture_on_commit_callbacks(execute=False):
        answers = [client.post("/launch/", {**form, "idempotency_key": f"k-{i}"}) for i in range(3)]
    assert [a.status_code for a in answers] == [302, 302, 200]
    assert "Too many attempts" in answers[2].content.decode()
    assert Session.objects.filter(owner=user).count() == 2


def test_a_stale_page_of_a_stopped_session_says_so_and_stop_again_is_harmless(
    fleet, django_capture_on_commit_callbacks
):
    user, client = _user("ada", funded=4_000_000)
    with django_capture_on_commit_callbacks(execute=False):
        client.post("/launch/", {"gpu_model": "T4", "profile": "whole", "environment": "python-3.11"})
        session = Session.objects.get(owner=user)
        client.post(f"/sessions/{session.id}/stop")
        again = client.post(f"/sessions/{session.id}/stop", follow=True)
    assert again.status_code == 200
    session.refresh_from_db()
    assert session.state in (Session.State.STOPPING, Session.State.STOPPED)
    page = client.get(f"/sessions/{session.id}/").content.decode()
    assert "Open JupyterLab" not in page and "data-live-url" not in page or session.state == "stopping"


def test_an_api_path_that_matches_no_route_answers_the_standard_error_body():
    response = Client().get("/api/v1/cards/-1")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
    assert Client().get("/no-such-page/").status_code == 404


def test_a_chinese_reader_sees_the_lifecycle_in_chinese(fleet, django_capture_on_commit_callbacks):
    user = user_create(username="li", email="li@example.com", password="pw-123456789", language="zh-hans")
    wallet_credit_promotion(account=user.account, amount_micros=4_000_000, idempotency_key="fund-li")
    client = Client()
    client.force_login(user)
    with django_capture_on_commit_callbacks(execute=False):
        client.post("/launch/", {"gpu_model": "T4", "profile": "1/2", "environment": "python-3.11"})
    session = Session.objects.get(owner=user)
    assert (session.reason_key, session.reason_params) == ("placed_on", {"node": "node-t"})
    page = client.get(f"/sessions/{session.id}/", HTTP_ACCEPT_LANGUAGE="zh-hans").content.decode()
    assert "已分配到 node-t" in page and "由 li 启动" in page
    assert "Placed on" not in page and "Launched by" not in page


def test_the_page_says_enforced_only_for_what_the_node_reports_enforced(
    fleet, django_capture_on_commit_callbacks
):
    user, client = _user("eve", funded=4_000_000)
    with django_capture_on_commit_callbacks(execute=False):
        client.post("/launch/", {"gpu_model": "T4", "profile": "1/2", "environment": "python-3.11"})
    session = Session.objects.get(owner=user)

    def badges(language: str = "en") -> dict[str, str]:
        import re

        page = client.get(f"/sessions/{session.id}/", HTTP_ACCEPT_LANGUAGE=language).content.decode()
        found = re.findall(r'data-testid="enforced-(\w+)">([^<]+)</span> <small class="muted">([^<]+)<', page)
        return {name: f"{badge} | {why}" for name, badge, why in found}

    # Nothing reported yet: never claim more than is known.
    assert all(text.startswith("advisory") for text in badges().values()) and len(badges()) == 3
    session.enforcement = {
        "device": {"enforced": True, "by": "device-nodes"},
        "memory": {"enforced": False, "by": "no-libvgpu"},
        "compute": {"enforced": False, "by": "time-slicing"},
    }
    session.save(update_fields=["enforcement"])
    seen = badges()
    assert seen["device"] == "enforced | the sandbox&#x27;s /dev holds only this GPU"
    assert seen["memory"] == "advisory | HAMi-core (libvgpu.so) is not installed on this node"
    assert seen["compute"].startswith("advisory | time-sliced")
    user.language = "zh-hans"  # a reader's own language wins over the browser's
    user.save(update_fields=["language"])
    chinese = badges("zh-hans")
    assert chinese["device"].startswith("已强制") and chinese["memory"].startswith("仅供参考")


def test_the_page_says_what_counts_as_idle_with_the_settings_figures(
    fleet, settings, django_capture_on_commit_callbacks
):
    settings.SESSION_IDLE_CPU_PERCENT = 3.5
    settings.SESSION_IDLE_GPU_PERCENT = 7
    user, client = _user("ida", funded=4_000_000)
    with django_capture_on_commit_callbacks(execute=False):
        client.post(
            "/launch/",
            {"gpu_model": "T4", "profile": "1/2", "environment": "python-3.11", "idle_minutes": "30"},
        )
    session = Session.objects.get(owner=user)

    def rule(language: str = "en") -> str:
        import re

        page = client.get(f"/sessions/{session.id}/live", HTTP_ACCEPT_LANGUAGE=language).content.decode()
        found = re.search(r'data-testid="idle-rule">(.*?)</p>', page, re.DOTALL)
        return " ".join(found[1].split()) if found else ""

    assert rule() == (
        "Idle means: no kernel or terminal activity, no browser connected, CPU under 3.5 %, "
        "and GPU under 7 % for 30 min."
    )
    settings.SESSION_IDLE_COUNT_CONNECTED = False
    assert (
        rule() == "Idle means: no kernel or terminal activity, CPU under 3.5 %, and GPU under 7 % for 30 min."
    )
    user.language = "zh-hans"
    user.save(update_fields=["language"])
    assert rule("zh-hans") == "空闲指：持续 30 分钟 没有内核或终端活动、CPU 低于 3.5 %、GPU 低于 7 %。"
    Session.objects.filter(id=session.id).update(idle_seconds=None)
    assert rule() == ""  # no idle stop: no rule


def _mig_session(name: str):
    """A running 1g.18gb session on an H200 laid out as MIG 1g.18gb × 7, and its owner's client."""
    from provisioner.services.sessions import session_launch
    from tests.provisioner.conftest import ENV, fund, gpu, make_catalog, make_node

    make_catalog()
    migs = [{"uuid": f"MIG-{name}-{i}", "profile": "1g.18gb", "memory_total_mib": 16384} for i in range(7)]
    node, _token = make_node(f"node-{name}", [gpu(0, f"GPU-{name}", "NVIDIA H200", 143771, mig_devices=migs)])
    user, client = _user(name)
    fund(user.account, 100_000_000)
    session = session_launch(
        user=user, account=user.account, gpu_model="H200", profile="1g.18gb", environment=ENV,
        max_hours=None, idle_minutes=None, idempotency_key=None,
    ).session  # fmt: skip
    assert session.device.kind == Device.Kind.MIG
    return node, session, client


def test_a_mig_sessions_chart_shows_its_mig_devices_own_figures(settings):
    """The agent reports each MIG device's memory beside its card's figures: the chart is the MIG
    device's own (memory as % of its cap; NVML has no GPU % for it), not the card's."""
    from tests.provisioner.conftest import beat, workload_status

    node, session, client = _mig_session("mia")
    other = f"MIG-mia-{6 if session.device.uuid != 'MIG-mia-6' else 5}"
    for used_mib in (4096, 8192):
        beat(
            node,
            [workload_status(session, "running")],
            metrics=[
                {"uuid": "GPU-mia", "gpu_util_percent": None, "memory_used_mib": 60000, "power_w": 90.0},
                {"uuid": session.device.uuid, "gpu_util_percent": None, "memory_used_mib": used_mib},
                {"uuid": other, "gpu_util_percent": None, "memory_used_mib": 16000},
            ],
        )
    response = client.get(f"/sessions/{session.id}/live")
    assert response.context["metrics"] == {"GPU %": [None, None], "Memory %": [25.0, 50.0]}
    assert "<title>Memory %</title>" in response.content.decode()
    api = client.get(f"/api/v1/sessions/{session.id}/metrics").json()
    assert api["device"] == session.device.uuid and api["device_wide"] is False
    assert [s["memory_used_mib"] for s in api["samples"]] == [4096, 8192]


def test_a_mig_sessions_chart_falls_back_to_its_cards_figures_from_an_agent_that_reports_cards_only(
    settings,
):
    from tests.provisioner.conftest import beat, workload_status

    node, session, client = _mig_session("max")
    for used_mib in (4096, 8192):
        beat(
            node,
            [workload_status(session, "running")],
            metrics=[
                {"uuid": "GPU-max", "gpu_util_percent": None, "memory_used_mib": used_mib, "power_w": 90.0}
            ],
        )
    response = client.get(f"/sessions/{session.id}/live")
    assert response.context["metrics"] == {"GPU %": [None, None], "Memory %": [25.0, 50.0]}
    api = client.get(f"/api/v1/sessions/{session.id}/metrics").json()
    assert api["device"] == session.device.uuid and api["device_wide"] is True
    assert [s["memory_used_mib"] for s in api["samples"]] == [4096, 8192]


def test_the_dashboard_takes_as_many_queries_for_eleven_sessions_as_for_two(
    fleet, django_assert_max_num_queries
):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from provisioner.quotas import quota_set
    from provisioner.services.sessions import session_launch, session_mark_running

    user, client = _user("ada", funded=100_000_000)
    quota_set(user=user, limits={"max_sessions": 50, "max_eighths": 200})

    def add(profile: str, count: int) -> None:
        for _ in range(count):
            session = session_launch(
                user=user, account=user.account, gpu_model="T4", profile=profile,
                environment="python-3.11", max_hours=None, idle_minutes=None, idempotency_key=None,
            ).session  # fmt: skip
            session_mark_running(session_id=session.id, upstream="http://127.0.0.1:1")

    add("1/2", 1)  # running
    add("whole", 1)  # queued behind it
    client.get("/dashboard/")
    with CaptureQueriesContext(connection) as two:
        page = client.get("/dashboard/").content.decode()
    assert page.count("/lab/tree/Welcome.ipynb") == 1
    most = len(two)  # now: connection.queries keeps only the last 9,000
    add("1/2", 1)
    add("whole", 8)
    client.get("/dashboard/")  # the launches dropped the cached wait statistics: read them again once
    with django_assert_max_num_queries(most):
        page = client.get("/dashboard/").content.decode()
    assert page.count("/lab/tree/Welcome.ipynb") == 2 and page.count('class="badge queued"') == 9


def test_a_2x_is_offered_where_a_node_has_two_gpus_priced_twice_and_its_page_lists_both(
    fleet, django_capture_on_commit_callbacks
):
    GpuModel.objects.filter(name="T4").update(profiles=["whole", "2x", "4x", "1/2"])
    Profile.objects.get_or_create(
        name="2x", defaults={"kind": "whole", "eighths": 8, "quota_eighths": 16, "gpu_count": 2}
    )
    Profile.objects.get_or_create(
        name="4x", defaults={"kind": "whole", "eighths": 8, "quota_eighths": 32, "gpu_count": 4}
    )
    user, client = _user("ada", funded=40_000_000)
    page = client.get("/launch/?gpu_model=T4").content.decode()
    assert 'value="2x"' not in page  # one T4 on the node: no 2x yet
    Device.objects.create(
        node=fleet.node, uuid="GPU-t4-1", index=1, gpu_model=fleet.gpu_model, memory_mib=15360
    )
    page = client.get("/launch/?gpu_model=T4&profile=2x").content.decode()
    assert 'value="2x"' in page and 'value="4x"' not in page
    assert "2 whole GPUs on one node" in page and "4.00" in page  # 2 × 2.00/h
    assert 'data-testid="multi-gpu"' in page
    with django_capture_on_commit_callbacks(execute=False):
        response = client.post(
            "/launch/",
            {"gpu_model": "T4", "profile": "2x", "environment": "python-3.11", "idempotency_key": "k"},
        )
    session = Session.objects.get(owner=user)
    assert response.status_code == 302 and session.state == Session.State.PLACING
    page = client.get(response["Location"]).content.decode()
    assert 'data-testid="devices"' in page and "GPU-t4-0" in page and "GPU-t4-1" in page
