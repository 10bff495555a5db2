"""Pages of the portal app: landing, accounts, profile, teams, health."""

from __future__ import annotations

from decimal import Decimal

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import login
from django.contrib.auth.decorators import login_required
from django.contrib.auth.views import LoginView
from django.core.cache import cache
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import translation
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.translation import gettext as _
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST
from django.views.defaults import page_not_found

from billing.services.topups import amount_parse
from core.errors import ApplicationError, ValidationFailed
from core.throttle import attempt_count
from core.units import hours_to_micros
from portal import health, selectors, services
from portal import signup as signup_services
from portal.forms import ProfileForm, SignupForm, TeamCreateForm, TeamInviteForm, TeamJoinForm
from portal.models import AccessToken, Membership, TeamInvite, User
from portal.session_pages import landing_prices


def home(request: HttpRequest) -> HttpResponse:
    return render(request, "portal/home.html", {"catalog": landing_prices()})


def signup(request: HttpRequest) -> HttpResponse:
    if request.user.is_authenticated:
        return redirect("dashboard")
    if not settings.LOCAL_PASSWORDS:  # accounts come from single sign-on only
        return redirect("login")
    form = SignupForm(request.POST or None, initial={"invite_code": request.GET.get("code", "")})
    if request.method == "POST":
        ip = request.META.get("REMOTE_ADDR", "")
        try:
            signup_services.signup_rate_check(ip=ip)
        except ApplicationError as exc:
            form.is_valid()
            form.add_error(None, exc.message)
            return render(request, "registration/signup.html", {"form": form}, status=exc.status)
    if request.method == "POST" and form.is_valid():
        try:
            done = signup_services.user_signup(
                username=form.cleaned_data["username"],
                email=form.cleaned_data["email"],
                password=form.cleaned_data["password"],
                language=translation.get_language() or settings.LANGUAGE_CODE,
                invite_code=form.cleaned_data.get("invite_code", ""),
                ip=ip,
            )
        except ApplicationError as exc:
            for field, reason in exc.fields.items():
                form.add_error(field if field in form.fields else None, reason)
            if not exc.fields:
                form.add_error(None, exc.message)
        else:
            return _signed_up(request, done)
    return render(request, "registration/signup.html", {"form": form})


# The user whose confirmation this browser may ask to resend: the one who just signed up in it, or who
# gave their password on the login page before confirming.
PENDING_USER_KEY = "signup_pending_user"


def _signed_up(request: HttpRequest, done: signup_services.Signup) -> HttpResponse:
    if done.verification_sent:
        request.session[PENDING_USER_KEY] = done.user.pk
        return _pending_page(request, done.user)
    login(request, done.user, backend="portal.backends.PasswordBackend")
    messages.success(request, _("Welcome to Suanli, %(name)s.") % {"name": done.user.username})
    if done.code_error:
        messages.error(
            request,
            _("Your account is ready, but the code was not redeemed: %(why)s") % {"why": done.code_error},
        )
        return redirect("cards")
    if done.card is not None:
        messages.success(request, _("Your compute card is redeemed: you can launch a session now."))
    return redirect("dashboard")


def _pending_page(request: HttpRequest, user: User, *, error: str = "", status: int = 200) -> HttpResponse:
    context = {"email": user.email, "error": error}
    return render(request, "registration/signup_verify_sent.html", context, status=status)


def _pending_user(request: HttpRequest) -> User | None:
    user_id = request.session.get(PENDING_USER_KEY)
    user = User.objects.filter(pk=user_id).first() if user_id else None
    if user is None or user.is_active:
        request.session.pop(PENDING_USER_KEY, None)
        return None
    return user


@never_cache
def signup_pending(request: HttpRequest) -> HttpResponse:
    """Says the email is not confirmed yet and offers to resend the link; only to the browser that
    signed the user up or gave their password (the session says which user)."""
    user = _pending_user(request)
    if user is None:
        return redirect("login")
    return _pending_page(request, user)


