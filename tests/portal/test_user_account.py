"""Every user has a paying account, whatever made them: signup, ``createsuperuser``, the admin, a plain
``create_user``; the data migration gives one to users made before; the ``portal.E001`` check reports
any user left without."""

from __future__ import annotations

import importlib

import pytest
from django.apps import apps
from django.core.management import call_command
from django.db import connection
from rest_framework.test import APIClient

from billing.models import Account
from portal.checks import check_every_user_has_an_account
from portal.models import User
from portal.services import access_token_create, user_account_ensure
from tests.billing.conftest import fund
from tests.provisioner.conftest import A100, ENV, gpu, make_catalog, make_node, sent_tasks  # noqa: F401

pytestmark = pytest.mark.django_db

MIGRATION = importlib.import_module("portal.migrations.0003_every_user_has_an_account")


def _token_client(user) -> APIClient:
    _token, raw = access_token_create(user=user, name="ops", scopes=["read", "sessions", "cards", "billing"])
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def _createsuperuser(monkeypatch, username: str = "root") -> User:
    monkeypatch.setenv("DJANGO_SUPERUSER_PASSWORD", "a-long-pass-phrase-9")
    call_command("createsuperuser", interactive=False, username=username, email=f"{username}@example.com")
    return User.objects.get(username=username)


def test_a_createsuperuser_user_has_a_wallet_and_can_launch(monkeypatch, settings, sent_tasks):  # noqa: F811
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    make_catalog()
    make_node("node-su", [gpu(0, "GPU-su-0")])
    root = _createsuperuser(monkeypatch)
    assert root.account is not None and root.account.kind == Account.Kind.USER
    assert root.account.name == "root"
    client = _token_client(root)

    wallet = client.get("/api/v1/wallet")
    assert wallet.status_code == 200, wallet.content
    assert wallet.json()["account"]["id"] == root.account_id
    assert client.get("/api/v1/me").json()["account_id"] == root.account_id

    fund(root.account, 50_000_000)
    body = {"gpu_model": A100, "profile": "1/8", "environment": ENV}
    launched = client.post("/api/v1/sessions", body, format="json")
    assert launched.status_code == 201, launched.content
    assert launched.json()["account"]["id"] == root.account_id


def test_a_user_added_in_the_admin_gets_an_account(client, monkeypatch, settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    client.force_login(_createsuperuser(monkeypatch))
    response = client.post(
        "/admin/portal/user/add/",
        {
            "username": "added",
            "usable_password": "true",
            "password1": "a-long-pass-phrase-9",
            "password2": "a-long-pass-phrase-9",
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    added = User.objects.get(username="added")
    assert added.account is not None and added.account.kind == Account.Kind.USER
    wallet = _token_client(added).get("/api/v1/wallet")
    assert wallet.status_code == 200 and wallet.json()["account"]["id"] == added.account_id


def test_me_never_answers_a_null_account_id():
    users = [
        User.objects.create_user(username="plain", password="x"),
        User.objects.create(username="bare"),
        User.objects.create_superuser(username="boss", password="x"),
    ]
    for user in users:
        account_id = _token_client(user).get("/api/v1/me").json()["account_id"]
        assert isinstance(account_id, int)
        assert User.objects.get(pk=user.pk).account_id == account_id


def test_ensuring_twice_makes_one_account():
    user = User.objects.create(username="once")
    first = user.account_id
    again = user_account_ensure(user=User.objects.get(pk=user.pk))
    assert again.id == first
    assert Account.objects.filter(kind=Account.Kind.USER, name="once").count() == 1


def _strip_account(user: User) -> None:
    User.objects.filter(pk=user.pk).update(account=None)


def test_the_migration_gives_users_without_one_an_account_and_leaves_the_others():
    lost, kept = User.objects.create(username="lost"), User.objects.create(username="kept")
    kept_account = kept.account_id
    _strip_account(lost)
    MIGRATION.accounts_for_users_without(apps, None)
    lost.refresh_from_db()
    kept.refresh_from_db()
    assert lost.account_id is not None and lost.account.name == "lost"
    assert kept.account_id == kept_account
    accounts = Account.objects.count()
    MIGRATION.accounts_for_users_without(apps, None)  # a second run changes nothing
    assert Account.objects.count() == accounts
    assert User.objects.filter(account__isnull=True).count() == 0


def test_the_check_reports_a_user_without_an_account():
    assert check_every_user_has_an_account(databases=["default"]) == []
    _strip_account(User.objects.create(username="orphan"))
    (error,) = check_every_user_has_an_account(databases=["default"])
    assert error.id == "portal.E001" and "1" in error.msg
    assert check_every_user_has_an_account(databases=None) == []  # not asked about a database


def test_the_check_is_silent_before_migrations_are_applied():
    with connection.cursor() as cursor:  # the test's transaction rolls the rename back
        cursor.execute(f"ALTER TABLE {User._meta.db_table} RENAME TO portal_user_not_yet")
    assert check_every_user_has_an_account(databases=["default"]) == []


def test_saving_a_user_left_without_an_account_in_the_admin_gives_one(client, monkeypatch, settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    client.force_login(_createsuperuser(monkeypatch))
    orphan = User.objects.create(username="orphan")
    _strip_account(orphan)
    page = client.get(f"/admin/portal/user/{orphan.pk}/change/")
    form = page.context["adminform"].form
    data = {name: value for name, value in form.initial.items() if value is not None and name != "password"}
    data.update(
        {"date_joined_0": "2026-01-01", "date_joined_1": "00:00:00", "groups": [], "user_permissions": []}
    )
    response = client.post(f"/admin/portal/user/{orphan.pk}/change/", data)
    assert response.status_code == 302, response.content.decode()[:3000]
    orphan.refresh_from_db()
    assert orphan.account_id is not None
