"""Settings for every process of Suanli. Production differs from development only by environment.

Every value comes through ``portal.env.env``, which stops the process with one clear line on a bad value.
With no DATABASE_URL and no REDIS_URL, the embedded PostgreSQL and Redis under ``.data/`` are used: their
URLs are computed here (socket paths under the data directory) and nothing is started by importing this
module. The entry points start them (``portal.embedded.ensure_wanted``: ``manage.py``, ``make run``, the
tests).
"""

from __future__ import annotations

import sys
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from django.utils.translation import gettext_lazy as _

from portal import embedded
from portal.env import (
    ConfigError,
    database_url,
    email_url,
    env,
    percents_parts,
    redis_url,
    sso_issuer_url,
    throttle_rate,
    throttle_rate_parts,
)

BASE_DIR = Path(__file__).resolve().parent.parent
DEFAULT_SECRET_KEY = "dev-insecure-change-me"  # production refuses to start with it


def _fail(message: str) -> None:
    sys.stderr.write(f"suanli: configuration error: {message}\n")
    raise SystemExit(2)


try:
    DEBUG = env("DEBUG", True)
    SECRET_KEY = env("SECRET_KEY", DEFAULT_SECRET_KEY)
    ALLOWED_HOSTS = env("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
    CSRF_TRUSTED_ORIGINS = env("CSRF_TRUSTED_ORIGINS", list[str]())
    SITE_CURRENCY = env("SITE_CURRENCY", "CNY", choices=("CNY", "USD", "EUR", "GBP", "JPY", "HKD", "SGD"))
    SITE_URL = env("SITE_URL", "http://127.0.0.1:8000")
    STRIPE_SECRET_KEY = env("STRIPE_SECRET_KEY", "")
    STRIPE_WEBHOOK_SECRET = env("STRIPE_WEBHOOK_SECRET", "")
    STRIPE_API_BASE = env("STRIPE_API_BASE", "")  # a local fake Stripe in tests and demos
    METRICS_TOKEN = env("METRICS_TOKEN", "")  # /metrics: a bearer token, or loopback only when empty
    EMAIL_URL = env("EMAIL_URL", "console://", email_url)
    DEFAULT_FROM_EMAIL = env("DEFAULT_FROM_EMAIL", "Suanli <noreply@localhost>")
    TIME_ZONE = env("TIME_ZONE", "Asia/Shanghai")
    METERING_TICK_SECONDS = env("METERING_TICK_SECONDS", 5.0)
    NODE_LIVENESS_SECONDS = env("NODE_LIVENESS_SECONDS", 30)
    LOG_LEVEL = env("LOG_LEVEL", "INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    _database_url = env("DATABASE_URL", "", database_url)
    _redis_url = env("REDIS_URL", "", redis_url)
    # The ASGI web process runs each request's sync code in a thread of its own, so persistent
    # connections there would be one per thread that ever ran (they exhausted PostgreSQL's 100 under 50
    # users): it takes connections from a pool of this size instead (portal/asgi.py sets it). 0: one
    # persistent connection per thread (Celery workers, beat, manage.py, tests).
    DATABASE_POOL_SIZE = env("DATABASE_POOL_SIZE", 0)
    DATABASE_CONN_MAX_AGE = env("DATABASE_CONN_MAX_AGE", 60)  # seconds; with no pool only
    # PostgreSQL's join_collapse_limit for every connection (a DATABASE_URL ``options`` overrides it).
    # A session read joins its six related rows: at the default (8) the planner searches every order of
    # the seven tables, about 6 ms of PostgreSQL's CPU for a 0.5 ms lookup; at 4 it plans in 1.3 ms.
    DATABASE_JOIN_COLLAPSE_LIMIT = env("DATABASE_JOIN_COLLAPSE_LIMIT", 4)
except ConfigError as exc:
    _fail(str(exc))

if DATABASE_JOIN_COLLAPSE_LIMIT < 1:
    _fail("DATABASE_JOIN_COLLAPSE_LIMIT must be at least 1.")

if not DEBUG and SECRET_KEY == DEFAULT_SECRET_KEY:
    _fail("SECRET_KEY is the development default; set SECRET_KEY to a long random value in production.")

_database_url = _database_url or embedded.urls().database_url
_redis_url = _redis_url or embedded.urls().redis_url


def _database_from_url(
    url: str, *, pool_size: int = 0, conn_max_age: int = 60, join_collapse_limit: int = 8
) -> dict:
    parts = urlsplit(url)
    query: dict = {key: values[-1] for key, values in parse_qs(parts.query).items()}
    query.setdefault("options", f"-c join_collapse_limit={join_collapse_limit}")
    host = query.pop("host", parts.hostname or "")
    if pool_size > 0:
        query["pool"] = {"min_size": 1, "max_size": pool_size, "timeout": 10}
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path.lstrip("/")) or "postgres",
        "USER": unquote(parts.username or "postgres"),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": host,
        "PORT": str(parts.port or ""),
        "CONN_MAX_AGE": 0 if pool_size > 0 else conn_max_age,
        "CONN_HEALTH_CHECKS": True,
        "OPTIONS": query,
        "TEST": {"NAME": f"test_{unquote(parts.path.lstrip('/')) or 'postgres'}"},
    }


