"""Deleting from one's home through the portal (issue #18): the API and the files page, attacked from
where a tenant stands (links planted in their own home, ``..``, another user's files), and the quota
refusal it lifts: a user over their home limit deletes here and may launch at once, no session needed.
A real folder stands in for the shared mount; the portal runs as root here, as it must on one."""

from __future__ import annotations

import os
import stat
import subprocess
from datetime import timedelta
from urllib.parse import urlencode

import pytest
from django.template.defaultfilters import filesizeformat
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from core.errors import QuotaExceeded
from portal.services import access_token_create
from provisioner.models import HomeUsage
from provisioner.quotas import home_admit, quota_set
from provisioner.selectors import workload_user
from tests.provisioner.conftest import make_user

pytestmark = pytest.mark.django_db


@pytest.fixture
def root(settings, tmp_path):
    settings.HOMES_BACKEND = "shared"
    settings.HOMES_SHARED_ROOT = str(tmp_path / "homes")
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    (tmp_path / "homes").mkdir()
    return tmp_path / "homes"


def _client(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def _home(root, user):
    home = root / workload_user(user)
    home.mkdir(mode=0o700, exist_ok=True)
    return home


def _delete(client, path: str):
    return client.delete(f"/api/v1/files?{_query(path)}")


def _query(path: str) -> str:
    return urlencode({"path": path})


def _counted(*paths) -> tuple[int, int]:
    """Bytes and entries under (and including) ``paths``, as the agent's meter counts them."""
    total_bytes = entries = 0
    for top in paths:
        found = [str(top)]
        if top.is_dir() and not top.is_symlink():
            found += [os.path.join(d, n) for d, ds, fs in os.walk(top) for n in ds + fs]
        for path in found:
            total_bytes += os.lstat(path).st_blocks * 512
            entries += 1
    return total_bytes, entries


def _everything_under(folder) -> set[str]:
    return {os.path.relpath(os.path.join(d, n), folder) for d, ds, fs in os.walk(folder) for n in ds + fs}


def _measured(user, *, bytes_: int, files: int) -> HomeUsage:
    return HomeUsage.objects.create(
        user=user, bytes=bytes_, files=files, measured_at=timezone.now() - timedelta(seconds=30)
    )


def test_deleting_a_file_answers_what_it_freed_and_lowers_the_measured_home(root):
    user = make_user()
    home = _home(root, user)
    (home / "data").mkdir()
    (home / "data" / "big.bin").write_bytes(os.urandom(300_000))
    (home / "data" / "keep.txt").write_text("keep")
    freed, _entries = _counted(home / "data" / "big.bin")
    assert freed >= 300_000
    usage = _measured(user, bytes_=10_000_000, files=50)

    answer = _delete(_client(user), "data//./big.bin")
    assert answer.status_code == 200, answer.content
    assert answer.json() == {"deleted": {"path": "data/big.bin", "bytes": freed, "entries": 1}}
    assert _everything_under(home) == {"data", "data/keep.txt"}
    lowered = HomeUsage.objects.get(user=user)
    assert (lowered.bytes, lowered.files) == (10_000_000 - freed, 49)
    assert lowered.measured_at == usage.measured_at  # the agent's next measurement still replaces it


def test_deleting_a_folder_takes_everything_in_it_and_counts_every_entry(root):
    user = make_user()
    home = _home(root, user)
    tree = home / "runs"
    (tree / "a" / "b" / "c").mkdir(parents=True)
    (tree / "empty").mkdir()
    for i, folder in enumerate((tree, tree / "a", tree / "a" / "b", tree / "a" / "b" / "c")):
        (folder / f"f{i}.bin").write_bytes(os.urandom(5000 * (i + 1)))
    os.link(tree / "f0.bin", tree / "a" / "hard.bin")  # both links go: counted once, as the agent does
    os.mkfifo(tree / "a" / "pipe")
    (tree / "a" / "to-f0").symlink_to(tree / "f0.bin")
    (home / "other.txt").write_text("stays")
    expected_bytes, expected_entries = _counted(tree)
    hard = os.lstat(tree / "f0.bin").st_blocks * 512
    _measured(user, bytes_=expected_bytes, files=expected_entries + 1)

    answer = _delete(_client(user), "runs/")
    assert answer.status_code == 200, answer.content
    deleted = answer.json()["deleted"]
    # the hard-linked file: the first link to go leaves the inode held by the other, so it counts once
    assert deleted == {"path": "runs", "bytes": expected_bytes - hard, "entries": expected_entries - 1}
    assert _everything_under(home) == {"other.txt"}
    assert (HomeUsage.objects.get(user=user).bytes, HomeUsage.objects.get(user=user).files) == (hard, 2)


def test_a_link_is_deleted_itself_and_its_target_survives(root, tmp_path):
    alice, bob = make_user("alice"), make_user("bob")
    home, bob_home = _home(root, alice), _home(root, bob)
    (bob_home / "secret.txt").write_text("bob's work")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "file.txt").write_text("not alice's")
    (home / "bobs").symlink_to(bob_home)
    (home / "out").symlink_to(outside)
    (home / "file-link").symlink_to(outside / "file.txt")
    client = _client(alice)
    for name in ("bobs", "out", "file-link", "bobs/"):
        answer = _delete(client, name)
        if name == "bobs/":  # already gone
            assert answer.status_code == 404
            continue
        assert answer.status_code == 200, (name, answer.content)
        assert answer.json()["deleted"]["entries"] == 1
    assert _everything_under(home) == set()
    assert (bob_home / "secret.txt").read_text() == "bob's work"
    assert (outside / "file.txt").read_text() == "not alice's"


