"""The ASGI applications served by uvicorn.

``application``: the whole portal — ``/jupyter/…`` (HTTP and WebSocket) goes to the Jupyter proxy, the
rest to Django (pages, REST API, agent heartbeats). ``proxy_application``: the proxy alone, for running
it as separate processes when traffic grows (same code, same settings, same database).
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
os.environ.setdefault("DATABASE_POOL_SIZE", "20")  # see portal/settings.py

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


proxy_application = JupyterProxy(resolver=jupyter_route_resolve)
