"""The hourly storage charge task: reads the measured homes and charges each user once a UTC day."""

from __future__ import annotations

from datetime import UTC, timedelta

import pytest
from django.utils import timezone

from billing.models import Transfer
from billing.services.ledger import wallet_for
from billing.services.storage import storage_price_set
from billing.services.topups import wallet_credit_promotion
from core.clock import db_now
from core.errors import ValidationFailed
from portal.services import user_create
from provisioner.models import HomeUsage
from provisioner.services.home_storage import home_storage_charge
from provisioner.tasks import home_storage_charge_task

pytestmark = pytest.mark.django_db
GB = 10**9


@pytest.fixture(autouse=True)
def _fast_hasher(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def _home(name: str, home_bytes: int):
    user = user_create(username=name, email="", password="pw-123456789")
    wallet_credit_promotion(account=user.account, amount_micros=10_000_000, idempotency_key=f"fund-{name}")
    HomeUsage.objects.create(user=user, bytes=home_bytes, files=1, measured_at=timezone.now())
    return user


def test_the_task_charges_homes_over_the_allowance_once_a_day_however_often_it_runs():
    big, small = _home("big", 17 * GB), _home("small", 4 * GB)
    storage_price_set(
        price_micros_per_gb_month=3_000_000, free_gb=5, effective_from=db_now() - timedelta(days=1)
    )
    assert home_storage_charge_task() == 1
    assert home_storage_charge_task() == 0  # the next hour's run
    HomeUsage.objects.filter(user=big).update(bytes=50 * GB)
    assert home_storage_charge_task() == 0
    (transfer,) = Transfer.objects.filter(kind="storage")
    today = db_now().astimezone(UTC).date().isoformat()
    assert transfer.idempotency_key == f"storage:{big.id}:{today}:wallet"
    assert transfer.amount_micros == 1_200_000  # 12 GB × ¥3 / 30
    assert wallet_for(account=big.account).balance_micros == 8_800_000
    assert wallet_for(account=small.account).balance_micros == 10_000_000


def test_without_a_price_the_task_charges_nothing_and_a_bad_day_is_refused():
    _home("free", 500 * GB)
    assert home_storage_charge_task() == 0
    storage_price_set(price_micros_per_gb_month=3_000_000, effective_from=db_now() - timedelta(days=1))
    for day in ("2026-12-06", db_now(), db_now().date() + timedelta(days=1)):
        with pytest.raises(ValidationFailed):
            home_storage_charge(day=day)
    assert not Transfer.objects.filter(kind="storage").exists()
