"""The JupyterLab extensions every workload loads (agents/labextensions): a prebuilt extension as
JupyterLab's own discovery and loader take it, and, in a real sandbox, a folder the tenant can read but
never change."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess

import httpx
import pytest
from jupyterlab_server.config import get_federated_extensions

from agents.runtimes.base import LABEXTENSIONS_DIR, LABEXTENSIONS_IN_WORKLOAD
from tests.agents.conftest import NODE_TOKEN, run_in_kernel, workload_spec

NAME = "suanli-notices"
SESSION = "0f5e2c1a-3b4d-4e6f-8a9b-0c1d2e3f4a5b"


def _extension() -> dict:
    return get_federated_extensions([str(LABEXTENSIONS_DIR)])[NAME]


def test_jupyterlab_finds_the_notices_extension_and_its_script_is_named_by_its_content():
    extension = _extension()
    build = extension["jupyterlab"]["_build"]
    assert build["extension"] == "./extension"
    script = LABEXTENSIONS_DIR / NAME / build["load"]
    # JupyterLab serves extension files as immutable: a changed script must change its name.
    digest = hashlib.sha256(script.read_bytes()).hexdigest()[:16]
    assert script.name == f"remoteEntry.{digest}.js", f"rename it remoteEntry.{digest}.js (and its load)"


# What JupyterLab's bootstrap.js and index.js do with a federated extension: load the script, init the
# container, get "./extension", call the factory, take ``default`` of an ES module; then activate.
LOADER = """
const calls = [];
global.window = global;
global.document = {
  cookie: "csrftoken=abc",
  getElementById: (id) => id === "jupyter-config-data"
    ? {textContent: JSON.stringify({baseUrl: process.argv[3]})} : null,
};
global.fetch = (url, options) => { calls.push({url, credentials: options.credentials});
  return new Promise(() => {}); };
require(process.argv[2]);
(async () => {
  const container = window._JUPYTERLAB[process.argv[4]];
  await container.init({});
  const factory = await container.get("./extension");
  const module = factory();
  const plugins = module.hasOwnProperty("__esModule") ? module.default : module;
  for (const plugin of plugins) if (plugin.autoStart) plugin.activate({});
  let missing = "";
  await container.get("./nothing").catch((error) => { missing = String(error); });
  console.log(JSON.stringify({ids: plugins.map((p) => p.id), calls, missing}));
})();
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="no node to run the script outside a browser")
@pytest.mark.parametrize(
    ("base_url", "asks"),
    [
        (f"/jupyter/{SESSION}/", [f"/api/v1/sessions/{SESSION}/notices"]),
        ("/", []),  # a lab that is not behind the portal asks nothing
    ],
)
def test_the_script_registers_the_container_jupyterlab_loads(tmp_path, base_url, asks):
    loader = tmp_path / "loader.js"
    loader.write_text(LOADER)
    script = LABEXTENSIONS_DIR / NAME / _extension()["jupyterlab"]["_build"]["load"]
    ran = subprocess.run(
        ["node", str(loader), str(script), base_url, NAME], capture_output=True, text=True, timeout=30
    )
    assert ran.returncode == 0, ran.stderr
    result = json.loads(ran.stdout)
    assert result["ids"] == [f"{NAME}:plugin"]
    assert [call["url"] for call in result["calls"]] == asks
    assert all(call["credentials"] == "same-origin" for call in result["calls"])
    assert "./nothing" in result["missing"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_in_the_sandbox_the_extensions_are_served_but_read_only(start_agent, tmp_path):
    agent = start_agent(tmp_path / "state", "--sandbox", "bwrap")
    spec = workload_spec("lab-ro", None)
    assert agent.put_workload(spec).status_code == 201
    agent.wait_state("lab-ro", ("running",))

    # JupyterLab lists the extension in its page and serves its script from the read-only folder.
    lab = f"{agent.url}{spec['base_url']}lab"
    headers = {"Authorization": f"Bearer {NODE_TOKEN}"}
    page = httpx.get(lab, headers=headers, timeout=30)
    assert page.status_code == 200 and f'"name": "{NAME}"' in page.text.replace('\\"', '"')
    load = _extension()["jupyterlab"]["_build"]["load"]
    script = httpx.get(f"{lab}/extensions/{NAME}/{load}", headers=headers, timeout=30)
    assert script.status_code == 200 and "_JUPYTERLAB" in script.text

    # The tenant's kernel sees the folder and can change nothing in it.
    probe = f"""
import errno, json, os
folder = {LABEXTENSIONS_IN_WORKLOAD!r}
attempts = {{}}
for name, attempt in [
    ("create", lambda: open(os.path.join(folder, "{NAME}", "static", "evil.js"), "w")),
    ("overwrite", lambda: open(os.path.join(folder, "{NAME}", "package.json"), "a")),
    ("remove", lambda: os.remove(os.path.join(folder, "{NAME}", "package.json"))),
    ("chmod", lambda: os.chmod(os.path.join(folder, "{NAME}"), 0o777)),
]:
    try:
        attempt()
        attempts[name] = "allowed"
    except OSError as exc:
        attempts[name] = errno.errorcode.get(exc.errno, str(exc.errno))
mount = [line.split() for line in open("/proc/self/mountinfo") if line.split()[4] == folder]
print(json.dumps({{"listed": sorted(os.listdir(folder)), "attempts": attempts, "mount": mount}}))
"""
    seen = json.loads(run_in_kernel(agent.url, spec["base_url"], probe).strip().splitlines()[-1])
    assert NAME in seen["listed"]
    # Refused by the mount itself (EROFS), not only by the files' owner (EACCES would do for that).
    assert seen["attempts"]["create"] == "EROFS" and seen["attempts"]["remove"] == "EROFS", seen
    assert set(seen["attempts"].values()) <= {"EROFS", "EACCES"}, seen
    (mount,) = seen["mount"]
    assert "ro" in mount[5].split(","), mount  # the mount's own options
    assert (LABEXTENSIONS_DIR / NAME / "package.json").exists()
    assert not (LABEXTENSIONS_DIR / NAME / "static" / "evil.js").exists()