def test_links_planted_inside_a_folder_are_unlinked_and_never_followed(root, tmp_path):
    alice, bob = make_user("alice"), make_user("bob")
    home, bob_home = _home(root, alice), _home(root, bob)
    (bob_home / "data").mkdir()
    (bob_home / "data" / "secret.txt").write_text("bob's work")
    outside = tmp_path / "outside.txt"
    outside.write_text("not alice's")
    (home / "trap" / "deeper").mkdir(parents=True)
    (home / "trap" / "bobs").symlink_to(bob_home)
    (home / "trap" / "deeper" / "bobs-data").symlink_to(bob_home / "data")
    (home / "trap" / "deeper" / "outside.txt").symlink_to(outside)
    (home / "trap" / "up").symlink_to("..")
    # no link to / or /etc here: were the code broken, this test (as root) would delete through it
    (home / "trap" / "elsewhere").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "kept.txt").write_text("outside every home")
    (home / "stays.txt").write_text("alice's")
    bob_before = _everything_under(bob_home)

    answer = _delete(_client(alice), "trap")
    assert answer.status_code == 200, answer.content
    assert answer.json()["deleted"]["entries"] == 7
    assert _everything_under(home) == {"stays.txt"}
    assert _everything_under(bob_home) == bob_before
    assert (bob_home / "data" / "secret.txt").read_text() == "bob's work"
    assert outside.read_text() == "not alice's"
    assert (tmp_path / "elsewhere" / "kept.txt").read_text() == "outside every home"


def test_a_tree_deeper_than_pythons_recursion_limit_is_deleted(root):
    user = make_user()
    home = _home(root, user)
    fd = os.open(home, os.O_RDONLY | os.O_DIRECTORY)
    os.mkdir("deep", dir_fd=fd)
    for _ in range(1100):  # relative to a descriptor: the whole path is longer than PATH_MAX allows
        child = os.open("deep", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
        os.mkdir("deep", dir_fd=fd)
    os.close(fd)
    answer = _delete(_client(user), "deep")
    assert answer.status_code == 200, answer.content
    assert answer.json()["deleted"]["entries"] == 1101
    assert os.listdir(home) == []


@pytest.mark.parametrize(
    "path", ["", ".", "/", "./", "..", "../x", "a/../../x", "/suanli-no-such/x", "a/\x00b", "x" * 1100]
)
def test_the_home_itself_and_paths_outside_it_are_refused_and_nothing_is_deleted(root, tmp_path, path):
    user = make_user()
    home = _home(root, user)
    (home / "a").mkdir()
    (home / "a" / "x").write_text("kept")
    _measured(user, bytes_=1000, files=2)
    before = _everything_under(tmp_path)
    answer = _delete(_client(user), path)
    assert answer.status_code == 400, answer.content
    assert answer.json()["error"]["code"] == "invalid"
    assert _everything_under(tmp_path) == before
    assert (HomeUsage.objects.get(user=user).bytes, HomeUsage.objects.get(user=user).files) == (1000, 2)


def test_a_path_through_a_planted_link_or_to_nothing_is_404_and_the_target_is_intact(root, tmp_path):
    alice, bob = make_user("alice"), make_user("bob")
    home, bob_home = _home(root, alice), _home(root, bob)
    (bob_home / "secret.txt").write_text("bob's work")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "file.txt").write_text("not alice's")
    (home / "bobs").symlink_to(bob_home)
    (home / "out").symlink_to(outside)
    (home / "real").mkdir()
    (home / "real" / "deeper").symlink_to(bob_home)
    (home / "plain.txt").write_text("a file, not a folder")
    client = _client(alice)
    for path in ("bobs/secret.txt", "out/file.txt", "real/deeper/secret.txt", "missing.txt",
                 "real/missing", "plain.txt/under"):  # fmt: skip
        answer = _delete(client, path)
        assert answer.status_code == 404, (path, answer.content)
        assert answer.json()["error"]["code"] == "not_found"
    assert (bob_home / "secret.txt").read_text() == "bob's work"
    assert (outside / "file.txt").read_text() == "not alice's"
    assert _everything_under(home) == {"bobs", "out", "real", "real/deeper", "plain.txt"}