def celery_url(url: str) -> str:
    """Kombu spells a Redis unix socket ``redis+socket://``; redis-py spells it ``unix://``."""
    return "redis+socket://" + url.removeprefix("unix://") if url.startswith("unix://") else url


DATABASES = {
    "default": _database_from_url(
        _database_url,
        pool_size=DATABASE_POOL_SIZE,
        conn_max_age=DATABASE_CONN_MAX_AGE,
        join_collapse_limit=DATABASE_JOIN_COLLAPSE_LIMIT,
    )
}
REDIS_URL = _redis_url
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "mozilla_django_oidc",
    "notices",
    "billing",
    "provisioner",
    "portal",
]

MIDDLEWARE = [
    "portal.middleware.ServerTimingMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.locale.LocaleMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "portal.middleware.UserPreferencesMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "portal.security.ContentSecurityPolicyMiddleware",
]

ROOT_URLCONF = "portal.urls"
ASGI_APPLICATION = "portal.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.template.context_processors.i18n",
                "django.template.context_processors.tz",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "portal.context_processors.site",
                "notices.context_processors.bell",
            ],
        },
    },
]

AUTH_USER_MODEL = "portal.User"
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard"

# --- sign-up (portal/services.py: user_signup) ---
try:
    SIGNUP_RATE_PER_HOUR = env("SIGNUP_RATE_PER_HOUR", 50)  # sign-up attempts per client address an hour
    SIGNUP_EMAIL_VERIFICATION = env("SIGNUP_EMAIL_VERIFICATION", False)
    SIGNUP_VERIFY_DAYS = env("SIGNUP_VERIFY_DAYS", 3)
    SIGNUP_INVITE_REQUIRED = env("SIGNUP_INVITE_REQUIRED", False)  # a course's closed portal
except ConfigError as exc:
    _fail(str(exc))
if SIGNUP_RATE_PER_HOUR < 1 or SIGNUP_VERIFY_DAYS < 1:
    _fail("SIGNUP_RATE_PER_HOUR and SIGNUP_VERIFY_DAYS must be at least 1.")

# --- single sign-on with OpenID Connect (portal/oidc.py, mozilla-django-oidc) ---
try:
    OIDC_ISSUER = env("OIDC_ISSUER", "", sso_issuer_url).rstrip("/")  # empty: SSO off
    OIDC_RP_CLIENT_ID = env("OIDC_CLIENT_ID", "")
    OIDC_RP_CLIENT_SECRET = env("OIDC_CLIENT_SECRET", "")
    OIDC_RP_SCOPES = env("OIDC_SCOPES", "openid email profile")
    OIDC_RP_SIGN_ALGO = env("OIDC_SIGN_ALGO", "RS256", choices=("RS256", "RS384", "RS512", "ES256", "ES384"))
    OIDC_USERNAME_CLAIM = env("OIDC_USERNAME_CLAIM", "preferred_username")
    OIDC_EMAIL_CLAIM = env("OIDC_EMAIL_CLAIM", "email")
    OIDC_ALLOWED_EMAIL_DOMAINS = [
        d.lower().lstrip("@") for d in env("OIDC_ALLOWED_EMAIL_DOMAINS", list[str]())
    ]
    OIDC_TEAM_CLAIM = env("OIDC_TEAM_CLAIM", "")  # e.g. "groups": join the teams whose slugs it names
    OIDC_PROVIDER_NAME = env("OIDC_PROVIDER_NAME", "")  # the login button's "Sign in with …"
    LOCAL_PASSWORDS = env("LOCAL_PASSWORDS", True)
