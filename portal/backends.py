"""The password login's backend: Django's, with the request's user read together with their account."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.backends import ModelBackend
from django.core.exceptions import PermissionDenied

from provisioner.quotas import users_with_home_use


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
        model = get_user_model()
        # with their home's measured use and limits (the dashboard's and the files page's line)
        users = users_with_home_use(model._default_manager.select_related("account"))
        user = users.filter(pk=user_id).first()
        return user if user is not None and self.user_can_authenticate(user) else None
