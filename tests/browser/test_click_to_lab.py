"""Click to a usable JupyterLab, measured in Chromium against the real product (portal, Celery, an agent
running each session in its bubblewrap sandbox): from the click on Launch to "Open JupyterLab" on the
session page, and on to the welcome notebook's kernel reading Idle in JupyterLab's status bar. The user
clicks "Open JupyterLab" as soon as it shows.

Three launches in a row; the figures and their medians are printed and written to
test-artifacts/click-to-lab.json, beside the floor of this machine: JupyterLab alone (the same Python,
no portal, agent or sandbox, its kernel started as the page opens) opened in the same Chromium, to its kernel's Idle. Like the benchmarks, this never fails on a time (the target is a
median of at most 5 s to an idle kernel on an idle machine); it fails when a step does not happen.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agents.runtimes.base import JUPYTER_LAB_MAIN
from provisioner.models import Session
from tests.browser.steps import (
    DESKTOP,
    a100_offer,
    launch_and_wait_running,
    open_launch_page,
    product_stack,
    sign_up_with_code,
    stack_env,
    wait_for_free_gpu,
)
from tests.stack import agent_get, free_port, wait_for

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
ROUNDS = 3


@pytest.fixture
def stack(tmp_path):
    with product_stack(tmp_path, env=stack_env()) as started:
        yield {**started, "home": tmp_path / "floor-home"}


def test_click_to_an_idle_kernel(browser, stack, artifacts_dir):
    code = a100_offer()
    wait_for_free_gpu(stack)
    context = browser.new_context(base_url=stack["web"].url, viewport=DESKTOP)
    context.set_default_timeout(30_000)
    page = context.new_page()
    sign_up_with_code(page, code, "lin")

    rounds = []
    for _ in range(ROUNDS):
        wait_for_free_gpu(stack)
        open_launch_page(page)
        clicked = time.monotonic()
        session = launch_and_wait_running(page, stack)
        to_open = time.monotonic() - clicked
        with context.expect_page() as opened:
            page.get_by_test_id("open-jupyter").click()
        lab = opened.value
        # The welcome notebook opens on its kernel, which the agent started while the page loaded.
        lab.get_by_text(re.compile(r"\| Idle")).first.wait_for(timeout=90_000)
        to_idle = time.monotonic() - clicked
        assert "Welcome.ipynb" in lab.title() or lab.get_by_text("Welcome.ipynb").count()
        rounds.append({"to_open_jupyterlab_s": round(to_open, 2), "to_idle_kernel_s": round(to_idle, 2)})
        lab.close()
        page.click("form[action$='/stop'] button[type=submit]")
        wait_for(
            lambda session=session: Session.objects.get(pk=session.pk).state == Session.State.STOPPED,
            timeout=60,
            what="the session to stop",
        )
        wait_for(
            lambda: agent_get(stack["agent"], "/v1/health").json()["workloads"] == 0,
            timeout=30,
            what="the workload to go from the agent",
        )
    context.close()

    alone = jupyterlab_alone(browser, stack["home"])
    medians = {key: round(statistics.median(r[key] for r in rounds), 2) for key in rounds[0]}
    medians["jupyterlab_alone_s"] = round(statistics.median(alone), 2)
    (artifacts_dir / "click-to-lab.json").write_text(
        json.dumps({"rounds": rounds, "jupyterlab_alone_s": alone, "median": medians}, indent=1)
    )
    print(
        f"\nclick to 'Open JupyterLab': median {medians['to_open_jupyterlab_s']} s; "
        f"to an idle kernel: median {medians['to_idle_kernel_s']} s (target <= 5 s); rounds {rounds}"
        f"\nfloor, JupyterLab alone to an idle kernel in the same Chromium: median "
        f"{medians['jupyterlab_alone_s']} s; rounds {alone}"
    )


def jupyterlab_alone(browser, home: Path, rounds: int = ROUNDS) -> list[float]:
    """Seconds from opening a notebook in JupyterLab to its kernel reading Idle, with nothing between:
    JupyterLab as the agent starts it but on a local port, its kernel started as the page is opened
    (as the agent's warm-up starts it when the session runs)."""
    port, token = free_port(), "floor-token"
    home.mkdir(exist_ok=True)
    lab = subprocess.Popen(
        [sys.executable, "-c", JUPYTER_LAB_MAIN, "--no-browser", f"--port={port}", f"--ServerApp.root_dir={home}",
         f"--IdentityProvider.token={token}", "--ServerApp.allow_root=True"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}/api", headers={"Authorization": f"token {token}"})
    seconds = []
    try:
        wait_for(lambda: _answers(api), timeout=60, what="JupyterLab alone")
        notebook = {
            "cells": [],
            "metadata": {"kernelspec": {"name": "python3"}},
            "nbformat": 4,
            "nbformat_minor": 5,
        }
        api.put("/contents/Floor.ipynb", json={"type": "notebook", "content": notebook}).raise_for_status()
        for _ in range(rounds):
            kernel = {"name": "python3"}
            body = {"path": "Floor.ipynb", "name": "Floor.ipynb", "type": "notebook", "kernel": kernel}
            api.post("/sessions", json=body).raise_for_status()  # as the agent's warm-up does
            context = browser.new_context(viewport=DESKTOP)
            page = context.new_page()
            opened = time.monotonic()
            page.goto(f"http://127.0.0.1:{port}/lab/tree/Floor.ipynb?token={token}")
            page.get_by_text(re.compile(r"\| Idle")).first.wait_for(timeout=90_000)
            seconds.append(round(time.monotonic() - opened, 2))
            context.close()
    finally:
        api.close()
        os.killpg(lab.pid, signal.SIGKILL)  # JupyterLab and its kernels: nothing here to keep
        lab.wait(timeout=30)
    return seconds


def _answers(api: httpx.Client) -> bool:
    try:
        return api.get("/status").status_code == 200
    except httpx.TransportError:
        return False