@require_POST
def signup_resend(request: HttpRequest) -> HttpResponse:
    """Sends a fresh confirmation email (throttled, CSRF-protected like every form) and says so."""
    user = _pending_user(request)
    if user is None:
        return redirect("login")
    try:
        signup_services.user_verification_resend(user_id=user.pk, ip=request.META.get("REMOTE_ADDR", ""))
    except ApplicationError as exc:
        return _pending_page(request, user, error=exc.message, status=exc.status)
    messages.success(request, _("We sent a new confirmation link to %(email)s.") % {"email": user.email})
    return redirect("signup_pending")


def signup_verify(request: HttpRequest, token: str) -> HttpResponse:
    """The link of the confirmation email: activates the user and logs them in."""
    try:
        user = signup_services.user_email_verify(token=token)
    except ApplicationError as exc:
        messages.error(request, exc.message)
        return redirect("login")
    request.session.pop(PENDING_USER_KEY, None)
    login(request, user, backend="portal.backends.PasswordBackend")
    messages.success(
        request, _("Your email is confirmed. Welcome to Suanli, %(name)s.") % {"name": user.username}
    )
    return redirect("dashboard")


@login_required
def profile(request: HttpRequest) -> HttpResponse:
    user: User = request.user
    form = ProfileForm(
        request.POST
        if request.method == "POST" and request.POST.get("action", "profile") == "profile"
        else None,
        initial={"email": user.email, "language": user.language, "time_zone": user.time_zone},
    )
    if request.method == "POST":
        action = request.POST.get("action", "profile")
        if action == "profile" and form.is_valid():
            services.user_update_profile(user=user, **form.cleaned_data)
            translation.activate(user.language)
            messages.success(request, _("Your profile is saved."))
            return redirect("profile")
        if action in ("token_create", "token_revoke"):
            try:
                if action == "token_create":
                    days = request.POST.get("expires_in_days", "90")
                    _token, raw = services.access_token_create(
                        user=user,
                        name=request.POST.get("name", ""),
                        scopes=request.POST.getlist("scopes"),
                        expires_in_days=int(days) if days.isdigit() else 90,
                    )
                    request.session["new_token"] = raw
                else:
                    services.access_token_revoke(user=user, token_id=int(request.POST.get("token", "0") or 0))
                    messages.success(request, _("The token is revoked."))
            except ApplicationError as exc:
                messages.error(request, exc.message)
            return redirect("profile")
    context = {
        "form": form,
        "tokens": AccessToken.objects.filter(user=user).order_by("-created_at"),
        "scopes": AccessToken.Scope.choices,
        "new_token": request.session.pop("new_token", None),
    }
    return render(request, "portal/profile.html", context)


@require_POST
def language_set(request: HttpRequest) -> HttpResponse:
    """The switcher: remembered on the user when logged in, in a cookie otherwise."""
    language = request.POST.get("language", "")
    next_url = request.POST.get("next") or "/"
    if not url_has_allowed_host_and_scheme(next_url, allowed_hosts={request.get_host()}):
        next_url = "/"
    response = redirect(next_url)
    if language in dict(settings.LANGUAGES):
        if request.user.is_authenticated:
            request.user.language = language
            request.user.save(update_fields=["language"])
        response.set_cookie(settings.LANGUAGE_COOKIE_NAME, language, max_age=365 * 24 * 3600, samesite="Lax")
    return response


@login_required
def team_list(request: HttpRequest) -> HttpResponse:
    create_form = TeamCreateForm(request.POST or None, prefix="create")
    join_form = TeamJoinForm(prefix="join")
    if request.method == "POST" and create_form.is_valid():
        try:
            team = services.team_create(creator=request.user, name=create_form.cleaned_data["name"])
        except ApplicationError as exc:
            create_form.add_error(None, exc.message)
        else:
            messages.success(request, _("Team %(name)s created.") % {"name": team.name})
            return redirect("team_detail", slug=team.slug)
    teams = selectors.team_list_for_user(user=request.user)
    return render(
        request, "portal/team_list.html", {"teams": teams, "create_form": create_form, "join_form": join_form}
    )


