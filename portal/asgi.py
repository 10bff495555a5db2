"""The ASGI applications served by uvicorn.

``application``: the whole portal — ``/jupyter/…`` (HTTP and WebSocket) goes to the Jupyter proxy, the
rest to Django (pages, REST API, agent heartbeats). ``proxy_application``: the proxy alone, for running
it as separate processes when traffic grows (same code, same settings, same database).
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")


def _pool_size() -> str:
    """Each web process (uvicorn --workers, WEB_CONCURRENCY) gets its share of WEB_DATABASE_CONNECTIONS,
    at least 4: the web's connections stay within the budget whatever the process count."""
    processes = max(1, int(os.environ.get("WEB_CONCURRENCY") or 1))
    budget = int(os.environ.get("WEB_DATABASE_CONNECTIONS") or 40)
    return str(max(4, budget // processes))


os.environ.setdefault("DATABASE_POOL_SIZE", _pool_size())  # see portal/settings.py

django_application = get_asgi_application()

from portal.health import liveness_asgi  # noqa: E402  (needs Django set up first)
from portal.proxy import PREFIX, JupyterProxy  # noqa: E402
from portal.selectors import jupyter_route_resolve  # noqa: E402

proxy = JupyterProxy(resolver=jupyter_route_resolve, fallback=django_application)
LIVEZ_PATH = "/livez"


async def application(scope, receive, send):
    if scope["type"] == "http" and scope["path"] == LIVEZ_PATH:
        await liveness_asgi(scope, receive, send)  # before Django: no thread, no middleware, no database
    elif scope["type"] == "lifespan" or scope["path"].startswith(PREFIX):
        await proxy(scope, receive, send)
    elif scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 4404})
    else:
        await django_application(scope, receive, send)


application.jupyter_proxy = proxy  # the WebSocket relay asks it (portal/ws_relay.py)
proxy_application = JupyterProxy(resolver=jupyter_route_resolve)
