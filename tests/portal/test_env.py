import ast
import subprocess
import sys

import pytest

from portal.env import ConfigError, database_url, env, throttle_rate

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def test_env_parses_typed_values(monkeypatch):
    monkeypatch.setenv("X_BOOL", "off")
    monkeypatch.setenv("X_INT", "42")
    monkeypatch.setenv("X_LIST", "a.example, b.example ,")
    assert env("X_BOOL", True) is False
    assert env("X_INT", 1) == 42
    assert env("X_LIST", ["x"]) == ["a.example", "b.example"]
    assert env("X_MISSING", 7) == 7


@pytest.mark.parametrize(
    ("name", "value", "default", "parse"),
    [
        ("X_BOOL", "maybe", True, None),
        ("X_INT", "4.2", 1, None),
        ("X_DB", "mysql://x/y", "", database_url),
        ("X_RATE", "30", "1/s", throttle_rate),
        ("X_RATE", "0/min", "1/s", throttle_rate),
        ("X_RATE", "30/fortnight", "1/s", throttle_rate),
    ],
)
def test_env_names_the_variable_on_a_bad_value(monkeypatch, name, value, default, parse):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        env(name, default, parse)


def test_env_refuses_a_value_outside_the_choices(monkeypatch):
    monkeypatch.setenv("SITE_CURRENCY", "DOGE")
    with pytest.raises(ConfigError, match="expected one of"):
        env("SITE_CURRENCY", "CNY", choices=("CNY", "USD"))


def _manage_check(**extra):
    env_vars = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", **extra}
    return subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env=env_vars,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_malformed_database_url_gets_one_clear_line():
    result = _manage_check(DATABASE_URL="not-a-url", REDIS_URL="redis://127.0.0.1:1/0")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "suanli: configuration error: DATABASE_URL='not-a-url' is not valid: "
        "expected a URL starting with postgres:// or postgresql://"
    ]


def test_production_refuses_the_default_secret():
    result = _manage_check(DEBUG="0", DATABASE_URL="postgresql://u@db/x", REDIS_URL="redis://127.0.0.1:1/0")
    assert result.returncode == 2
    assert "SECRET_KEY is the development default" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_unknown_setting_value_gets_one_clear_line():
    result = _manage_check(DEBUG="sometimes", DATABASE_URL="postgresql://u@db/x", REDIS_URL="redis://h:1/0")
    assert result.returncode == 2
    assert "DEBUG='sometimes' is not valid" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_signup_setting_gets_one_clear_line():
    urls = {"DATABASE_URL": "postgresql://u@db/x", "REDIS_URL": "redis://h:1/0"}
    result = _manage_check(SIGNUP_EMAIL_VERIFICATION="maybe", **urls)
    assert result.returncode == 2
    assert "SIGNUP_EMAIL_VERIFICATION='maybe' is not valid" in result.stderr
    result = _manage_check(SIGNUP_RATE_PER_HOUR="0", **urls)
    assert result.returncode == 2
    assert "SIGNUP_RATE_PER_HOUR and SIGNUP_VERIFY_DAYS must be at least 1" in result.stderr
    assert "Traceback" not in result.stderr


def _handles_config_error(handler: ast.ExceptHandler) -> bool:
    return isinstance(handler.type, ast.Name) and handler.type.id == "ConfigError"


def test_every_env_call_in_the_settings_is_inside_the_fail_loudly_handling():
    """An ``env()`` outside ``try: … except ConfigError: _fail(…)`` turns a bad value into a traceback."""
    tree = ast.parse((ROOT / "portal" / "settings.py").read_text())
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(_handles_config_error(h) for h in node.handlers):
            for statement in node.body:
                guarded.update(id(inner) for inner in ast.walk(statement))
    unguarded = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "env"
        and id(node) not in guarded
    ]
    assert unguarded == [], f"env() outside the ConfigError handling on lines {unguarded}"


@pytest.mark.parametrize(
    ("name", "value", "extra"),
    [
        ("BEAT_PULSE_SECONDS", "soon", {}),
        ("DATABASE_CONN_MAX_AGE", "forever", {}),
        ("API_LAUNCH_RATE_PER_USER", "lots", {}),
        ("SECURE_HSTS_SECONDS", "1y", {"DEBUG": "0", "SECRET_KEY": "a-production-secret-0123456789"}),
    ],
)
def test_a_bad_value_anywhere_in_the_settings_gets_one_clear_line(name, value, extra):
    urls = {"DATABASE_URL": "postgresql://u@db/x", "REDIS_URL": "redis://h:1/0"}
    result = _manage_check(**{name: value, **extra, **urls})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"suanli: configuration error: {name}={value!r} is not valid"
    )
