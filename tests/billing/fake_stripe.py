"""localstripe with the one resource it lacks, Checkout Sessions (a small stateful addition for tests):
``python tests/billing/fake_stripe.py --port N``."""

from __future__ import annotations

import secrets
import sys

from aiohttp import web
from localstripe import server

SESSIONS: dict[str, dict] = {}


async def create_session(request: web.Request) -> web.Response:
    data = server.unflatten_data(await request.post())
    item = data["line_items"][0]
    amount = int(item["price_data"]["unit_amount"]) * int(item.get("quantity", 1))
    session_id = "cs_test_" + secrets.token_hex(12)
    session = {
        "id": session_id,
        "object": "checkout.session",
        "mode": data["mode"],
        "amount_total": amount,
        "currency": item["price_data"]["currency"],
        "payment_status": "unpaid",
        "status": "open",
        "success_url": data["success_url"],
        "cancel_url": data["cancel_url"],
        "client_reference_id": data.get("client_reference_id"),
        "metadata": data.get("metadata", {}),
        "url": f"http://{request.host}/checkout/{session_id}",
    }
    SESSIONS[session_id] = session
    return web.json_response(session)


async def get_session(request: web.Request) -> web.Response:
    return web.json_response(SESSIONS[request.match_info["id"]])


server.app.router.add_post("/v1/checkout/sessions", create_session)
server.app.router.add_get("/v1/checkout/sessions/{id}", get_session)

if __name__ == "__main__":
    sys.argv = [sys.argv[0], *sys.argv[1:]]
    server.start()
