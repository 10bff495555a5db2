import re

import pytest
from django.core import mail
from django.urls import reverse

from core.errors import ValidationFailed
from portal.models import User
from portal.services import user_create

pytestmark = pytest.mark.django_db


def test_signup_creates_a_user_with_an_account_and_logs_in(client):
    response = client.post(
        reverse("signup"), {"username": "mei", "email": "mei@example.edu", "password": "a-long-pass-phrase"}
    )
    assert response.status_code == 302
    assert response["Location"] == reverse("dashboard")
    user = User.objects.get(username="mei")
    assert user.account is not None and user.account.kind == "user"
    assert client.get(reverse("dashboard")).status_code == 200


def test_signup_refuses_a_taken_username_and_a_weak_password(client):
    user_create(username="mei", email="", password="a-long-pass-phrase")
    taken = client.post(reverse("signup"), {"username": "MEI", "password": "another-long-phrase"})
    assert "That username is taken." in taken.content.decode()
    weak = client.post(reverse("signup"), {"username": "lin", "password": "123"})
    assert weak.status_code == 200
    assert not User.objects.filter(username="lin").exists()


def test_user_create_raises_a_domain_error_for_an_empty_username():
    with pytest.raises(ValidationFailed):
        user_create(username="  ", email="", password="a-long-pass-phrase")


def test_login_and_logout(client):
    user_create(username="mei", email="", password="a-long-pass-phrase")
    response = client.post(reverse("login"), {"username": "mei", "password": "a-long-pass-phrase"})
    assert response.status_code == 302
    assert client.get(reverse("dashboard")).status_code == 200
    client.post(reverse("logout"))
    assert client.get(reverse("dashboard")).status_code == 302


def test_password_reset_sends_a_link_that_sets_a_new_password(client):
    user_create(username="mei", email="mei@example.edu", password="a-long-pass-phrase")
    client.post(reverse("password_reset"), {"email": "mei@example.edu"})
    assert len(mail.outbox) == 1
    link = re.search(r"/password/reset/[^/]+/[^/]+/", mail.outbox[0].body).group(0)
    form_url = client.get(link, follow=True).redirect_chain[-1][0]
    client.post(form_url, {"new_password1": "brand-new-phrase-9", "new_password2": "brand-new-phrase-9"})
    assert client.login(username="mei", password="brand-new-phrase-9")


def test_profile_saves_language_and_time_zone_and_pages_follow_it(client):
    user = user_create(username="mei", email="", password="a-long-pass-phrase")
    client.force_login(user)
    client.post(
        reverse("profile"), {"email": "m@example.edu", "language": "zh-hans", "time_zone": "Europe/Berlin"}
    )
    user.refresh_from_db()
    assert (user.language, user.time_zone) == ("zh-hans", "Europe/Berlin")
    page = client.get(reverse("dashboard")).content.decode()
    assert "仪表盘" in page
    profile = client.get(reverse("profile")).content.decode()
    assert "has-error" not in profile  # the page shows the saved settings, not a blank form's errors
    zones = re.search(r'<select name="time_zone".*?</select>', profile).group(0)
    assert re.findall(r'<option value="([^"]+)" selected>', zones) == ["Europe/Berlin"]


def test_a_time_zone_that_is_not_one_is_refused_and_changes_nothing(client, settings):
    user = user_create(username="mei", email="", password="a-long-pass-phrase")
    client.force_login(user)
    page = client.post(
        reverse("profile"), {"email": "m@example.edu", "language": "en", "time_zone": "Mars/Olympus"}
    )
    assert "Mars/Olympus is not one of the available choices" in page.content.decode()
    user.refresh_from_db()
    assert (user.email, user.time_zone) == ("", settings.TIME_ZONE)


def test_language_switcher_is_remembered_for_the_user(client):
    user = user_create(username="mei", email="", password="a-long-pass-phrase")
    client.force_login(user)
    client.post(reverse("language_set"), {"language": "zh-hans", "next": "/dashboard/"})
    user.refresh_from_db()
    assert user.language == "zh-hans"
    client.post(reverse("language_set"), {"language": "xx", "next": "https://evil.example/"})
    user.refresh_from_db()
    assert user.language == "zh-hans"
