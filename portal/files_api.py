"""The files API: the caller's own home, listed, downloaded, uploaded to in resumable parts and deleted
from (docs/STORAGE.md). There is no way to name another user's home: the home is always the caller's
(``provisioner.selectors.workload_user``), and an upload is found only by its owner.

The upload protocol, small and explicit (after tus): ``POST /api/v1/files/uploads {path, size}`` gives
an id; ``GET`` (or ``HEAD``) of the upload answers its offset, also in the ``Upload-Offset`` header;
``PATCH`` with ``Upload-Offset: <offset>`` and up to 16 MiB of bytes appends them there (409 with the
server's offset when the client's is wrong); the part that reaches the size puts the file in place.
"""

from __future__ import annotations

from django.http import FileResponse
from django.utils.translation import gettext as _
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from core.errors import ValidationFailed
from portal.homes import CHUNK_MAX_BYTES, home_storage
from portal.homes.base import Upload
from portal.services import home_file_delete, home_upload_begin
from provisioner.selectors import workload_user

PATH = OpenApiParameter("path", str, description="A path relative to your home, e.g. data/train.csv.")
OFFSET_HEADER = "Upload-Offset"
# Every call, a read too, answers 409 files_unavailable where homes are local to each GPU host.
UNAVAILABLE = {
    409: OpenApiResponse(description="files_unavailable: this site's homes are local to each GPU host")
}


class FileEntryOut(serializers.Serializer):
    name = serializers.CharField()
    kind = serializers.ChoiceField(choices=["file", "folder", "link", "other"])
    size_bytes = serializers.IntegerField()
    modified = serializers.FloatField(help_text="Seconds since the epoch.")


class FileListingOut(serializers.Serializer):
    path = serializers.CharField()
    entries = FileEntryOut(many=True)


class RemovedOut(serializers.Serializer):
    path = serializers.CharField()
    bytes = serializers.IntegerField(help_text="Allocated bytes freed (st_blocks * 512), as quotas count.")
    entries = serializers.IntegerField(help_text="Files, folders and links removed.")


class FileDeleteOut(serializers.Serializer):
    deleted = RemovedOut()


class FileUploadIn(serializers.Serializer):
    path = serializers.CharField(max_length=1024)
    size = serializers.IntegerField(min_value=0)


class FileUploadOut(serializers.Serializer):
    id = serializers.CharField()
    path = serializers.CharField()
    size = serializers.IntegerField(source="size_bytes")
    offset = serializers.IntegerField(source="offset_bytes")
    complete = serializers.BooleanField()


def _upload_response(upload: Upload, status_code: int = status.HTTP_200_OK) -> Response:
    response = Response(FileUploadOut(upload).data, status=status_code)
    response[OFFSET_HEADER] = str(upload.offset_bytes)
    return response


class FileListView(APIView):
    @extend_schema(
        summary="A folder of your home", parameters=[PATH], responses={200: FileListingOut, **UNAVAILABLE}
    )
    def get(self, request: Request) -> Response:
        path = request.query_params.get("path", "")
        entries = home_storage().listing(folder=workload_user(request.user), path=path)
        return Response(FileListingOut({"path": path, "entries": list(entries)}).data)

    @extend_schema(
        summary="Delete a file, link or folder (with everything in it) from your home",
        parameters=[PATH],
        responses={200: FileDeleteOut, **UNAVAILABLE},
    )
    def delete(self, request: Request) -> Response:
        removed = home_file_delete(user=request.user, path=request.query_params.get("path", ""))
        return Response(FileDeleteOut({"deleted": removed}).data)


class FileDownloadView(APIView):
    @extend_schema(
        summary="One file of your home, streamed",
        parameters=[PATH],
        responses={(200, "application/octet-stream"): OpenApiResponse(OpenApiTypes.BINARY), **UNAVAILABLE},
    )
    def get(self, request: Request) -> FileResponse:
        found = home_storage().download_open(
            folder=workload_user(request.user), path=request.query_params.get("path", "")
        )
        response = FileResponse(found.file, as_attachment=True, filename=found.name)
        response["Content-Length"] = str(found.size_bytes)
        response["Content-Type"] = "application/octet-stream"
        response["X-Content-Type-Options"] = "nosniff"
        return response


class UploadListView(APIView):
    @extend_schema(
        summary="Begin a resumable upload into your home",
        request=FileUploadIn,
        responses={201: FileUploadOut},
    )
    def post(self, request: Request) -> Response:
        fields = FileUploadIn(data=request.data)
        fields.is_valid(raise_exception=True)
        upload = home_upload_begin(
            user=request.user, path=fields.validated_data["path"], size_bytes=fields.validated_data["size"]
        )
        return _upload_response(upload, status.HTTP_201_CREATED)


class UploadDetailView(APIView):
    @extend_schema(
        summary="Where an upload stands (its offset)", responses={200: FileUploadOut, **UNAVAILABLE}
    )
    def get(self, request: Request, upload_id: str) -> Response:
        return _upload_response(home_storage().upload_status(owner_id=request.user.pk, upload_id=upload_id))

    def head(self, request: Request, upload_id: str) -> Response:
        return self.get(request, upload_id)

    @extend_schema(
        summary="Append up to 16 MiB at the upload's offset (the Upload-Offset header)",
        parameters=[OpenApiParameter(OFFSET_HEADER, int, OpenApiParameter.HEADER, required=True)],
        request={"application/octet-stream": OpenApiTypes.BINARY},  # any type: the bytes are the body
        responses={200: FileUploadOut},
    )
    def patch(self, request: Request, upload_id: str) -> Response:
        offset = request.headers.get(OFFSET_HEADER, "")
        length = request.META.get("CONTENT_LENGTH") or ""
        if not offset.isdigit() or not length.isdigit():
            home_storage().upload_status(owner_id=request.user.pk, upload_id=upload_id)  # 404 if not theirs
            raise ValidationFailed(
                _("Send the part's offset in the Upload-Offset header, and its length."),
                fields={"offset": offset, "length": length},
            )
        if int(length) > CHUNK_MAX_BYTES:  # refused before a byte of the body is read
            raise ValidationFailed(
                _("Send the file in parts of up to 16 MiB, none past its announced size."),
                fields={"length": length},
            )
        upload = home_storage().upload_append(
            owner_id=request.user.pk,
            upload_id=upload_id,
            offset_bytes=int(offset),
            length_bytes=int(length),
            body=request._request,  # the raw body, unparsed: DRF's parsers would read it into memory
        )
        return _upload_response(upload)
