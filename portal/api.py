"""REST endpoints of the portal app: the caller, their teams and their personal access tokens.

A team one is not in does not exist for them (404). Its members see what the team page shows them:
the members, their roles, their spend this month and their caps; its owners and admins also see the
open invites, set caps and remove members, and its owners change roles. Team changes, like token
management, take a logged-in browser session: no token scope covers them.
"""

from __future__ import annotations

from dataclasses import asdict

from django.utils.translation import gettext as _
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from core.errors import NotFound
from portal import selectors, services
from portal.auth import NO_TOKEN
from portal.models import AccessToken, Membership, Team, TeamInvite, User


class TeamRefOut(serializers.Serializer):
    slug = serializers.SlugField()
    name = serializers.CharField()
    role = serializers.ChoiceField(choices=Membership.Role.choices, help_text="Your role in the team.")
    account_id = serializers.IntegerField(help_text="The team's account: ?account= on wallet, ledger, cards.")


def _team_ref(membership: Membership) -> dict:
    team = membership.team
    return {"slug": team.slug, "name": team.name, "role": membership.role, "account_id": team.account_id}


def _memberships_of(user: User):
    return Membership.objects.select_related("team").filter(user=user).order_by("team__name")


class MeSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    username = serializers.CharField()
    email = serializers.EmailField()
    language = serializers.CharField()
    time_zone = serializers.CharField()
    account_id = serializers.IntegerField()
    teams = TeamRefOut(many=True)


class MeView(APIView):
    token_scope = "read"

    @extend_schema(summary="You, and the teams you are in", responses=MeSerializer)
    def get(self, request):
        user = request.user
        teams = [_team_ref(m) for m in _memberships_of(user)]
        return Response(
            MeSerializer(
                {
                    "id": user.pk,
                    "username": user.username,
                    "email": user.email,
                    "language": user.language,
                    "time_zone": user.time_zone,
                    "account_id": user.account_id,
                    "teams": teams,
                }
            ).data
        )


class TokenSerializer(serializers.ModelSerializer):
    class Meta:
        model = AccessToken
        fields = ["id", "name", "prefix", "scopes", "created_at", "expires_at", "last_used_at", "revoked_at"]


class TokenCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=100)
    scopes = serializers.ListField(
        child=serializers.ChoiceField(choices=AccessToken.Scope.values), min_length=1
    )
    expires_in_days = serializers.IntegerField(min_value=1, max_value=366, required=False, default=90)


class TokenCreatedSerializer(TokenSerializer):
    token = serializers.CharField(help_text="Shown only in this answer.")

    class Meta(TokenSerializer.Meta):
        fields = [*TokenSerializer.Meta.fields, "token"]


class TokenListView(APIView):
    """Personal access tokens can only be managed from a logged-in browser session, not with a token."""

    token_scope = NO_TOKEN

    @extend_schema(responses=TokenSerializer(many=True))
    def get(self, request):
        tokens = AccessToken.objects.filter(user=request.user).order_by("-created_at")
        return Response(TokenSerializer(tokens, many=True).data)

    @extend_schema(request=TokenCreateSerializer, responses={201: TokenCreatedSerializer})
    def post(self, request):
        payload = TokenCreateSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        token, raw = services.access_token_create(user=request.user, **payload.validated_data)
        body = TokenSerializer(token).data | {"token": raw}
        return Response(body, status=status.HTTP_201_CREATED)


class TokenDetailView(APIView):
    token_scope = NO_TOKEN

    @extend_schema(request=None, responses={204: None})
    def delete(self, request, token_id: int):
        services.access_token_revoke(user=request.user, token_id=token_id)
        return Response(status=status.HTTP_204_NO_CONTENT)


# --- teams -------------------------------------------------------------------------------------------


class TeamLimitsOut(serializers.Serializer):
    max_eighths = serializers.IntegerField(allow_null=True)
    max_sessions = serializers.IntegerField(allow_null=True)
    allowed_gpu_models = serializers.ListField(child=serializers.CharField(), allow_null=True)
    allowed_profiles = serializers.ListField(child=serializers.CharField(), allow_null=True)
    max_session_seconds = serializers.IntegerField(allow_null=True)
    monthly_spend_cap_micros = serializers.IntegerField(allow_null=True)
    monthly_card_cap_micros = serializers.IntegerField(allow_null=True, help_text="Micro card-hours a month.")


