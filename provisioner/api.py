"""The provisioner's REST API: the catalog, sessions, quota, the staff's node and quota endpoints, and the
agents' heartbeat. Thin views: check input, call one service or selector, shape the answer.

Who sees a session: its owner, and nobody else — not even the owner or admins of the team that pays for
it (a team lead sees spending in billing, not the members' notebooks). Anyone else's session answers
404, the same as one that does not exist. Staff use the admin site and the admin endpoints.
"""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth import get_user_model
from django.middleware.csrf import get_token
from django.utils.translation import gettext as _
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import permissions
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.views import APIView

from billing.models import Account
from core.compiled import Lookup
from core.errors import ApplicationError, NotFound, ValidationFailed
from core.permissions import StaffOnly
from provisioner import selectors
from provisioner import serializers as io
from provisioner.messages import message
from provisioner.models import Node, Quota, Session, SessionEvent
from provisioner.quotas import quota_set
from provisioner.services.heartbeats import heartbeat_record, heartbeat_validate
from provisioner.services.keepalive import session_keep_alive
from provisioner.services.nodes import node_by_token, node_enroll, node_set_state
from provisioner.services.sessions import session_launch, session_stop
from provisioner.session_view import session_view, session_views

S = Session.State


class NodeUnauthorised(ApplicationError):
    status = 401
    code = "unauthorised"


def _valid(serializer_class, data):
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


# --- shaping ----------------------------------------------------------------------------------------
# Every answer is an ``io.…Out`` serializer's rendering, so the schema is the answer's own shape.


def session_detail_body(session: Session) -> dict:
    return io.SessionDetailOut(session_view(session)).data


def notices_body(session: Session) -> dict:
    return io.NoticesOut(
        {
            "warnings": selectors.session_notices(session=session),
            "labels": {"still_here": _("I'm still here"), "stops_in": _("Stops in {time}")},
            "poll_seconds": settings.SESSION_NOTICES_POLL_SECONDS,
        }
    ).data


def _session_for(request: Request, session_id) -> Session:
    return selectors.session_get_for_user(user=request.user, session_id=session_id)


# --- user endpoints ----------------------------------------------------------------------------------


class CatalogView(APIView):
    @extend_schema(
        summary="GPU models, profiles, environments, prices and what is free now",
        responses={200: OpenApiTypes.OBJECT},
    )
    def get(self, request: Request) -> Response:
        return Response({**selectors.catalog(), "currency": settings.SITE_CURRENCY})


class SessionListView(APIView):
    @extend_schema(
        operation_id="sessions_list",
        summary="Your sessions, newest first",
        parameters=[
            OpenApiParameter(
                "state", str, many=True, enum=S.values, description="Only sessions in these states."
            )
        ],
        responses={200: io.SessionPageOut},
    )
    def get(self, request: Request) -> Response:
        states = {s for raw in request.query_params.getlist("state") for s in raw.split(",") if s}
        if states - set(S.values):
            raise ValidationFailed(
                "Unknown session state.", fields={"state": f"one or more of {', '.join(S.values)}"}
            )
        sessions = selectors.session_list_for_user(user=request.user)
        if states:
            sessions = sessions.filter(state__in=sorted(states))
        paginator = LimitOffsetPagination()
        page = paginator.paginate_queryset(sessions, request, view=self)
        return paginator.get_paginated_response(io.SessionOut(session_views(page), many=True).data)

    @extend_schema(
        summary="Launch a session (placed now, or queued when nothing fits)",
        request=io.LaunchIn,
        parameters=[
            OpenApiParameter(
                "Idempotency-Key",
                str,
                OpenApiParameter.HEADER,
                description="The same key returns the same session (200) instead of launching another.",
            )
        ],
        responses={201: io.SessionDetailOut, 200: io.SessionDetailOut},
    )
    def post(self, request: Request) -> Response:
        fields = _valid(io.LaunchIn, request.data)
        account = _paying_account(request, fields.get("account"))
        launched = session_launch(
            user=request.user,
            account=account,
            gpu_model=fields["gpu_model"],
            profile=fields["profile"],
            environment=fields["environment"],
            max_hours=fields.get("max_hours"),
            idle_minutes=fields.get("idle_minutes"),
            idempotency_key=request.headers.get("Idempotency-Key"),
            tier=fields["tier"],
            resume=fields["resume"],
        )
        session = _session_for(request, launched.session.id)
        return Response(session_detail_body(session), status=200 if launched.replayed else 201)