@login_required
def team_join(request: HttpRequest, code: str = "") -> HttpResponse:
    """Join by link (``/teams/join/CODE/``, confirmed with a POST) or by typing the code."""
    form = TeamJoinForm(request.POST or None, prefix="join", initial={"code": code})
    if request.method == "POST" and form.is_valid():
        try:
            membership = services.team_join(user=request.user, code=form.cleaned_data["code"])
        except ApplicationError as exc:
            form.add_error("code", exc.message)
        else:
            messages.success(request, _("You joined %(name)s.") % {"name": membership.team.name})
            return redirect("team_detail", slug=membership.team.slug)
    return render(request, "portal/team_join.html", {"form": form, "code": code})


def _team_or_404(request: HttpRequest, slug: str):
    found = selectors.team_get_for_member(user=request.user, slug=slug)
    if found is None:
        raise Http404
    return found


def _member_cap_from_form(form) -> dict[str, int | None]:
    """The member-cap form's fields: a whole number of eighths, a money amount and card-hours; empty is
    no cap."""
    raw_eighths, raw_spend = form.get("max_eighths", "").strip(), form.get("spend_cap", "").strip()
    raw_card = form.get("card_cap", "").strip()
    max_eighths = card_cap = None
    if raw_eighths:
        try:
            max_eighths = int(raw_eighths)
        except ValueError:
            raise ValidationFailed(_("The GPU cap is a whole number of eighths.")) from None
    if raw_card:
        try:
            card_cap = hours_to_micros(Decimal(raw_card))
        except (ArithmeticError, ValueError):
            raise ValidationFailed(_("The card-hour cap is a number of hours.")) from None
    return {
        "max_eighths": max_eighths,
        "monthly_spend_cap_micros": amount_parse(amount=raw_spend) if raw_spend else None,
        "monthly_card_cap_micros": card_cap,
    }


@login_required
def team_detail(request: HttpRequest, slug: str) -> HttpResponse:
    team, membership = _team_or_404(request, slug)
    invite_form = TeamInviteForm(request.POST or None, prefix="invite")
    if request.method == "POST":
        try:
            action = request.POST.get("action")
            if action == "invite" and invite_form.is_valid():
                invite = services.team_invite_create(
                    team=team, actor=request.user, **invite_form.cleaned_data
                )
                messages.success(request, _("Invite created: %(code)s") % {"code": invite.code})
            elif action == "revoke":
                invite = TeamInvite.objects.get(team=team, pk=request.POST.get("invite"))
                services.team_invite_revoke(invite=invite, actor=request.user)
                messages.success(request, _("Invite revoked."))
            elif action in ("remove", "role"):
                member = User.objects.get(memberships__team=team, pk=request.POST.get("member"))
                if action == "remove":
                    services.team_member_remove(team=team, actor=request.user, member=member)
                    messages.success(request, _("%(name)s was removed.") % {"name": member.username})
                else:
                    services.team_member_set_role(
                        team=team, actor=request.user, member=member, role=request.POST.get("role", "")
                    )
                    messages.success(request, _("Role changed."))
            elif action == "folder":
                member = User.objects.get(memberships__team=team, pk=request.POST.get("member"))
                services.team_member_folder_access_set(
                    team=team, actor=request.user, member=member, read_only=request.POST.get("access") == "ro"
                )
                messages.success(
                    request, _("Team folder access changed for %(name)s.") % {"name": member.username}
                )
            elif action == "cap":
                member = User.objects.get(memberships__team=team, pk=request.POST.get("member"))
                services.team_member_cap_set(
                    team=team, actor=request.user, member=member, **_member_cap_from_form(request.POST)
                )
                messages.success(request, _("Cap set for %(name)s.") % {"name": member.username})
            elif action == "leave":
                services.team_leave(team=team, user=request.user)
                messages.success(request, _("You left %(name)s.") % {"name": team.name})
                return redirect("team_list")
        except (TeamInvite.DoesNotExist, User.DoesNotExist):
            messages.error(request, _("That member or invite is not in this team."))
        except ApplicationError as exc:
            messages.error(request, exc.message)
        return redirect("team_detail", slug=team.slug)
    context = {
        "team": team,
        "membership": membership,
        "invites": selectors.team_open_invites(team=team) if membership.manages_team else [],
        "invite_form": invite_form,
        "roles": Membership.Role.choices,
        "join_base": request.build_absolute_uri(reverse("team_join")),
    }
    context |= selectors.team_overview(team=team)
    context["members"] = [row.membership for row in context["member_rows"]]  # by role, then name
    return render(request, "portal/team_detail.html", context)