except ConfigError as exc:
    _fail(str(exc))
if OIDC_ISSUER and not (OIDC_RP_CLIENT_ID and OIDC_RP_CLIENT_SECRET):
    _fail("OIDC_ISSUER is set: set OIDC_CLIENT_ID and OIDC_CLIENT_SECRET too.")
if not LOCAL_PASSWORDS and not OIDC_ISSUER:
    _fail("LOCAL_PASSWORDS=0 turns off the only way to log in: set OIDC_ISSUER as well.")
AUTHENTICATION_BACKENDS = [
    *(["portal.oidc.SsoBackend"] if OIDC_ISSUER else []),
    # PasswordBackend reads the user with their account; ModelBackend stays for sessions made before it.
    *(
        ["portal.backends.PasswordBackend", "django.contrib.auth.backends.ModelBackend"]
        if LOCAL_PASSWORDS
        else []
    ),
]
OIDC_AUTHENTICATE_CLASS = "portal.oidc.SsoAuthenticateView"
OIDC_CALLBACK_CLASS = "portal.oidc.SsoCallbackView"
OIDC_USE_PKCE = True
OIDC_TIMEOUT = 10
LOGOUT_REDIRECT_URL = "home"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en"
LANGUAGES = [("en", _("English")), ("zh-hans", _("Simplified Chinese"))]
LOCALE_PATHS = [BASE_DIR / "locale"]
USE_I18N = True
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
STATICFILES_DIRS = [BASE_DIR / "static"]

# Fails open (core/cache.py): with Redis down, throttles and caches miss instead of failing a request,
# and short socket timeouts keep a dead Redis to milliseconds of a request, not seconds.
CACHES = {
    "default": {
        "BACKEND": "core.cache.FailOpenRedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": "suanli",
        "OPTIONS": {"socket_connect_timeout": 0.25, "socket_timeout": 0.5},
    }
}

_email = urlsplit(EMAIL_URL)
if _email.scheme == "console":
    EMAIL_BACKEND = "django.core.mail.backends.console.EmailBackend"
elif _email.scheme == "locmem":
    EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
elif _email.scheme == "dummy":
    EMAIL_BACKEND = "django.core.mail.backends.dummy.EmailBackend"
elif _email.scheme == "file":  # file:///var/mail/suanli: one file per message, for tests across processes
    EMAIL_BACKEND = "django.core.mail.backends.filebased.EmailBackend"
    EMAIL_FILE_PATH = unquote(_email.path)
else:
    EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    EMAIL_HOST = _email.hostname or "localhost"
    EMAIL_PORT = _email.port or (465 if _email.scheme == "smtps" else 587)
    EMAIL_HOST_USER = unquote(_email.username or "")
    EMAIL_HOST_PASSWORD = unquote(_email.password or "")
    EMAIL_USE_SSL = _email.scheme == "smtps"
    EMAIL_USE_TLS = _email.scheme == "smtp"

CELERY_BROKER_URL = celery_url(REDIS_URL)
# Nothing reads a task's result: the tasks record what they did in the database. Without a result backend
# a web request that queues a task (a launch, a stop) opens no result subscription in Redis for it.
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TIMEZONE = "UTC"
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_TRANSPORT_OPTIONS = {"socket_connect_timeout": 1.0}  # a dead broker fails a publish fast
try:  # the beat schedule, in seconds
    BEAT_PULSE_SECONDS = env("BEAT_PULSE_SECONDS", 10.0)
    _card_expire = env("CARD_EXPIRE_SECONDS", 300.0)
    _card_remind = env("CARD_REMIND_SECONDS", 3600.0)
    _ledger_reconcile = env("LEDGER_RECONCILE_SECONDS", 600.0)
    _liveness_sweep = env("NODE_LIVENESS_SWEEP_SECONDS", 5.0)
    _queue_dispatch = env("QUEUE_DISPATCH_SECONDS", 10.0)
    _session_limits_sweep = env("SESSION_LIMITS_SWEEP_SECONDS", 15.0)
    _daily_grants = env("DAILY_GRANTS_SECONDS", 3600.0)
    _home_storage_charge = env("HOME_STORAGE_CHARGE_SECONDS", 3600.0)
    _homes_retention = env("HOMES_RETENTION_SECONDS", 3600.0)
