"""The ASGI applications served by uvicorn.

``application``: the whole portal — ``/jupyter/…`` (HTTP and WebSocket) goes to the Jupyter proxy, the
rest to Django (pages, REST API, agent heartbeats). ``proxy_application``: the proxy alone, for running
it as separate processes when traffic grows (same code, same settings, same database).
"""

import os

import django
from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIHandler
from django.http import FileResponse

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")


def _pool_size() -> str:
    """Each web process (uvicorn --workers, WEB_CONCURRENCY) gets its share of WEB_DATABASE_CONNECTIONS,
    at least 4: the web's connections stay within the budget whatever the process count."""
    processes = max(1, int(os.environ.get("WEB_CONCURRENCY") or 1))
    budget = int(os.environ.get("WEB_DATABASE_CONNECTIONS") or 40)
    return str(max(4, budget // processes))


os.environ.setdefault("DATABASE_POOL_SIZE", _pool_size())  # see portal/settings.py


class SyncChainASGIHandler(ASGIHandler):
    """Django's ASGI handler, with the request's middleware and view run in one thread, in one go.

    Every middleware of the portal is synchronous. Django's own handler builds the chain for async
    mode, so a request goes from its thread to the event loop and back twice: the innermost middleware
    hands the view to the loop, which hands it to the thread again. Under load the event loop is busy
    with the proxy and every socket, and each crossing waits its turn. Here the chain is built for sync
    mode and run whole by one ``sync_to_async`` call (in the request's own thread, as Django's would).
    Reading the body and sending the answer stay in the event loop.
    """

    def __init__(self) -> None:
        super().__init__()
        self.load_middleware(is_async=False)

    async def run_get_response(self, request):
        response = await sync_to_async(self.get_response, thread_sensitive=True)(request)
        response._handler_class = self.__class__
        if isinstance(response, FileResponse):
            response.block_size = self.chunk_size  # as Django's: the server chunks file answers
        return response


django.setup(set_prefix=False)
django_application = SyncChainASGIHandler()

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