def test_another_users_files_are_out_of_reach(root):
    alice, mallory = make_user("alice"), make_user("mallory")
    alice_home = _home(root, alice)
    (alice_home / "notes.txt").write_text("alice's notes")
    thief = _client(mallory)
    assert _delete(thief, "notes.txt").status_code == 404  # her own home has none
    assert _delete(thief, f"../{workload_user(alice)}/notes.txt").status_code == 400
    assert _delete(thief, f"/{workload_user(alice)}/notes.txt").status_code == 400
    assert (alice_home / "notes.txt").read_text() == "alice's notes"


def test_a_token_needs_the_files_scope_to_delete(root):
    user = make_user()
    home = _home(root, user)
    (home / "a.txt").write_text("a")
    client = APIClient()
    _token, raw = access_token_create(user=user, name="ci", scopes=["read", "sessions"])
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    refused = _delete(client, "a.txt")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"
    assert (home / "a.txt").exists()
    _token, raw = access_token_create(user=user, name="files", scopes=["files"])
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert _delete(client, "a.txt").status_code == 200
    assert not (home / "a.txt").exists()


def test_a_browser_session_needs_the_csrf_token_to_delete(root):
    user = make_user()
    home = _home(root, user)
    (home / "a.txt").write_text("a")
    browser = APIClient(enforce_csrf_checks=True)
    browser.force_login(user)
    assert browser.get("/files/").status_code == 200  # sets the csrftoken cookie
    refused = _delete(browser, "a.txt")
    assert refused.status_code == 403, refused.content
    assert (home / "a.txt").exists()
    token = browser.cookies["csrftoken"].value
    answer = browser.delete(f"/api/v1/files?{_query('a.txt')}", HTTP_X_CSRFTOKEN=token)
    assert answer.status_code == 200, answer.content
    assert not (home / "a.txt").exists()