except ConfigError as exc:
    _fail(str(exc))
CELERY_BEAT_SCHEDULE = {
    "beat-pulse": {"task": "portal.tasks.beat_pulse", "schedule": BEAT_PULSE_SECONDS},
    "portal-daily-grants": {"task": "portal.tasks.daily_grants_task", "schedule": _daily_grants},
    "portal-uploads-expire": {"task": "portal.tasks.uploads_expire_task", "schedule": _homes_retention},
    # --- billing schedule (owned by billing) ---
    "billing-metering-tick": {"task": "billing.tasks.metering_tick_task", "schedule": METERING_TICK_SECONDS},
    "billing-card-expire": {"task": "billing.tasks.card_expire_task", "schedule": _card_expire},
    "billing-card-remind": {"task": "billing.tasks.card_remind_task", "schedule": _card_remind},
    "billing-ledger-reconcile": {
        "task": "billing.tasks.ledger_reconcile_task",
        "schedule": _ledger_reconcile,
    },
    # the daily home storage charge: hourly, each user once per UTC day (the task is the provisioner's,
    # which reads the homes' sizes; billing prices and posts it: billing/services/storage.py)
    "billing-home-storage-charge": {
        "task": "provisioner.tasks.home_storage_charge_task",
        "schedule": _home_storage_charge,
    },
    # --- provisioner schedule (owned by provisioner) ---
    "provisioner-liveness": {"task": "provisioner.tasks.nodes_liveness_task", "schedule": _liveness_sweep},
    "provisioner-queue-dispatch": {
        "task": "provisioner.tasks.queue_dispatch_task",
        "schedule": _queue_dispatch,
    },
    "provisioner-session-limits": {
        "task": "provisioner.tasks.sessions_enforce_limits_task",
        "schedule": _session_limits_sweep,
    },
    "provisioner-homes-retention": {
        "task": "provisioner.tasks.homes_retention_task",
        "schedule": _homes_retention,
    },
}

# --- billing settings (owned by billing) ---
try:
    BILLING_RUNWAY_WARN_SECONDS = env("BILLING_RUNWAY_WARN_SECONDS", 600)
    BILLING_ADMISSION_MINUTES = env("BILLING_ADMISSION_MINUTES", 10)
    BILLING_POSTING_INTERVAL_SECONDS = env("BILLING_POSTING_INTERVAL_SECONDS", 300)
    BILLING_CPU_CARD_BURN_MICROS_PER_HOUR = env("BILLING_CPU_CARD_BURN_MICROS_PER_HOUR", 20_000)
    TOPUP_MIN_MICROS = env("TOPUP_MIN_MICROS", 1_000_000)
    TOPUP_MAX_MICROS = env("TOPUP_MAX_MICROS", 10_000_000_000)
    STRIPE_WEBHOOK_TOLERANCE_SECONDS = env("STRIPE_WEBHOOK_TOLERANCE_SECONDS", 300)
    CARD_MIN_PART_MICROS = env("CARD_MIN_PART_MICROS", 1_000_000)  # one card-hour
    CARD_REDEEM_RATE_PER_MINUTE = env("CARD_REDEEM_RATE_PER_MINUTE", 10)
    CARD_DAILY_GRANT_MICROS = env("CARD_DAILY_GRANT_MICROS", 0)  # off unless set
    CARD_DAILY_GRANT_ACTIVE_DAYS = env("CARD_DAILY_GRANT_ACTIVE_DAYS", 7)  # who counts as an active user
except ConfigError as exc:
    _fail(str(exc))