_ACCOUNT = Lookup(lambda account_id: Account.objects.filter(id=account_id), key_types=(int,))


def _paying_account(request: Request, account_id: int | None) -> Account:
    """The account named (one the user may pay with: the service checks) or the user's own."""
    if account_id is None:
        account_id = request.user.account_id
        if account_id is None:
            raise ValidationFailed("You have no account to pay with.", fields={"account": "required"})
    account = _ACCOUNT.first(account_id)
    if account is None:
        raise NotFound("No such account.", fields={"account": "not one you may pay with"})
    return account


class SessionDetailView(APIView):
    @extend_schema(
        operation_id="sessions_retrieve", summary="One of your sessions", responses={200: io.SessionDetailOut}
    )
    def get(self, request: Request, session_id: str) -> Response:
        return Response(session_detail_body(_session_for(request, session_id)))


class SessionStopView(APIView):
    @extend_schema(
        summary="Stop a session (a queued one is cancelled); idempotent",
        request=io.StopIn,
        responses={200: io.SessionDetailOut},
    )
    def post(self, request: Request, session_id: str) -> Response:
        session = _session_for(request, session_id)
        fields = _valid(io.StopIn, request.data)
        session_stop(
            session=session, actor=request.user, reason=fields["reason"] or message("asked_by_owner")
        )
        return Response(session_detail_body(_session_for(request, session_id)))


class SessionEventsView(APIView):
    @extend_schema(summary="A session's history, oldest first", responses={200: io.EventOut(many=True)})
    def get(self, request: Request, session_id: str) -> Response:
        session = _session_for(request, session_id)
        events = SessionEvent.objects.filter(session=session).order_by("at", "id")[:1000]
        return Response(io.EventOut(events, many=True).data)


class SessionMetricsView(APIView):
    @extend_schema(
        summary="GPU samples of the session's device over its life (the last ones the portal keeps)",
        responses={200: io.MetricsOut},
    )
    def get(self, request: Request, session_id: str) -> Response:
        return Response(io.MetricsOut(session_view(_session_for(request, session_id)).metrics).data)


class SessionNoticesView(APIView):
    @extend_schema(
        summary="What JupyterLab shows inside a running session: its live stop warnings, soonest first",
        responses={200: io.NoticesOut},
    )
    def get(self, request: Request, session_id: str) -> Response:
        session = _session_for(request, session_id)
        get_token(request)  # the CSRF cookie "I'm still here" posts with, in a lab opened from a bookmark
        return Response(notices_body(session))


class SessionStillHereView(APIView):
    @extend_schema(
        summary="I'm still here: restart a running session's idle clock and clear its idle warning "
        "(idempotent); answers its notices",
        request=None,
        responses={200: io.NoticesOut},
    )
    def post(self, request: Request, session_id: str) -> Response:
        session = _session_for(request, session_id)
        session_keep_alive(session_id=session.id)
        return Response(notices_body(session))


class QuotaView(APIView):
    @extend_schema(summary="Your limits and what you use of them", responses={200: OpenApiTypes.OBJECT})
    def get(self, request: Request) -> Response:
        return Response(selectors.quota_usage(user=request.user))


# --- staff endpoints ---------------------------------------------------------------------------------


def _nodes():
    return Node.objects.prefetch_related("devices__gpu_model").order_by("name")


