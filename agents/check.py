"""``python -m agents check``: a GPU host's self-check, for the operator installing an agent.

It reads the NVML inventory (real, or ``--fleet`` for a rehearsal), checks that bubblewrap can build
the workload sandbox, then runs one sandboxed command per GPU exactly as a workload would be sandboxed
(its uid, its namespaces, its ``/dev``) and checks from inside that it sees its own GPU's device node
and no other (and, where ``nvidia-smi`` exists, that ``nvidia-smi -L`` lists exactly one GPU). It
says whether HAMi-core's libvgpu.so is installed, which decides whether slice limits are enforced.
Exit code 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from agents import sandbox
from agents.gpuplan import device_nodes
from agents.nvml import GpuReader, nvml_source

PROBE = (
    'echo uid=$(id -u); for n in /dev/nvidia*; do [ -e "$n" ] && echo dev=${n#/dev/}; done; '
    "if command -v nvidia-smi >/dev/null; then nvidia-smi -L | sed 's/^/smi=/'; fi; true"
)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m agents check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--fleet", help="check against a fake fleet file instead of the real NVML")
    parser.add_argument("--device-dir", default="/dev", help="where the GPUs' device nodes are")
    parser.add_argument("--vgpu-lib", default="/usr/local/vgpu/libvgpu.so")
    args = parser.parse_args(argv)
    failures = 0

    def report(ok: bool, what: str) -> None:
        nonlocal failures
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {what}", flush=True)

    try:
        nvml = (nvml_source("fake", fleet_path=args.fleet) if args.fleet else nvml_source("real")).open()
        inventory = GpuReader(nvml).inventory()
    except Exception as exc:
        report(False, f"NVML: {exc}")
        return 1
    gpus = inventory["gpus"]
    report(bool(gpus), f"NVML ({'fake' if args.fleet else 'real'}): {len(gpus)} GPUs, driver "
           f"{inventory.get('driver_version')}, CUDA {inventory.get('cuda_version')}")  # fmt: skip
    try:
        sandbox.probe(shutil.which("bwrap"))
        report(True, "bubblewrap builds the workload sandbox here")
    except sandbox.SandboxUnavailable as exc:
        report(False, str(exc))
        return 1
    has_lib = os.path.isfile(args.vgpu_lib)
    print(f"INFO  libvgpu.so {'found' if has_lib else 'absent'} at {args.vgpu_lib}: fixed-share slices and "
          f"best-effort memory caps are {'enforced' if has_lib else 'advisory'}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="suanli-check-") as scratch:
        home, private = Path(scratch, "home"), Path(scratch, "private")
        home.mkdir(mode=0o700)
        private.mkdir(mode=0o700)
        uid = sandbox.DEFAULT_UIDS[1] if os.geteuid() == 0 else None
        if uid is not None:
            sandbox.own(home, uid)
            sandbox.own(private, uid)
        for gpu in gpus:
            if gpu.get("health") != "ok":
                report(False, f"GPU {gpu['index']} {gpu.get('uuid')}: lost")
                continue
            nodes = device_nodes(gpu, None)
            command = sandbox.bwrap_command(
                bwrap=shutil.which("bwrap") or "bwrap",
                user="check",
                uid=uid,
                home=home,
                private=private,
                hidden=[scratch],
                kept=[],
                writable=[],
                device_dir=args.device_dir,
                device_nodes=nodes,
                command=["sh", "-c", PROBE],
            )
            result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
            seen = [line.split("=", 1) for line in result.stdout.splitlines() if "=" in line]
            devices = sorted(value for key, value in seen if key == "dev")
            expected = sorted(n for n in nodes if os.path.exists(os.path.join(args.device_dir, n)))
            smi = [value for key, value in seen if key == "smi"]
            uid_seen = next((value for key, value in seen if key == "uid"), "?")
            ok = result.returncode == 0 and devices == expected and (not smi or len(smi) == 1)
            ok = ok and uid_seen != "0"
            detail = f"uid {uid_seen}, /dev: {', '.join(devices) or 'no GPU nodes'}"
            if smi:
                detail += f"; nvidia-smi -L: {' | '.join(smi)}"
            if result.returncode:
                detail += f"; exit {result.returncode}: {result.stderr.strip()[:200]}"
            report(ok, f"GPU {gpu['index']} {gpu.get('name')}: the sandbox sees only its own GPU ({detail})")
    print(f"{'all checks passed' if not failures else f'{failures} check(s) failed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
