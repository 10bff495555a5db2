"""A lookup compiled once reads what the ORM reads: the same row, its joined rows attached, its
annotations set, in one query, and the SQL is not compiled again."""

from __future__ import annotations

import uuid

import pytest
from django.db.models import Count, F
from django.db.models.sql.compiler import SQLCompiler

from core.compiled import Lookup
from portal.backends import request_user
from portal.models import User
from tests.provisioner.conftest import make_user

pytestmark = pytest.mark.django_db


def _field_values(obj) -> dict:
    return {f.attname: getattr(obj, f.attname) for f in obj._meta.concrete_fields}


def test_a_lookup_reads_the_row_its_joins_and_annotations_as_the_orm_does(django_assert_num_queries):
    user = make_user("ada")
    build = lambda pk: (  # noqa: E731
        User.objects.select_related("account")
        .annotate(shouted=F("username"), memberships_n=Count("memberships"))
        .filter(pk=pk)
    )
    lookup = Lookup(build, key_types=(int,))
    expected = build(user.pk).first()
    with django_assert_num_queries(1):
        found = lookup.first(user.pk)
        assert found.account.name == expected.account.name  # attached: no query more
    assert _field_values(found) == _field_values(expected)
    assert _field_values(found.account) == _field_values(expected.account)
    assert (found.shouted, found.memberships_n) == ("ada", 0)
    assert found._state.adding is False and found._state.db == "default"
    assert lookup.first(user.pk + 1000) is None


def test_the_sql_is_compiled_once_for_every_key(monkeypatch):
    first, second = make_user("first"), make_user("second")
    lookup = Lookup(lambda pk: User.objects.select_related("account").filter(pk=pk), key_types=(int,))
    assert lookup.first(first.pk).username == "first"
    compiled = []
    real = SQLCompiler.as_sql
    monkeypatch.setattr(
        SQLCompiler, "as_sql", lambda self, *a, **k: compiled.append(1) or real(self, *a, **k)
    )
    assert lookup.first(second.pk).username == "second"
    assert lookup.first(first.pk).username == "first"
    assert compiled == []


def test_a_key_that_is_not_one_matches_no_row_and_unsupported_querysets_are_refused():
    user = make_user("bob")
    by_pk = Lookup(lambda pk: User.objects.filter(pk=pk), key_types=(int,))
    assert by_pk.first(str(user.pk)) == user  # an id as a URL or a session carries it
    for not_a_key in (None, True, 1.0, "1 OR 1=1", "-1", "", [user.pk]):
        assert by_pk.first(not_a_key) is None  # matches no row, whatever it is
    from provisioner.models import Session

    by_id = Lookup(lambda sid: Session.objects.filter(id=sid), key_types=(uuid.UUID,))
    assert by_id.first("not-a-uuid") is None and by_id.first(uuid.uuid4()) is None
    prefetching = Lookup(
        lambda pk: User.objects.prefetch_related("memberships").filter(pk=pk), key_types=(int,)
    )
    with pytest.raises(ValueError, match="prefetch_related"):
        prefetching.first(user.pk)
    unused = Lookup(lambda pk: User.objects.all(), key_types=(int,))
    with pytest.raises(ValueError, match="must appear in"):
        unused.first(user.pk)


def test_the_request_user_is_read_in_one_query_with_account_and_home_figures(django_assert_num_queries):
    user = make_user("carol")
    with django_assert_num_queries(1):
        found = request_user(str(user.pk))  # as a session stores it
        assert found.account.pk == user.account_id
        assert found.home_removal_due is None and found.home_max_bytes is None
    assert request_user("not a number") is None and request_user(None) is None


def test_a_lookup_of_many_rows_reads_them_in_the_querysets_order_and_slice(django_assert_num_queries):
    for name in ("m1", "m2", "m3", "m4"):
        make_user(name)

    def build(min_pk):
        return User.objects.select_related("account").filter(pk__gte=min_pk).order_by("-username")[:3]

    lookup = Lookup(build, key_types=(int,), many=True)
    first_pk = User.objects.get(username="m1").pk
    expected = [(u.username, u.account.pk) for u in build(first_pk)]
    with django_assert_num_queries(1):
        found = lookup.all(first_pk)
        assert [(u.username, u.account.pk) for u in found] == expected  # accounts attached: no query
    assert [u.username for u in found] == ["m4", "m3", "m2"]
    assert lookup.all(first_pk + 10_000) == []
    with pytest.raises(TypeError):
        lookup.first(first_pk)
    with pytest.raises(TypeError):
        Lookup(build, key_types=(int,)).all(first_pk)
    with pytest.raises(ValueError, match="values"):
        Lookup(lambda pk: User.objects.filter(pk=pk).values("username"), key_types=(int,)).first(first_pk)