class UsageOut(serializers.Serializer):
    sessions = serializers.IntegerField(help_text="Live sessions now.")
    eighths = serializers.IntegerField(help_text="Eighths of a GPU held now.")
    spend_micros = serializers.IntegerField(help_text="Spent on the team's account this month.")
    card_micros = serializers.IntegerField(help_text="Card-hours burned this month, in micro card-hours.")


class MemberCapOut(serializers.Serializer):
    max_eighths = serializers.IntegerField(allow_null=True)
    monthly_spend_cap_micros = serializers.IntegerField(allow_null=True)
    monthly_card_cap_micros = serializers.IntegerField(allow_null=True)


class MemberOut(serializers.Serializer):
    user = serializers.IntegerField(help_text="The member's user id.")
    username = serializers.CharField()
    role = serializers.ChoiceField(choices=Membership.Role.choices)
    joined_at = serializers.DateTimeField()
    usage = UsageOut()
    cap = MemberCapOut(help_text="The member's own cap inside the team's quota; null: none of their own.")
    folder_read_only = serializers.BooleanField(
        help_text="Whether the member's sessions see the team folder read-only (owners and admins: never)."
    )


class InviteOut(serializers.Serializer):
    id = serializers.IntegerField()
    code = serializers.CharField()
    role = serializers.ChoiceField(choices=Membership.Role.choices)
    uses = serializers.IntegerField()
    max_uses = serializers.IntegerField()
    expires_at = serializers.DateTimeField()


class TeamFolderOut(serializers.Serializer):
    path = serializers.CharField(help_text="Where members' sessions see it.")
    bytes = serializers.IntegerField(allow_null=True, help_text="As last measured; null: not measured yet.")
    files = serializers.IntegerField(allow_null=True)
    measured_at = serializers.DateTimeField(allow_null=True)
    max_bytes = serializers.IntegerField(allow_null=True, help_text="null: no limit.")
    max_files = serializers.IntegerField(allow_null=True, help_text="null: no limit.")
    over = serializers.BooleanField(help_text="Over a limit: members' new sessions see it read-only.")


class MemberFolderIn(serializers.Serializer):
    read_only = serializers.BooleanField()


class TeamDetailOut(TeamRefOut):
    limits = TeamLimitsOut(help_text="The team's quota (null: no limit).")
    usage = UsageOut()
    folder = TeamFolderOut(help_text="The team's shared folder (docs/STORAGE.md, 'Team folders').")
    members = MemberOut(many=True)
    invites = InviteOut(
        many=True,
        allow_null=True,
        help_text="Open invites, for the team's owners and admins; null for members.",
    )


class MemberCapIn(serializers.Serializer):
    max_eighths = serializers.IntegerField(
        min_value=0, max_value=2**31 - 1, allow_null=True, help_text="Eighths of a GPU at once; null: no cap."
    )
    monthly_spend_cap_micros = serializers.IntegerField(
        min_value=0, max_value=2**63 - 1, allow_null=True, help_text="Spend a month; null: no cap."
    )
    monthly_card_cap_micros = serializers.IntegerField(
        min_value=0,
        max_value=2**63 - 1,
        allow_null=True,
        required=False,
        default=None,
        help_text="Micro card-hours a month; null or absent: no cap.",
    )


class MemberRoleIn(serializers.Serializer):
    role = serializers.ChoiceField(choices=Membership.Role.choices)


def _member_body(row: selectors.MemberSpend) -> dict:
    m = row.membership
    return {
        "user": m.user_id,
        "username": m.user.username,
        "role": m.role,
        "joined_at": m.joined_at,
        "usage": asdict(row.usage),
        "cap": {
            "max_eighths": row.limits.max_eighths,
            "monthly_spend_cap_micros": row.limits.monthly_spend_cap_micros,
            "monthly_card_cap_micros": row.limits.monthly_card_cap_micros,
        },
        "folder_read_only": m.folder_read_only and not m.manages_team,
    }