def test_a_user_over_their_home_limit_deletes_files_and_may_launch_at_once(root):
    user = make_user()
    home = _home(root, user)
    (home / "checkpoints").mkdir()
    for i in range(3):
        (home / "checkpoints" / f"step-{i}.pt").write_bytes(os.urandom(100_000))
    (home / "results.csv").write_text("keep me")
    freed, entries = _counted(home / "checkpoints")
    quota_set(user=user, limits={"max_home_bytes": 1_000_000})
    _measured(user, bytes_=1_000_000 + freed // 2, files=entries + 5)
    with pytest.raises(QuotaExceeded) as refused:
        home_admit(user=user)  # what session_launch's admission runs for the home
    assert refused.value.code == "quota_storage"

    assert _delete(_client(user), "checkpoints").json()["deleted"] == {
        "path": "checkpoints",
        "bytes": freed,
        "entries": entries,
    }
    home_admit(user=user)  # no longer refused
    usage = HomeUsage.objects.get(user=user)
    assert (usage.bytes, usage.files) == (1_000_000 - freed + freed // 2, 5)
    assert (home / "results.csv").read_text() == "keep me"


def test_the_measured_home_never_goes_below_zero_and_an_unmeasured_one_stays_unmeasured(root):
    measured, fresh = make_user(), make_user()
    for user in (measured, fresh):
        (_home(root, user) / "big.bin").write_bytes(os.urandom(200_000))
    _measured(measured, bytes_=4096, files=0)  # the agent measured before the file arrived
    assert _delete(_client(measured), "big.bin").status_code == 200
    usage = HomeUsage.objects.get(user=measured)
    assert (usage.bytes, usage.files) == (0, 0)
    assert _delete(_client(fresh), "big.bin").status_code == 200
    assert not HomeUsage.objects.filter(user=fresh).exists()


def test_with_local_homes_delete_answers_files_unavailable(settings):
    settings.HOMES_BACKEND = "local"
    user = make_user()
    _measured(user, bytes_=1000, files=2)
    answer = _delete(_client(user), "a.txt")
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "files_unavailable"
    assert HomeUsage.objects.get(user=user).bytes == 1000


def test_the_files_page_deletes_a_row_and_says_what_it_freed(root):
    user = make_user()
    home = _home(root, user)
    (home / "data" / "old").mkdir(parents=True)
    (home / "data" / "old" / "x.bin").write_bytes(os.urandom(10_000))
    (home / "data" / "train.csv").write_bytes(os.urandom(50_000))
    size = filesizeformat(_counted(home / "data" / "train.csv")[0])
    browser = Client()
    browser.force_login(user)
    page = browser.get("/files/", {"path": "data"}).content.decode()
    assert 'action="/files/delete"' in page and 'name="csrfmiddlewaretoken"' in page
    assert 'name="path" value="data/train.csv"' in page
    assert 'data-confirm="Delete the folder old and everything in it?"' in page
    assert 'data-confirm="Delete train.csv?"' in page

    answer = browser.post("/files/delete", {"path": "data/train.csv"})
    assert answer.status_code == 302 and answer["Location"] == "/files/?path=data"
    shown = browser.get(answer["Location"]).content.decode()
    assert f"Deleted train.csv ({size})." in shown
    assert not (home / "data" / "train.csv").exists()

    answer = browser.post("/files/delete", {"path": "data/old"}, follow=True)
    assert answer.redirect_chain == [("/files/?path=data", 302)]
    assert "Deleted old (" in answer.content.decode()
    assert _everything_under(home) == {"data"}

    answer = browser.post("/files/delete", {"path": "data"}, follow=True)
    assert answer.redirect_chain == [("/files/", 302)]
    assert os.listdir(home) == []


def test_the_files_page_says_why_nothing_was_deleted_and_needs_a_post_with_csrf(root):
    user = make_user()
    home = _home(root, user)
    (home / "a.txt").write_text("a")
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(user)
    assert browser.get("/files/delete", {"path": "a.txt"}).status_code == 405
    assert browser.post("/files/delete", {"path": "a.txt"}).status_code == 403  # no CSRF token
    assert (home / "a.txt").exists()
    browser.get("/files/")
    token = browser.cookies["csrftoken"].value
    answer = browser.post("/files/delete", {"path": "gone.txt", "csrfmiddlewaretoken": token}, follow=True)
    assert "There is no such file or folder in your home." in answer.content.decode()
    answer = browser.post("/files/delete", {"path": "../x", "csrfmiddlewaretoken": token}, follow=True)
    assert answer.redirect_chain == [("/files/", 302)]
    assert "Name a path inside your home" in answer.content.decode()
    assert (home / "a.txt").exists()


def test_an_over_quota_user_is_told_on_the_files_page_that_deleting_here_lets_them_launch(root):
    user = make_user()
    _home(root, user)
    quota_set(user=user, limits={"max_home_bytes": 1000})
    browser = Client()
    browser.force_login(user)
    line = 'data-testid="home-over-delete"'
    assert line not in browser.get("/files/").content.decode()  # never measured
    _measured(user, bytes_=2000, files=1)
    assert line in browser.get("/files/").content.decode()
    user.language = "zh-hans"
    user.save(update_fields=["language"])
    assert "在这里删除文件" in browser.get("/files/").content.decode()


def test_a_fifo_and_a_file_owned_by_another_uid_are_deleted_as_entries_of_the_home(root):
    user = make_user()
    home = _home(root, user)
    os.mkfifo(home / "pipe")
    (home / "theirs.txt").write_text("x")
    os.chown(home / "theirs.txt", 60123, 60123)  # a session's uid: still the home's own entry
    client = _client(user)
    for name in ("pipe", "theirs.txt"):
        assert _delete(client, name).status_code == 200, name
    assert os.listdir(home) == []
    assert stat.S_ISDIR(os.lstat(home).st_mode)


def test_a_delete_stopped_by_a_protected_file_says_so_and_counts_what_went(root):
    user = make_user()
    home = _home(root, user)
    (home / "mixed" / "sub").mkdir(parents=True)
    (home / "mixed" / "sub" / "locked.bin").write_bytes(os.urandom(20_000))
    for i in range(3):
        (home / "mixed" / f"loose-{i}.bin").write_bytes(os.urandom(20_000))
    all_bytes, all_entries = _counted(home / "mixed")
    locked = home / "mixed" / "sub" / "locked.bin"
    if subprocess.run(["chattr", "+i", str(locked)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here")
    try:
        _measured(user, bytes_=all_bytes + 1000, files=all_entries + 1)
        answer = _delete(_client(user), "mixed")
        assert answer.status_code == 409, answer.content
        error = answer.json()["error"]
        assert error["code"] == "delete_incomplete"
        assert locked.read_bytes() and (home / "mixed" / "sub").is_dir()
        left_bytes, left_entries = _counted(home / "mixed")
        assert error["fields"] == {
            "path": "mixed",
            "bytes": str(all_bytes - left_bytes),
            "entries": str(all_entries - left_entries),
        }
        usage = HomeUsage.objects.get(user=user)  # what went is counted; what is left stays counted
        assert (usage.bytes, usage.files) == (left_bytes + 1000, left_entries + 1)
    finally:
        subprocess.run(["chattr", "-i", str(locked)], check=True)