def test_a_query_that_names_the_time_zone_is_refused_so_no_user_gets_anothers_zone(settings):
    """Each request runs in its user's time zone: a ``__date`` lookup compiled in the first request's
    zone would be everyone's."""
    user = make_user("dora")
    by_day = Lookup(
        lambda pk: User.objects.filter(pk=pk, date_joined__date__gte="2000-01-01"), key_types=(int,)
    )
    with pytest.raises(ValueError, match="time zone"):
        by_day.first(user.pk)
    assert Lookup(lambda pk: User.objects.filter(pk=pk), key_types=(int,)).first(user.pk) == user


def test_a_login_is_read_in_one_compiled_query_and_an_expired_one_is_no_login(
    client, django_assert_num_queries
):
    from datetime import timedelta

    from django.contrib.sessions.models import Session
    from django.utils import timezone

    from portal.logins import SessionStore

    user = make_user("erin")
    client.force_login(user)
    key = client.cookies["sessionid"].value
    with django_assert_num_queries(1):
        assert SessionStore(key).load()["_auth_user_id"] == str(user.pk)
    Session.objects.filter(session_key=key).update(expire_date=timezone.now() - timedelta(seconds=1))
    store = SessionStore(key)
    assert store.load() == {} and store.session_key is None  # a new login, as Django's store
    assert SessionStore("no-such-key").load() == {}


def test_a_lookup_of_values_list_rows_reads_tuples_or_flat_values_as_the_orm_does(django_assert_num_queries):
    from django.db.models.functions import Upper

    user = make_user("fern")
    rows = Lookup(
        lambda pk: (
            User.objects.filter(pk=pk).annotate(shout=Upper("username")).values_list("shout", "account__id")
        ),
        key_types=(int,),
    )
    flat = Lookup(
        lambda name: User.objects.filter(username=name).values_list("pk", flat=True), key_types=(str,)
    )
    names = Lookup(
        lambda pk: User.objects.filter(pk__gte=pk).order_by("username").values_list("username", flat=True),
        key_types=(int,),
        many=True,
    )
    account_id = user.account.pk
    expected = list(
        User.objects.filter(pk__gte=user.pk).order_by("username").values_list("username", flat=True)
    )
    with django_assert_num_queries(3):
        assert rows.first(user.pk) == ("FERN", account_id)
        assert flat.first("fern") == user.pk
        assert names.all(user.pk) == expected
    assert rows.first(user.pk + 10_000) is None and flat.first("nobody") is None


def test_an_aware_datetime_key_may_be_used_more_than_once_and_a_naive_one_is_refused():
    from datetime import UTC, datetime, timedelta

    from django.db.models import Q

    user = make_user("dora")
    joined = user.date_joined
    since = Lookup(
        lambda pk, moment: User.objects.filter(Q(date_joined__gte=moment) | Q(last_login__gte=moment), pk=pk),
        key_types=(int, datetime),
    )
    assert since.first(user.pk, joined - timedelta(seconds=1)) == user
    assert since.first(user.pk, joined + timedelta(seconds=1)) is None  # both uses of the key took it
    assert since.first(user.pk, datetime(1, 1, 1, tzinfo=UTC)) == user
    with pytest.raises(ValueError, match="aware"):
        since.first(user.pk, datetime(2026, 1, 1))


def test_a_list_key_for_any_of_a_field_reads_every_row_it_names_from_one_compiled_statement():
    ada, bob, _cyd = make_user("ada"), make_user("bob"), make_user("cyd")
    of = Lookup(
        lambda pks: User.objects.filter(pk__any=pks).order_by("username"), key_types=(list,), many=True
    )
    assert of.all([ada.pk, bob.pk]) == [ada, bob]
    assert of.all((bob.pk,)) == [bob] and of.all({ada.pk}) == [ada]  # any sequence or set of keys
    assert of.all([]) == [] and of.all("1") == [] and of.all(None) == []
    assert of._compiled.sql.count("%s") == 1  # one array parameter, however many keys
    by_hand = User.objects.filter(pk__any=[bob.pk, ada.pk]).order_by("pk")
    assert [user.username for user in by_hand] == ["ada", "bob"]
    # on a foreign key (its lookups are its own, not a plain field's)
    by_account = Lookup(lambda ids: User.objects.filter(account_id__any=ids), key_types=(list,), many=True)
    assert by_account.all([bob.account_id]) == [bob]
    with pytest.raises(TypeError, match="list of values"):
        User.objects.filter(pk__any="12")  # a string is not a list of ids
    with pytest.raises(ValueError, match="at most 2 keys"):
        Lookup(lambda a, b, c: User.objects.filter(pk__any=[a, b, c]), key_types=(int, int, int))
