"""Secrets the portal must read back (node tokens, Jupyter tokens), sealed with a key from SECRET_KEY."""

from __future__ import annotations

import base64
import hashlib
import secrets
from functools import lru_cache

from cryptography.fernet import Fernet
from django.conf import settings


@lru_cache(maxsize=4)
def _fernet(secret_key: str) -> Fernet:
    digest = hashlib.sha256(f"suanli-provisioner-seal:{secret_key}".encode()).digest()
    return Fernet(base64.urlsafe_b64encode(digest))


def seal(plaintext: str) -> str:
    return _fernet(settings.SECRET_KEY).encrypt(plaintext.encode()).decode()


def unseal(sealed: str) -> str:
    return _fernet(settings.SECRET_KEY).decrypt(sealed.encode()).decode()


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return secrets.token_urlsafe(32)
