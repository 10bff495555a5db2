"""The operations page's fleet figures: healthy whole GPUs on active nodes, in queries that do not grow
with the fleet."""

import re

from django.test import Client

from provisioner.models import Device, Node
from tests.provisioner.conftest import gpu, make_node, make_user


def test_effective_compute_counts_healthy_whole_gpus_on_active_nodes(catalog):
    make_node("a", gpus=[gpu(0, "GPU-a-0"), gpu(1, "GPU-a-1"), gpu(2, "GPU-a-2")])
    cordoned, _ = make_node("b", gpus=[gpu(0, "GPU-b-0")])
    Node.objects.filter(pk=cordoned.pk).update(state=Node.State.CORDONED)
    Device.objects.filter(uuid="GPU-a-0").update(last_metrics={"gpu_util_percent": 50})
    Device.objects.filter(uuid="GPU-a-1").update(last_metrics={"gpu_util_percent": 100})
    Device.objects.filter(uuid="GPU-a-2").update(
        health=Device.Health.LOST, last_metrics={"gpu_util_percent": 90}
    )
    client = Client()
    client.force_login(make_user("ops", staff=True))
    page = client.get("/operations/").content.decode()
    # two A100s of 312 TFLOPS count: u = (0.5 + 1.0) / 2
    assert 'data-testid="q">468.0 TFLOPS<' in page
    assert "2 GPUs, 624 TFLOPS peak, u = 0.75" in page


def test_the_counts_the_queue_and_todays_revenue(catalog):
    from billing.models import LedgerAccount, Transfer
    from billing.services.ledger import system_account, transfer_post, wallet_for
    from provisioner.models import GpuModel, Session
    from tests.provisioner.factories import session_row

    student = make_user("stu")
    a100 = GpuModel.objects.get(name="A100-SXM4-80GB")
    states = [Session.State.RUNNING] * 2 + [
        Session.State.PLACING,
        Session.State.STARTING,
        Session.State.STOPPED,
    ]
    node, _token = make_node("c")
    for state in [*states, Session.State.QUEUED, Session.State.QUEUED]:
        on = None if state == Session.State.QUEUED else node
        Session.objects.filter(pk=session_row(student, model=a100).pk).update(state=state, node=on)
    wallet = wallet_for(account=student.account)
    revenue = system_account(kind=LedgerAccount.Kind.REVENUE, unit=wallet.unit)
    for n, micros in enumerate((1_500_000, 250_000)):
        transfer_post(debit=wallet, credit=revenue, amount_micros=micros, kind=Transfer.Kind.USAGE,
                      idempotency_key=f"ops-usage-{n}")  # fmt: skip
        wallet.refresh_from_db()
    client = Client()
    client.force_login(make_user("ops", staff=True))
    page = client.get("/operations/?live=1").content.decode()
    figures = re.findall(r'<div class="figure">([^<]*)</div>', page)
    assert figures == ["¥1.75", "2", "2"]  # revenue today, running, queued
    assert "2 starting" in page and page.count(">stu<") == 2  # both queued sessions listed