def _folder_body(team: Team, folder) -> dict:
    use = folder.use
    return {
        "path": f"/home/teams/{team.slug}",
        "bytes": use.bytes if use else None,
        "files": use.files if use else None,
        "measured_at": use.measured_at if use else None,
        "max_bytes": folder.max_bytes,
        "max_files": folder.max_files,
        "over": bool(use and use.over),
    }


def _team_for(request: Request, slug: str) -> tuple[Team, Membership]:
    found = selectors.team_get_for_member(user=request.user, slug=slug)
    if found is None:
        raise NotFound(_("No such team."))
    return found


def _member_of(team: Team, user_id: int) -> User:
    member = selectors.team_member_get(team=team, user_id=user_id)
    if member is None:
        raise NotFound(_("No such member in this team."))
    return member


def _member_row(team: Team, user_id: int) -> dict:
    (row,) = selectors.team_member_spend(team=team, user_id=user_id)
    return _member_body(row)


def _invite_body(invite: TeamInvite) -> dict:
    return {
        "id": invite.id,
        "code": invite.code,
        "role": invite.role,
        "uses": invite.uses,
        "max_uses": invite.max_uses,
        "expires_at": invite.expires_at,
    }


class TeamCreateIn(serializers.Serializer):
    name = serializers.CharField(max_length=100)


class TeamJoinIn(serializers.Serializer):
    code = serializers.CharField(max_length=64)


class InviteIn(serializers.Serializer):
    role = serializers.ChoiceField(choices=Membership.Role.choices, default=Membership.Role.MEMBER)
    valid_days = serializers.IntegerField(min_value=1, max_value=90, default=7)
    max_uses = serializers.IntegerField(min_value=1, max_value=1000, default=20)


def _valid(serializer_class, data) -> dict:
    payload = serializer_class(data=data)
    payload.is_valid(raise_exception=True)
    return payload.validated_data


def _membership_ref(user: User, team: Team) -> dict:
    return _team_ref(Membership.objects.select_related("team").get(team=team, user=user))


class TeamListView(APIView):
    @extend_schema(
        operation_id="teams_list", summary="The teams you are in, by name", responses=TeamRefOut(many=True)
    )
    def get(self, request: Request) -> Response:
        return Response([_team_ref(m) for m in _memberships_of(request.user)])

    @extend_schema(
        operation_id="teams_create",
        summary="Create a team with its own account; you are its owner",
        request=TeamCreateIn,
        responses={201: TeamRefOut},
    )
    def post(self, request: Request) -> Response:
        team = services.team_create(creator=request.user, name=_valid(TeamCreateIn, request.data)["name"])
        return Response(_membership_ref(request.user, team), status=status.HTTP_201_CREATED)


class TeamJoinView(APIView):
    token_scope = NO_TOKEN

    @extend_schema(
        operation_id="teams_join",
        summary="Join a team with its invite code",
        request=TeamJoinIn,
        responses={201: TeamRefOut},
    )
    def post(self, request: Request) -> Response:
        membership = services.team_join(user=request.user, code=_valid(TeamJoinIn, request.data)["code"])
        return Response(_membership_ref(request.user, membership.team), status=status.HTTP_201_CREATED)


