"""A runtime's handle: read-only for its callers, and the same handle after a trip through the
workload's record, including records an agent wrote before handles existed."""

from __future__ import annotations

import dataclasses
import json

import pytest

from agents.runtimes import RuntimeOptions, runtime_class
from agents.runtimes.docker import DockerHandle
from agents.runtimes.process import ProcessHandle

# What the process runtime persisted as its state before the handle (keys and values as written).
OLD_PROCESS_RECORD = {
    "pid": 4242,
    "pid_start_ticks": 987654,
    "socket": "/var/lib/suanli-agent/run/s-1/private/jupyter.sock",
    "upstream": "unix:/var/lib/suanli-agent/run/s-1/private/jupyter.sock",
    "base_url": "/jupyter/s-1/",
    "home": "/var/lib/suanli-agent/homes/alice",
    "home_in_sandbox": "/home/alice",
    "run_dir": "/var/lib/suanli-agent/run/s-1",
    "exit_file": "/var/lib/suanli-agent/run/s-1/exit.json",
    "log_file": "/var/lib/suanli-agent/run/s-1/workload.log",
    "sandbox": "bwrap",
    "outbound": "off",
    "uid": 60001,
    "enforcement": {"device": {"enforced": True, "by": "device-nodes"}},
    "limits": {"cpus": [2, 3], "rlimit_data_bytes": 4294967296},
}


def _runtime(name: str, tmp_path):
    return runtime_class(name)(RuntimeOptions(state_dir=tmp_path))


def test_a_record_written_before_handles_is_adopted_as_a_handle(tmp_path):
    handle = _runtime("process", tmp_path).restore(OLD_PROCESS_RECORD)
    assert isinstance(handle, ProcessHandle)
    assert handle.socket_path == OLD_PROCESS_RECORD["socket"]
    assert handle.upstream_url == OLD_PROCESS_RECORD["upstream"]
    assert handle.pid == 4242 and handle.pid_start_ticks == 987654
    assert handle.to_json() == OLD_PROCESS_RECORD  # and written back the same way


def test_a_handle_is_the_same_after_its_record_is_read_back(tmp_path):
    handle = DockerHandle(
        base_url="/jupyter/d-1/",
        upstream_url="unix:/state/run/d-1/private/jupyter.sock",
        socket_path="/state/run/d-1/private/jupyter.sock",
        run_dir="/state/run/d-1",
        container_id="c0ffee",
        container_name="suanli-d-1",
    )
    persisted = json.loads(json.dumps(handle.to_json()))
    assert _runtime("docker", tmp_path).restore(persisted) == handle


def test_callers_cannot_change_a_handle(tmp_path):
    handle = _runtime("process", tmp_path).restore(OLD_PROCESS_RECORD)
    with pytest.raises(dataclasses.FrozenInstanceError):
        handle.socket_path = "/tmp/elsewhere.sock"  # type: ignore[misc]
    with pytest.raises(TypeError):
        handle.enforcement["device"] = {"enforced": False}  # type: ignore[index]
    with pytest.raises(TypeError):
        handle.limits["cpus"][0] = 0  # type: ignore[index]
    assert handle.reported() == {
        "upstream": OLD_PROCESS_RECORD["upstream"],
        "enforcement": OLD_PROCESS_RECORD["enforcement"],
    }


def test_another_runtimes_record_is_refused(tmp_path):
    with pytest.raises(KeyError):
        _runtime("docker", tmp_path).restore(OLD_PROCESS_RECORD)