# --- provisioner settings (owned by provisioner) ---
try:
    SESSION_START_TIMEOUT_SECONDS = env("SESSION_START_TIMEOUT_SECONDS", 180)
    SESSION_DEFAULT_MAX_HOURS = env("SESSION_DEFAULT_MAX_HOURS", 8.0)
    SESSION_DEFAULT_IDLE_MINUTES = env("SESSION_DEFAULT_IDLE_MINUTES", 60)
    SESSION_STOP_WARN_SECONDS = env("SESSION_STOP_WARN_SECONDS", 300)  # idle, funds, longest time, budget
    # An interruptible session an on-demand launch needs is stopped this long after its warning.
    SESSION_PREEMPT_GRACE_SECONDS = env("SESSION_PREEMPT_GRACE_SECONDS", 120)
    SESSION_IDLE_GPU_PERCENT = env("SESSION_IDLE_GPU_PERCENT", 5)
    # The idle stop's other signs of use (provisioner/services/heartbeats.py): CPU in percent of one
    # core since the previous heartbeat, and whether a browser connected to a kernel counts.
    SESSION_IDLE_CPU_PERCENT = env("SESSION_IDLE_CPU_PERCENT", 5.0)
    SESSION_IDLE_COUNT_CONNECTED = env("SESSION_IDLE_COUNT_CONNECTED", True)
    SESSION_NOTICES_POLL_SECONDS = env("SESSION_NOTICES_POLL_SECONDS", 20)  # JupyterLab asks this often
    QUEUE_MAX_WAIT_SECONDS = env("QUEUE_MAX_WAIT_SECONDS", 3600)
    # The catalog (prices, availability) is cached for everyone and dropped on every change that alters
    # it; this bounds the life of an entry a missed change left stale (provisioner/catalog_cache.py).
    CATALOG_CACHE_SECONDS = env("CATALOG_CACHE_SECONDS", 30)
    # A multi-GPU session waiting this long reserves the node it fits best on (docs/PLACEMENT.md).
    QUEUE_LARGE_RESERVE_SECONDS = env("QUEUE_LARGE_RESERVE_SECONDS", 600)
    QUOTA_DEFAULT_MAX_EIGHTHS = env("QUOTA_DEFAULT_MAX_EIGHTHS", 16)
    QUOTA_DEFAULT_MAX_SESSIONS = env("QUOTA_DEFAULT_MAX_SESSIONS", 4)
    QUOTA_DEFAULT_MAX_SESSION_SECONDS = env("QUOTA_DEFAULT_MAX_SESSION_SECONDS", 86400)
    QUOTA_DEFAULT_MONTHLY_SPEND_CAP_MICROS = env("QUOTA_DEFAULT_MONTHLY_SPEND_CAP_MICROS", 0)  # 0: no cap
    QUOTA_DEFAULT_MONTHLY_CARD_CAP_MICROS = env("QUOTA_DEFAULT_MONTHLY_CARD_CAP_MICROS", 0)  # 0: no cap
    BUDGET_ALERT_PERCENTS = env("BUDGET_ALERT_PERCENTS", (50, 80, 100), percents_parts)
    AGENT_HTTP_TIMEOUT_SECONDS = env("AGENT_HTTP_TIMEOUT_SECONDS", 10.0)
    AGENT_HEARTBEAT_INTERVAL_SECONDS = env("AGENT_HEARTBEAT_INTERVAL_SECONDS", 5)
    DEVICE_SAMPLES_KEPT = env("DEVICE_SAMPLES_KEPT", 120)
    # Where users' homes live (docs/STORAGE.md): ``local`` on each GPU host (no transfer from the
    # portal), or ``shared``, a root every GPU host of the pool and the portal mount.
    HOMES_BACKEND = env("HOMES_BACKEND", "local", choices=("local", "shared"))
    HOMES_SHARED_ROOT = env("HOMES_SHARED_ROOT", "")  # the shared root as mounted on the portal's machine
    HOMES_UPLOAD_MAX_BYTES = env("HOMES_UPLOAD_MAX_BYTES", 100 * 2**30)  # one file
    # Partial uploads live outside the homes, where quotas do not see them: a user has at most this many
    # at once, and one not resumed for HOMES_UPLOAD_ABANDONED_HOURS is discarded (docs/STORAGE.md).
    HOMES_UPLOADS_OPEN_MAX = env("HOMES_UPLOADS_OPEN_MAX", 8)
    HOMES_UPLOAD_ABANDONED_HOURS = env("HOMES_UPLOAD_ABANDONED_HOURS", 48)
    # A user's home, as the agents measure it (docs/STORAGE.md); 0: no limit. A user's quota row overrides.
    HOMES_QUOTA_BYTES = env("HOMES_QUOTA_BYTES", 20 * 2**30)
    HOMES_QUOTA_FILES = env("HOMES_QUOTA_FILES", 500_000)
    # A team's shared folder (docs/STORAGE.md, "Team folders"); 0: no limit. The team account's quota row
    # (max_home_bytes / max_home_files) overrides.
    TEAM_FOLDER_QUOTA_BYTES = env("TEAM_FOLDER_QUOTA_BYTES", 100 * 2**30)
    TEAM_FOLDER_QUOTA_FILES = env("TEAM_FOLDER_QUOTA_FILES", 1_000_000)
    # Retention (docs/STORAGE.md): a home whose user launched no session for HOMES_RETENTION_IDLE_DAYS is
    # removed (0: kept forever); a deactivated or deleted user's HOMES_RETENTION_DELETED_DAYS after. The
    # user is told HOMES_RETENTION_WARN_DAYS before, and again a day before.
    HOMES_RETENTION_IDLE_DAYS = env("HOMES_RETENTION_IDLE_DAYS", 180)
    HOMES_RETENTION_DELETED_DAYS = env("HOMES_RETENTION_DELETED_DAYS", 30)
    HOMES_RETENTION_WARN_DAYS = env("HOMES_RETENTION_WARN_DAYS", 14)
    if min(HOMES_RETENTION_IDLE_DAYS, HOMES_RETENTION_DELETED_DAYS) < 0 or HOMES_RETENTION_WARN_DAYS < 1:
        raise ConfigError("HOMES_RETENTION_*_DAYS are whole days: 0 or more, and the warning at least 1")
    if HOMES_BACKEND == "shared" and not HOMES_SHARED_ROOT.startswith("/"):
        raise ConfigError("HOMES_BACKEND=shared needs HOMES_SHARED_ROOT, an absolute path (the mount)")
