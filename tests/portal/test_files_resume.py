"""A 1 GiB upload through the real portal (uvicorn, over TCP) that resumes after its connection is cut
in the middle of a part: the client closes its socket half-way through a PATCH, asks the server for the
offset and goes on from there. The file that lands in the home has the size and the SHA-256 of what was
sent. The bytes are pseudo-random, made part by part and hashed as they are accepted, never held whole."""

from __future__ import annotations

import hashlib
import random
import socket
from urllib.parse import urlsplit

import httpx
import pytest

from conftest import subprocess_env
from portal.homes import CHUNK_MAX_BYTES
from portal.services import access_token_create
from provisioner.selectors import workload_user
from tests.provisioner.conftest import make_user
from tests.stack import start_web

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SIZE = 2**30
PARTS = SIZE // CHUNK_MAX_BYTES


def _part(index: int) -> bytes:
    return random.Random(index).randbytes(CHUNK_MAX_BYTES)


def _cut_patch(url: str, path: str, token: str, offset: int, data: bytes) -> None:
    """A PATCH whose connection closes after half its body, as a dropped network does."""
    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=10) as conn:
        head = (
            f"PATCH {path} HTTP/1.1\r\nHost: {where.netloc}\r\nAuthorization: Bearer {token}\r\n"
            f"Upload-Offset: {offset}\r\nContent-Type: application/offset+octet-stream\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        )
        conn.sendall(head.encode() + data[: len(data) // 2])


def test_a_1_gib_upload_resumes_after_the_connection_is_cut_mid_part(transactional_db, tmp_path):
    homes = tmp_path / "homes"
    homes.mkdir()
    user = make_user()
    _token, raw = access_token_create(user=user, name="big", scopes=["files"])
    web = start_web(tmp_path, env=subprocess_env(HOMES_BACKEND="shared", HOMES_SHARED_ROOT=str(homes)))
    try:
        with httpx.Client(base_url=web.url, headers={"Authorization": f"Bearer {raw}"}, timeout=60) as api:
            created = api.post("/api/v1/files/uploads", json={"path": "datasets/big.bin", "size": SIZE})
            assert created.status_code == 201, created.text
            target = f"/api/v1/files/uploads/{created.json()['id']}"
            sent = hashlib.sha256()
            index, cut = 0, False
            while index < PARTS:
                data = _part(index)
                if index == PARTS // 2 and not cut:
                    _cut_patch(web.url, target, raw, index * CHUNK_MAX_BYTES, data)
                    cut = True
                    offset = int(api.head(target).headers["Upload-Offset"])
                    assert offset == index * CHUNK_MAX_BYTES  # the cut part left nothing behind
                    index = offset // CHUNK_MAX_BYTES
                    continue
                answer = api.patch(
                    target,
                    content=data,
                    headers={"Upload-Offset": str(index * CHUNK_MAX_BYTES),
                             "Content-Type": "application/offset+octet-stream"},
                )  # fmt: skip
                assert answer.status_code == 200, answer.text
                sent.update(data)
                index += 1
            assert answer.json()["complete"] is True
        landed = homes / workload_user(user) / "datasets" / "big.bin"
        assert landed.stat().st_size == SIZE
        received = hashlib.sha256()
        with open(landed, "rb") as file:
            while block := file.read(8 * 2**20):
                received.update(block)
        assert received.hexdigest() == sent.hexdigest()
    finally:
        web.stop()
