import pytest
from django.core.cache import cache

from portal.services import user_create


@pytest.fixture(autouse=True)
def _fast(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    cache.clear()


def make_user(name: str, *, language: str = "en", email: bool = True):
    user = user_create(
        username=name, email=f"{name}@example.com" if email else "", password="a-long-pass-phrase-9"
    )
    user.language = language
    user.save(update_fields=["language"])
    return user