@never_cache
def livez(request: HttpRequest) -> HttpResponse:
    """Liveness, for a server that routes it to Django (uvicorn answers it before Django: asgi.py)."""
    return HttpResponse(health.LIVENESS_BODY, content_type="application/json")


@never_cache
def readyz(request: HttpRequest) -> JsonResponse:
    """Readiness, also at /healthz: 200 while the portal can serve, 503 with Retry-After when not."""
    ready, report = health.readiness_report()
    response = JsonResponse(report, status=200 if ready else 503)
    if not ready:
        response["Retry-After"] = str(health.NOT_READY_RETRY_AFTER_SECONDS)
    return response


LOGIN_FAILURES_ALLOWED = 5
LOGIN_LOCKOUT_SECONDS = 15 * 60


def _login_failure_keys(request: HttpRequest) -> list[str]:
    username = request.POST.get("username", "").strip().lower()[:150]
    ip = request.META.get("REMOTE_ADDR", "")
    return [f"login-fail:user:{username}", f"login-fail:ip:{ip}"]


class ThrottledLoginView(LoginView):
    """Django's login, locked for 15 minutes after 5 failures for one username or from one address."""

    redirect_authenticated_user = True

    def post(self, request, *args, **kwargs):
        if not settings.LOCAL_PASSWORDS:
            form = self.get_form()
            form.errors.clear()
            form.add_error(None, _("Passwords are turned off here: sign in with single sign-on."))
            return self.render_to_response(self.get_context_data(form=form), status=403)
        keys = _login_failure_keys(request)
        counts = cache.get_many(keys)
        if max(counts.values(), default=0) >= LOGIN_FAILURES_ALLOWED:
            form = self.get_form()
            form.errors.clear()
            form.add_error(
                None, _("Too many failed attempts. Try again in 15 minutes, or reset your password.")
            )
            return self.render_to_response(self.get_context_data(form=form), status=429)
        return super().post(request, *args, **kwargs)

    def form_invalid(self, form):
        pending = signup_services.user_awaiting_verification(
            username=self.request.POST.get("username", ""), password=self.request.POST.get("password", "")
        )
        if pending is not None:  # the right password, but the email is not confirmed: not a failure
            self.request.session[PENDING_USER_KEY] = pending.pk
            messages.info(self.request, _("Your email is not confirmed yet."))
            return redirect("signup_pending")
        for key in _login_failure_keys(self.request):
            attempt_count(key, window_seconds=LOGIN_LOCKOUT_SECONDS)
        return super().form_invalid(form)

    def form_valid(self, form):
        cache.delete_many(_login_failure_keys(self.request))
        return super().form_valid(form)


def not_found(request: HttpRequest, exception=None) -> HttpResponse:
    """404 for a path no route matches: the API's standard error body under /api/, the page elsewhere."""
    if request.path.startswith("/api/"):
        body = {"error": {"code": "not_found", "message": "No such resource.", "fields": {}}}
        return JsonResponse(body, status=404)
    return page_not_found(request, exception)
