"""The password login's backend: Django's, with the request's user read together with their account."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.backends import ModelBackend
from django.core.exceptions import PermissionDenied

from core.compiled import Lookup
from provisioner.quotas import users_with_home_use

# The request's user, with their account and their home's measured use and limits (the dashboard's and
# the files page's line, and every page's home-removal banner): read on every request, compiled once.
_REQUEST_USER = Lookup(
    lambda pk: users_with_home_use(get_user_model()._default_manager.select_related("account")).filter(pk=pk),
    key_types=(int,),
)


def request_user(user_id):
    """The user a request's login names (any backend's ``get_user``), None if there is none."""
    return _REQUEST_USER.first(user_id)


class PasswordBackend(ModelBackend):
    """Django's ``ModelBackend``, except:

    - the user of each request is read with their account, and their home's measured use and limits,
      in one query (nearly every page needs the account; the dashboard and the files page the home);
    - a wrong password stops here. ``ModelBackend`` is listed after this one only so that sessions made
      before it keep their login; it must not check the same password a second time.
    """

    def authenticate(self, request, username=None, password=None, **kwargs):
        user = super().authenticate(request, username=username, password=password, **kwargs)
        if user is None and password is not None:
            raise PermissionDenied  # Django's authenticate() answers None and sends user_login_failed
        return user

    def get_user(self, user_id):
        user = request_user(user_id)
        return user if user is not None and self.user_can_authenticate(user) else None
