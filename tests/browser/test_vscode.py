"""VS Code in the browser, in Chromium against the real product: a student picks the VS Code environment,
launches, clicks "Open VS Code" on the session page, and code-server's workbench (sandboxed by the node's
agent, reached through the portal's proxy and the agent's gateway) opens on their home folder. Skipped
where agents/editors/install.sh has not installed code-server."""

from __future__ import annotations

import sys

import pytest

from agents.runtimes.base import CODE_SERVER_DIR, code_server_installed
from provisioner.models import Environment, Node
from provisioner.selectors import workload_user
from tests.browser.steps import (
    DESKTOP,
    a100_offer,
    launch_and_wait_running,
    local_only,
    open_launch_page,
    product_stack,
    sign_up_with_code,
    stack_env,
    wait_for_free_gpu,
)
from tests.stack import wait_for

pytestmark = [
    pytest.mark.browser,
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not code_server_installed(CODE_SERVER_DIR),
        reason=f"code-server is not installed at {CODE_SERVER_DIR} (run agents/editors/install.sh)",
    ),
]
VSCODE_ENV = "VS Code"


@pytest.fixture
def stack(tmp_path):
    with product_stack(tmp_path, env=stack_env()) as started:
        yield {**started, "agent_state": tmp_path / "agent-node-e2e"}


def test_a_student_opens_vscode_through_the_portal(browser, stack, artifacts_dir):
    code = a100_offer()
    Environment.objects.update_or_create(
        name=VSCODE_ENV, defaults={"python": sys.executable, "interface": Environment.Interface.VSCODE}
    )
    wait_for_free_gpu(stack)
    wait_for(
        lambda: "vscode" in Node.objects.get(pk=stack["node"].pk).interfaces,
        timeout=30,
        what="the agent to report code-server",
    )
    context = browser.new_context(base_url=stack["web"].url, viewport=DESKTOP)
    local_only(context)  # the workbench asks nothing of the internet that the test lets through
    context.set_default_timeout(30_000)
    page = context.new_page()
    sign_up_with_code(page, code, "mei")

    open_launch_page(page)
    page.select_option("#environment", VSCODE_ENV)
    session = launch_and_wait_running(page, stack)
    session = type(session).objects.select_related("owner").get(pk=session.pk)
    # a file in the user's home (on the node: <state>/homes/<user>), which the explorer must list
    home_on_node = stack["agent_state"] / "homes" / workload_user(session.owner)
    (home_on_node / "hello-from-home.txt").write_text("hello")
    opener = page.get_by_test_id("open-jupyter")
    assert opener.inner_text() == "Open VS Code"
    with context.expect_page() as opened:
        opener.click()
    editor = opened.value
    editor.locator(".monaco-workbench").wait_for(timeout=90_000)
    # the workbench reads the home through its server (the remote connection, a WebSocket through both
    # proxies): the explorer lists the file
    editor.locator(".explorer-folders-view").get_by_text("hello-from-home.txt").wait_for(timeout=60_000)
    assert editor.url.startswith(f"{stack['web'].url}/jupyter/{session.id}/")
    editor.screenshot(path=str(artifacts_dir / "vscode-workbench.png"))
    editor.close()
