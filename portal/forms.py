from __future__ import annotations

import zoneinfo

from django import forms
from django.conf import settings
from django.forms.utils import flatatt
from django.utils.html import escape
from django.utils.safestring import mark_safe
from django.utils.translation import gettext_lazy as _

from portal.models import Membership

_ZONES = sorted(zoneinfo.available_timezones())


class SignupForm(forms.Form):
    username = forms.CharField(label=_("Username"), max_length=150)
    email = forms.EmailField(label=_("Email"), required=False)
    password = forms.CharField(label=_("Password"), widget=forms.PasswordInput, max_length=128)
    invite_code = forms.CharField(
        label=_("Invite code (optional)"),
        required=False,
        max_length=64,
        help_text=_("A compute-card code, if you have one: it is redeemed as soon as you sign up."),
    )

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if settings.SIGNUP_EMAIL_VERIFICATION:
            self.fields["email"].required = True
            self.fields["email"].help_text = _("We send a link to this address to confirm it.")
        if settings.SIGNUP_INVITE_REQUIRED:
            code = self.fields["invite_code"]
            code.required = True
            code.label = _("Invite code")
            code.help_text = _(
                "This portal is open to invited users: enter the compute-card code you were given."
            )


_ZONE_SET = frozenset(_ZONES)
_ZONE_OPTIONS = "".join(f'<option value="{escape(zone)}">{escape(zone)}</option>' for zone in _ZONES)


class TimeZoneSelect(forms.Widget):
    """The ~600 time zones' options are written once per process; a render only marks the chosen one.
    (Django's Select renders each option through a template, and a ChoiceField deep-copies its choices
    for every form: together most of the profile page's time.)"""

    def render(self, name, value, attrs=None, renderer=None):
        attrs = self.build_attrs(self.attrs, attrs)
        options = _ZONE_OPTIONS
        if value in _ZONE_SET:
            chosen = f'<option value="{escape(value)}">'
            options = options.replace(chosen, f"{chosen[:-1]} selected>", 1)
        return mark_safe(f'<select name="{escape(name)}"{flatatt(attrs)}>{options}</select>')  # noqa: S308


class TimeZoneField(forms.CharField):
    """One of the zones this Python knows, as the user's `time_zone`."""

    widget = TimeZoneSelect
    default_error_messages = {"invalid_choice": forms.ChoiceField.default_error_messages["invalid_choice"]}

    def validate(self, value) -> None:
        super().validate(value)
        if value not in _ZONE_SET:
            raise forms.ValidationError(
                self.error_messages["invalid_choice"], code="invalid_choice", params={"value": value}
            )


class ProfileForm(forms.Form):
    email = forms.EmailField(label=_("Email"), required=False)
    language = forms.ChoiceField(label=_("Language"), choices=settings.LANGUAGES)
    time_zone = TimeZoneField(label=_("Time zone"))


class TeamCreateForm(forms.Form):
    name = forms.CharField(label=_("Team name"), max_length=100)


class TeamJoinForm(forms.Form):
    code = forms.CharField(label=_("Team invite code"), max_length=64)


class TeamInviteForm(forms.Form):
    role = forms.ChoiceField(
        label=_("Role"), choices=[(Membership.Role.MEMBER, _("Member")), (Membership.Role.ADMIN, _("Admin"))]
    )
    valid_days = forms.IntegerField(label=_("Valid for (days)"), min_value=1, max_value=90, initial=7)
    max_uses = forms.IntegerField(label=_("Uses"), min_value=1, max_value=1000, initial=20)