except ConfigError as exc:
    _fail(str(exc))

try:  # rates as DRF writes them: a number, a slash, and s, min, hour or day
    _api_rate_per_user = env("API_RATE_PER_USER", "1200/min", throttle_rate)
    _api_rate_per_token = env("API_RATE_PER_TOKEN", "600/min", throttle_rate)
    # (launches, window seconds) per user, for every launch: the API's and the pages' (session_launch)
    SESSION_LAUNCH_RATE = env("API_LAUNCH_RATE_PER_USER", (30, 60), throttle_rate_parts)  # 30/min
except ConfigError as exc:
    _fail(str(exc))
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "portal.auth.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": [
        "rest_framework.permissions.IsAuthenticated",
        "portal.auth.TokenScopePermission",
    ],
    "DEFAULT_THROTTLE_CLASSES": [
        "rest_framework.throttling.UserRateThrottle",
        "portal.auth.TokenRateThrottle",
    ],
    "DEFAULT_THROTTLE_RATES": {
        "user": _api_rate_per_user,
        "anon": "60/min",
        "token": _api_rate_per_token,
    },
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "portal.errors.api_exception_handler",
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 50,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Suanli API",
    "DESCRIPTION": "GPU compute by the hour, billed by the second.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "ENUM_NAME_OVERRIDES": {
        "SessionStateEnum": "provisioner.models.Session.State",
        "NodeStateEnum": "provisioner.models.Node.State",
        "KindEnum": "provisioner.models.Device.Kind",  # the name it had before StopWarning's kind
        "StopWarningKindEnum": "provisioner.models.StopWarning.Kind",
    },
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "portal.errors.schema_add_error_responses",
    ],
}

# Logins live in PostgreSQL, never in Redis: a Redis restart logs nobody out.
SESSION_ENGINE = "portal.logins"  # Django's database store, its read compiled once
SESSION_COOKIE_HTTPONLY = True
CSRF_COOKIE_HTTPONLY = False
X_FRAME_OPTIONS = "SAMEORIGIN"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
if not DEBUG:
    try:
        SESSION_COOKIE_SECURE = env("SESSION_COOKIE_SECURE", True)
        CSRF_COOKIE_SECURE = env("CSRF_COOKIE_SECURE", True)
        SECURE_HSTS_SECONDS = env("SECURE_HSTS_SECONDS", 31536000)
        SECURE_SSL_REDIRECT = env("SECURE_SSL_REDIRECT", False)
    except ConfigError as exc:
        _fail(str(exc))
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        "django.db.backends": {"level": "INFO"},
        "pgserver": {"level": "WARNING"},
        "httpx": {"level": "WARNING"},
        "httpcore": {"level": "WARNING"},
    },
}