class TeamLeaveView(APIView):
    token_scope = NO_TOKEN

    @extend_schema(operation_id="teams_leave", summary="Leave a team", request=None, responses={204: None})
    def post(self, request: Request, slug: str) -> Response:
        team, _membership = _team_for(request, slug)
        services.team_leave(team=team, user=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


class TeamInviteListView(APIView):
    token_scope = NO_TOKEN

    @extend_schema(
        operation_id="teams_invites_create",
        summary="Create an invite code (the team's owners and admins; only owners invite admins)",
        request=InviteIn,
        responses={201: InviteOut},
    )
    def post(self, request: Request, slug: str) -> Response:
        team, _membership = _team_for(request, slug)
        invite = services.team_invite_create(team=team, actor=request.user, **_valid(InviteIn, request.data))
        return Response(_invite_body(invite), status=status.HTTP_201_CREATED)


class TeamInviteDetailView(APIView):
    token_scope = NO_TOKEN

    @extend_schema(
        operation_id="teams_invites_revoke",
        summary="Revoke an invite code (the team's owners and admins)",
        request=None,
        responses={204: None},
    )
    def delete(self, request: Request, slug: str, invite_id: int) -> Response:
        team, _membership = _team_for(request, slug)
        invite = TeamInvite.objects.filter(team=team, pk=invite_id).first()
        if invite is None:
            raise NotFound(_("No such invite."))
        services.team_invite_revoke(invite=invite, actor=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


class TeamDetailView(APIView):
    @extend_schema(
        operation_id="teams_retrieve",
        summary="A team of yours: its quota and use, and each member's role, spend this month and cap",
        responses=TeamDetailOut,
    )
    def get(self, request: Request, slug: str) -> Response:
        team, membership = _team_for(request, slug)
        overview = selectors.team_overview(team=team)
        invites = None
        if membership.manages_team:
            invites = [_invite_body(i) for i in selectors.team_open_invites(team=team)]
        return Response(
            {
                **_team_ref(membership),
                "limits": asdict(overview["team_limits"]),
                "usage": asdict(overview["team_usage"]),
                "members": [_member_body(row) for row in overview["member_rows"]],
                "folder": _folder_body(team, overview["team_folder"]),
                "invites": invites,
            }
        )


MEMBER = OpenApiParameter("user_id", int, OpenApiParameter.PATH, description="The member's user id.")


class TeamMemberView(APIView):
    token_scope = NO_TOKEN

    @extend_schema(
        operation_id="teams_member_role_set",
        summary="Change a member's role (the team's owners; audited)",
        parameters=[MEMBER],
        request=MemberRoleIn,
        responses={200: MemberOut},
    )
    def put(self, request: Request, slug: str, user_id: int) -> Response:
        team, _membership = _team_for(request, slug)
        member = _member_of(team, user_id)
        payload = MemberRoleIn(data=request.data)
        payload.is_valid(raise_exception=True)
        services.team_member_set_role(
            team=team, actor=request.user, member=member, role=payload.validated_data["role"]
        )
        return Response(_member_row(team, member.pk))

    @extend_schema(
        operation_id="teams_member_remove",
        summary="Remove a member (the team's owners and admins; only owners remove admins; audited)",
        parameters=[MEMBER],
        request=None,
        responses={204: None},
    )
    def delete(self, request: Request, slug: str, user_id: int) -> Response:
        team, _membership = _team_for(request, slug)
        services.team_member_remove(team=team, actor=request.user, member=_member_of(team, user_id))
        return Response(status=status.HTTP_204_NO_CONTENT)


class TeamMemberCapView(APIView):
    token_scope = NO_TOKEN

    @extend_schema(
        operation_id="teams_member_cap_set",
        summary="Cap a member inside the team's quota (the team's owners and admins; audited)",
        description="Both limits are set: null means the member has no cap of their own for it. A cap above "
        "the team's own limit is refused.",
        parameters=[MEMBER],
        request=MemberCapIn,
        responses={200: MemberOut},
    )
    def put(self, request: Request, slug: str, user_id: int) -> Response:
        team, _membership = _team_for(request, slug)
        member = _member_of(team, user_id)
        payload = MemberCapIn(data=request.data)
        payload.is_valid(raise_exception=True)
        services.team_member_cap_set(team=team, actor=request.user, member=member, **payload.validated_data)
        return Response(_member_row(team, member.pk))


class TeamMemberFolderView(APIView):
    token_scope = NO_TOKEN

    @extend_schema(
        operation_id="teams_member_folder_set",
        summary="Make the team folder read-only or read-write for a member (the team's owners and admins; "
        "audited)",
        description="Sessions the member launches from now on mount it so; an owner or admin is never "
        "read-only (403 team_folder_manager).",
        parameters=[MEMBER],
        request=MemberFolderIn,
        responses={200: MemberOut},
    )
    def put(self, request: Request, slug: str, user_id: int) -> Response:
        team, _membership = _team_for(request, slug)
        member = _member_of(team, user_id)
        read_only = _valid(MemberFolderIn, request.data)["read_only"]
        services.team_member_folder_access_set(
            team=team, actor=request.user, member=member, read_only=read_only
        )
        return Response(_member_row(team, member.pk))
