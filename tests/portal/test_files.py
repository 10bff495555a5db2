"""The files API on shared homes, attacked from where a tenant stands: paths with ``..``, absolute
paths, symbolic links and a FIFO planted in their own home (as code in their kernel would), another
user's upload id. A real folder stands in for the shared mount; the portal runs as root here, as it
must to write files as their owners' uids."""

from __future__ import annotations

import hashlib
import os

import pytest
from rest_framework.test import APIClient

from portal.services import access_token_create
from provisioner.selectors import workload_user
from tests.provisioner.conftest import make_user

MIB = 2**20


@pytest.fixture
def root(settings, tmp_path):
    settings.HOMES_BACKEND = "shared"
    settings.HOMES_SHARED_ROOT = str(tmp_path / "homes")
    (tmp_path / "homes").mkdir()
    return tmp_path / "homes"


def _client(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def _begin(client: APIClient, path: str, size: int) -> str:
    created = client.post("/api/v1/files/uploads", {"path": path, "size": size}, format="json")
    assert created.status_code == 201, created.content
    assert created["Upload-Offset"] == "0"
    return created.json()["id"]


def _patch(client: APIClient, upload_id: str, offset: int, data: bytes):
    return client.generic(
        "PATCH",
        f"/api/v1/files/uploads/{upload_id}",
        data,
        content_type="application/offset+octet-stream",
        HTTP_UPLOAD_OFFSET=str(offset),
    )


def _upload(client: APIClient, path: str, data: bytes):
    upload_id = _begin(client, path, len(data))
    return _patch(client, upload_id, 0, data) if data else None


def _everything_under(folder) -> set[str]:
    return {os.path.relpath(os.path.join(d, n), folder) for d, ds, fs in os.walk(folder) for n in ds + fs}


@pytest.mark.django_db
def test_an_upload_cut_off_resumes_from_the_offset_the_server_holds(root):
    alice = make_user("alice")
    client = _client(alice)
    data = os.urandom(3 * MIB + 17)
    upload_id = _begin(client, "data/run-1/weights.bin", len(data))
    assert _patch(client, upload_id, 0, data[:MIB]).json()["offset"] == MIB
    # the connection is cut here; the client asks where the upload stands and goes on from there
    asked = client.head(f"/api/v1/files/uploads/{upload_id}")
    assert asked.status_code == 200 and asked["Upload-Offset"] == str(MIB)
    assert client.get(f"/api/v1/files/uploads/{upload_id}").json()["offset"] == MIB
    home = root / workload_user(alice)
    assert not (home / "data" / "run-1" / "weights.bin").exists()  # nothing in place until it is whole
    middle = _patch(client, upload_id, MIB, data[MIB : 3 * MIB])
    assert middle.json() == {"id": upload_id, "path": "data/run-1/weights.bin", "size": len(data),
                             "offset": 3 * MIB, "complete": False}  # fmt: skip
    done = _patch(client, upload_id, 3 * MIB, data[3 * MIB :])
    assert done.status_code == 200 and done.json()["complete"] is True
    assert (home / "data" / "run-1" / "weights.bin").read_bytes() == data
    assert client.get(f"/api/v1/files/uploads/{upload_id}").status_code == 404  # finished: gone
    assert _everything_under(root / ".suanli" / "uploads") == set()

    listed = client.get("/api/v1/files", {"path": "data/run-1"}).json()
    assert [(e["name"], e["kind"], e["size_bytes"]) for e in listed["entries"]] == [
        ("weights.bin", "file", len(data))
    ]
    got = client.get("/api/v1/files/download", {"path": "data/run-1/weights.bin"})
    assert got.status_code == 200 and got["Content-Length"] == str(len(data))
    assert "attachment" in got["Content-Disposition"]
    assert hashlib.sha256(b"".join(got.streaming_content)).digest() == hashlib.sha256(data).digest()


@pytest.mark.django_db
def test_a_part_at_the_wrong_offset_is_a_409_naming_the_servers_offset_and_writes_nothing(root):
    client = _client(make_user())
    upload_id = _begin(client, "a.bin", 10)
    assert _patch(client, upload_id, 0, b"01234").status_code == 200
    for offset in (0, 3, 7):
        refused = _patch(client, upload_id, offset, b"xyz")
        assert refused.status_code == 409, refused.content
        assert refused.json()["error"]["code"] == "upload_offset"
        assert refused.json()["error"]["fields"] == {"offset": "5"}
    assert _patch(client, upload_id, 5, b"56789-too-long").status_code == 400  # past the announced size
    assert client.head(f"/api/v1/files/uploads/{upload_id}")["Upload-Offset"] == "5"
    missing_header = client.generic("PATCH", f"/api/v1/files/uploads/{upload_id}", b"56789")
    assert missing_header.status_code == 400
    assert _patch(client, upload_id, 5, b"56789").json()["complete"] is True


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["../x", "/etc/suanli-probe", "a/../../x", "..", "", ".", "a/\x00b"])
def test_paths_outside_the_home_are_refused_and_nothing_is_written(root, tmp_path, path):
    client = _client(make_user())
    before = _everything_under(tmp_path)
    answer = client.post("/api/v1/files/uploads", {"path": path, "size": 1}, format="json")
    assert answer.status_code == 400, answer.content
    if path:
        assert client.get("/api/v1/files/download", {"path": path}).status_code == 400
    assert _everything_under(tmp_path) == before
    assert not os.path.exists("/etc/suanli-probe")