class AdminNodeListView(APIView):
    permission_classes = [*api_settings.DEFAULT_PERMISSION_CLASSES, StaffOnly]  # scopes still apply

    @extend_schema(summary="Nodes and their devices (staff)", responses={200: io.NodeOut(many=True)})
    def get(self, request: Request) -> Response:
        return Response(io.NodeOut(_nodes(), many=True).data)

    @extend_schema(
        operation_id="admin_nodes_create",
        summary="Enrol a node (staff); the token is shown once",
        request=io.NodeEnrollIn,
        responses={201: io.NodeEnrolledOut},
    )
    def post(self, request: Request) -> Response:
        fields = _valid(io.NodeEnrollIn, request.data)
        enrolment = node_enroll(
            name=fields["name"], address=fields["address"], labels=fields.get("labels"), actor=request.user
        )
        node = _nodes().get(id=enrolment.node.id)
        return Response(io.NodeEnrolledOut(node, context={"token": enrolment.token}).data, status=201)


class AdminNodeActionView(APIView):
    permission_classes = [*api_settings.DEFAULT_PERMISSION_CLASSES, StaffOnly]  # scopes still apply

    @extend_schema(
        operation_id="admin_nodes_action",
        summary="Cordon, drain or uncordon a node (staff)",
        request=io.NodeActionIn,
        responses={200: io.NodeOut},
    )
    def post(self, request: Request, node_id: int, action: str) -> Response:
        fields = _valid(io.NodeActionIn, request.data)
        node = node_set_state(node_id=node_id, action=action, actor=request.user, reason=fields["reason"])
        return Response(io.NodeOut(_nodes().get(id=node.id)).data)


class AdminQuotaView(APIView):
    permission_classes = [*api_settings.DEFAULT_PERMISSION_CLASSES, StaffOnly]  # scopes still apply

    @extend_schema(summary="Every quota row (staff)", responses={200: io.QuotaOut(many=True)})
    def get(self, request: Request) -> Response:
        return Response(io.QuotaOut(Quota.objects.order_by("id"), many=True).data)

    @extend_schema(
        summary="Set limits of a user, a team account, or a member inside a team (staff; audited)",
        description="Only the limits given change; null means the default (for a member: no extra cap).",
        request=io.QuotaSetIn,
        responses={200: io.QuotaOut},
    )
    def put(self, request: Request) -> Response:
        fields = _valid(io.QuotaSetIn, request.data)
        user = account = None
        if fields.get("user"):
            user = get_user_model().objects.filter(pk=fields["user"]).first()
            if user is None:
                raise NotFound("No such user.", fields={"user": "unknown"})
        if fields.get("account"):
            account = Account.objects.filter(id=fields["account"]).first()
            if account is None:
                raise NotFound("No such account.", fields={"account": "unknown"})
        quota = quota_set(
            user=user,
            account=account,
            limits=dict(fields["limits"]),
            actor=request.user,
            reason=fields["reason"],
        )
        return Response(io.QuotaOut(quota).data)


# --- the agents' door --------------------------------------------------------------------------------


class HeartbeatView(APIView):
    """``POST /api/agent/heartbeat`` from a node agent, authenticated by its node token (not a user)."""

    authentication_classes: list = []
    permission_classes = [permissions.AllowAny]
    throttle_classes: list = []

    @extend_schema(
        summary="A node agent's heartbeat (node token as Bearer); answers its desired workloads",
        request=OpenApiTypes.OBJECT,
        responses={200: io.HeartbeatOut},
        auth=[],
    )
    def post(self, request: Request) -> Response:
        kind, _, token = request.headers.get("Authorization", "").partition(" ")
        try:
            if kind.lower() != "bearer":
                raise NotFound("No token.")
            node = node_by_token(token=token.strip())
        except NotFound:
            raise NodeUnauthorised("Unknown node token.")
        body = heartbeat_validate(request.data)
        return Response(io.HeartbeatOut(heartbeat_record(node=node, body=body)).data)
