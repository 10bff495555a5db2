"""The notices REST API: your notices, and marking them read or dismissed."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from notices.selectors import notices_recent, notices_unread_count
from notices.services import notice_dismiss, notice_read, notices_mark_all_read

LIST_SIZE = 50


class NoticeOut(serializers.Serializer):
    id = serializers.IntegerField()
    kind = serializers.CharField(help_text="card_expiring, session_stopped, runway_low, …")
    title = serializers.CharField(help_text="The kind, in words, in your language.")
    text = serializers.CharField(help_text="The notice, in your language.")
    url = serializers.CharField(help_text="A path on the site about it (a session's page), or empty.")
    created_at = serializers.DateTimeField()
    read_at = serializers.DateTimeField(allow_null=True)
    dismissed_at = serializers.DateTimeField(allow_null=True)


class NoticeListOut(serializers.Serializer):
    unread = serializers.IntegerField(help_text="Notices not read and not dismissed.")
    notices = NoticeOut(many=True, help_text=f"The newest {LIST_SIZE} not dismissed, newest first.")


class MarkedOut(serializers.Serializer):
    marked = serializers.IntegerField(help_text="Notices that were unread.")


class _NoticeView(APIView):
    # Reading one's notices and marking them read or dismissed changes nothing but their own list:
    # a read-only token may do it.
    token_scope = "read"


class NoticeListView(_NoticeView):
    @extend_schema(operation_id="notices_list", summary="Your notices, and how many are unread",
                   responses={200: NoticeListOut})  # fmt: skip
    def get(self, request: Request) -> Response:
        notices = notices_recent(user=request.user, limit=LIST_SIZE)
        return Response(
            {
                "unread": notices_unread_count(user=request.user),
                "notices": NoticeOut(notices, many=True).data,
            }
        )


class NoticeReadView(_NoticeView):
    @extend_schema(operation_id="notices_read", summary="Mark one of your notices read", request=None,
                   responses={200: NoticeOut})  # fmt: skip
    def post(self, request: Request, notice_id: int) -> Response:
        return Response(NoticeOut(notice_read(user=request.user, notice_id=notice_id)).data)


class NoticeDismissView(_NoticeView):
    @extend_schema(operation_id="notices_dismiss", summary="Take one of your notices off your list",
                   request=None, responses={200: NoticeOut})  # fmt: skip
    def post(self, request: Request, notice_id: int) -> Response:
        return Response(NoticeOut(notice_dismiss(user=request.user, notice_id=notice_id)).data)


class NoticeReadAllView(_NoticeView):
    @extend_schema(operation_id="notices_read_all", summary="Mark all your notices read", request=None,
                   responses={200: MarkedOut})  # fmt: skip
    def post(self, request: Request) -> Response:
        return Response({"marked": notices_mark_all_read(user=request.user)})