@pytest.mark.django_db
def test_symbolic_links_a_tenant_planted_are_never_followed(root, tmp_path):
    alice, bob = make_user("alice"), make_user("bob")
    client = _client(alice)
    _upload(_client(bob), "secret.txt", b"bob's work")
    bob_home = root / workload_user(bob)
    home = root / workload_user(alice)
    home.mkdir(mode=0o700)
    outside = tmp_path / "outside.txt"
    outside.write_text("not alice's")
    # what code in alice's kernel can do to her own home
    (home / "etc").symlink_to("/etc")
    (home / "bobs").symlink_to(bob_home)
    (home / "up").symlink_to("..")
    (home / "real").mkdir()
    (home / "real" / "deeper").symlink_to(bob_home)
    (home / "link.txt").symlink_to(outside)
    os.mkfifo(home / "pipe")

    for path in ("etc/passwd", "bobs/secret.txt", "up/" + workload_user(bob) + "/secret.txt",
                 "real/deeper/secret.txt", "link.txt", "pipe", "real"):  # fmt: skip
        assert client.get("/api/v1/files/download", {"path": path}).status_code == 404, path
    for path in ("etc", "bobs", "real/deeper"):
        assert client.get("/api/v1/files", {"path": path}).status_code == 404, path
    kinds = {e["name"]: e["kind"] for e in client.get("/api/v1/files").json()["entries"]}
    assert kinds == {"etc": "link", "bobs": "link", "up": "link", "real": "folder", "link.txt": "link",
                     "pipe": "other"}  # fmt: skip

    for path in ("etc/suanli-probe", "bobs/planted.txt", "real/deeper/planted.txt"):
        assert _upload(client, path, b"x").status_code == 404, path
    assert not os.path.exists("/etc/suanli-probe")
    assert sorted(os.listdir(bob_home)) == ["secret.txt"]
    # a link at the target's own name is replaced, not written through
    assert _upload(client, "link.txt", b"alice's").status_code == 200
    assert not (home / "link.txt").is_symlink() and (home / "link.txt").read_bytes() == b"alice's"
    assert outside.read_text() == "not alice's"


@pytest.mark.django_db
def test_another_users_upload_and_home_are_unreachable(root):
    alice, mallory = make_user("alice"), make_user("mallory")
    alices = _client(alice)
    upload_id = _begin(alices, "thesis.pdf", 6)
    assert _patch(alices, upload_id, 0, b"abc").status_code == 200
    _upload(alices, "notes.txt", b"alice's notes")
    thief = _client(mallory)
    assert thief.get(f"/api/v1/files/uploads/{upload_id}").status_code == 404
    assert thief.head(f"/api/v1/files/uploads/{upload_id}").status_code == 404
    assert _patch(thief, upload_id, 3, b"def").status_code == 404
    assert thief.get("/api/v1/files/download", {"path": "notes.txt"}).status_code == 404
    assert thief.get("/api/v1/files").json()["entries"] == []  # her own home: empty
    escape = f"../{workload_user(alice)}/notes.txt"
    assert thief.get("/api/v1/files/download", {"path": escape}).status_code == 400
    assert alices.head(f"/api/v1/files/uploads/{upload_id}")["Upload-Offset"] == "3"


@pytest.mark.django_db
def test_files_the_portal_writes_belong_to_the_uid_the_homes_sessions_run_as(root):
    user = make_user()
    home = root / workload_user(user)
    home.mkdir(mode=0o700)
    os.chown(home, 60123, 60123)  # an agent gave it to the user's sandbox uid at their first session
    _upload(_client(user), "new/folder/file.txt", b"hello")
    for made in (home / "new", home / "new" / "folder", home / "new" / "folder" / "file.txt"):
        assert (made.stat().st_uid, made.stat().st_gid) == (60123, 60123), made


@pytest.mark.django_db
def test_a_token_needs_the_files_scope_to_upload(root):
    user = make_user()
    client = APIClient()
    _token, raw = access_token_create(user=user, name="ci", scopes=["read", "sessions"])
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert client.post("/api/v1/files/uploads", {"path": "a", "size": 1}, format="json").status_code == 403
    assert client.get("/api/v1/files").status_code == 200  # reading takes "read"
    _token, raw = access_token_create(user=user, name="files", scopes=["files"])
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert client.post("/api/v1/files/uploads", {"path": "a", "size": 1}, format="json").status_code == 201


@pytest.mark.django_db
def test_with_local_homes_the_portal_says_files_live_on_the_gpu_hosts(settings):
    settings.HOMES_BACKEND = "local"
    client = _client(make_user())
    for answer in (
        client.get("/api/v1/files"),
        client.get("/api/v1/files/download", {"path": "a"}),
        client.post("/api/v1/files/uploads", {"path": "a", "size": 1}, format="json"),
    ):
        assert answer.status_code == 409 and answer.json()["error"]["code"] == "files_unavailable"


@pytest.mark.django_db
def test_the_files_page_lists_a_folder_with_download_links_in_the_users_language(root, client):
    user = make_user()
    _upload(_client(user), "data/train.csv", b"a,b\n1,2\n")
    client.force_login(user)
    page = client.get("/files/", {"path": "data"})
    assert page.status_code == 200
    assert 'href="/api/v1/files/download?path=data/train.csv"' in page.content.decode()
    assert 'data-chunk-bytes="16777216"' in page.content.decode()
    assert "csrftoken" in page.cookies
    assert client.get("/files/", {"path": "nowhere"}).status_code == 404
    user.language = "zh-hans"
    user.save(update_fields=["language"])
    (root / workload_user(user) / "data" / "empty").mkdir()
    assert "这里还没有内容" in client.get("/files/", {"path": "data/empty"}).content.decode()


@pytest.mark.django_db
def test_the_files_page_says_where_files_are_when_homes_are_local(settings, client):
    settings.HOMES_BACKEND = "local"
    client.force_login(make_user())
    page = client.get("/files/")
    assert page.status_code == 200 and "open them in JupyterLab" in page.content.decode()


@pytest.mark.django_db
def test_a_file_that_would_take_the_home_over_its_limit_is_refused_before_a_byte_lands(root, settings):
    from django.utils import timezone

    from provisioner.models import HomeUsage

    settings.HOMES_QUOTA_BYTES = 10 * MIB
    alice = make_user("alice")
    HomeUsage.objects.create(user=alice, bytes=8 * MIB, files=10, measured_at=timezone.now())
    client = _client(alice)
    refused = client.post("/api/v1/files/uploads", {"path": "big.bin", "size": 3 * MIB}, format="json")
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "quota_storage"
    message = refused.json()["error"]["message"].replace("\xa0", " ")
    assert "This file (3.0 MB)" in message and "8.0 MB of at most 10.0 MB" in message
    assert _everything_under(root) <= {".suanli", ".suanli/uploads"}  # nothing began
    assert (
        client.post("/api/v1/files/uploads", {"path": "s.bin", "size": MIB}, format="json").status_code == 201
    )


@pytest.mark.django_db
def test_a_user_has_a_bounded_number_of_uploads_under_way(root, settings):
    settings.HOMES_UPLOADS_OPEN_MAX = 2
    alice, bob = make_user("alice"), make_user("bob")
    alices = _client(alice)
    first = _begin(alices, "a.bin", 4)
    _begin(alices, "b.bin", 4)
    third = alices.post("/api/v1/files/uploads", {"path": "c.bin", "size": 4}, format="json")
    assert third.status_code == 409
    assert third.json()["error"]["code"] == "uploads_open"
    _begin(_client(bob), "a.bin", 4)  # another user's count is their own
    assert _patch(alices, first, 0, b"done").status_code == 200  # a finished upload frees its place
    _begin(alices, "c.bin", 4)


@pytest.mark.django_db
def test_an_abandoned_upload_is_discarded_and_a_late_part_finds_nothing(root, settings):
    from portal.tasks import uploads_expire_task

    settings.HOMES_UPLOAD_ABANDONED_HOURS = 48
    alice = make_user("alice")
    client = _client(alice)
    stale, fresh = _begin(client, "old.bin", 8), _begin(client, "new.bin", 8)
    assert _patch(client, stale, 0, b"half").status_code == 200
    uploads = root / ".suanli" / "uploads"
    long_ago = os.stat(uploads / f"{stale}.part").st_mtime - 49 * 3600
    for name in (f"{stale}.part", f"{stale}.json"):
        os.utime(uploads / name, (long_ago, long_ago))
    assert uploads_expire_task() == 1
    assert sorted(p.name for p in uploads.iterdir()) == [f"{fresh}.json", f"{fresh}.part"]
    assert client.head(f"/api/v1/files/uploads/{stale}").status_code == 404
    assert _patch(client, stale, 4, b"rest").status_code == 404
    assert _patch(client, fresh, 0, b"12345678").status_code == 200  # untouched
    assert (root / workload_user(alice) / "new.bin").read_bytes() == b"12345678"
    assert uploads_expire_task() == 0
