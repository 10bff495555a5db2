"""The provisioner's part of the demo: GPU models matching the fake fleets (agents/fleets/node-a.yaml and
node-b.yaml), profiles, a JupyterLab environment on this venv's Python, prices (card burn rates are
billing's demo), and the nodes node-a and node-b with their tokens written where the Procfile's agents
read them.

Idempotent: a second run changes nothing that is already right, and never rotates a node token that
is already on disk (the file is rewritten from the node's sealed token when they differ).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from billing.models import Price
from billing.services.pricing import price_set
from provisioner.management.commands.node import write_token_file
from provisioner.models import Environment, GpuModel, Node, Profile
from provisioner.sealing import token_hash
from provisioner.services.nodes import node_enroll, node_token

ENVIRONMENT = "python-3.11 (JupyterLab)"
# Offered only while a node's agent reports code-server (agents/editors/install.sh; the catalog asks)
VSCODE_ENVIRONMENT = "VS Code (code-server)"
GPU_MODELS = [
    # name, memory, peak dense BF16 TFLOPS, offered profiles, NVML names (the fake fleet adds "NVIDIA ")
    ("A100-SXM4-80GB", 81920, 312.0, ["whole", "2x", "4x", "1/2", "1/4", "1/8"], ["NVIDIA A100-SXM4-80GB"]),
    ("T4", 15360, 65.0, ["whole", "1/2"], ["NVIDIA Tesla T4", "Tesla T4"]),
    ("H200", 143771, 989.0, ["whole", "1g.18gb"], ["NVIDIA H200"]),
]
# micro-units of SITE_CURRENCY per hour of a whole card (slices pay their fraction); cpu: no GPU
PRICES = [("A100-SXM4-80GB", "whole", 2_000_000), ("T4", "whole", 400_000), ("H200", "whole", 5_000_000)]
CPU_PRICE = 50_000
# where the Procfile's agents listen (AGENT_A_PORT / AGENT_B_PORT, as `make run` passes them)
NODES = [("node-a", "AGENT_A_PORT", 8701), ("node-b", "AGENT_B_PORT", 8702)]
# Neither HAMi's libvgpu.so nor MPS is on a demo host: slices time-share (memory cap only).
NODE_LABELS = {"sharing_policy": "best-effort"}
PROFILES = [("whole", "whole", 8, 8), ("1/2", "slice", 4, 4), ("1/4", "slice", 2, 2), ("1/8", "slice", 1, 1)]
PROFILES += [("cpu", "cpu", 0, 0), ("1g.18gb", "mig", 8, 1)]
GPU_COUNTS = (2, 4, 8)  # multi-GPU profiles "2x", "4x", "8x": N whole GPUs of one node


def multi_gpu_profiles_ensure() -> None:
    """The multi-GPU profiles, as migration 0010 seeds them (a transactional test flushes them)."""
    for count in GPU_COUNTS:
        Profile.objects.get_or_create(
            name=f"{count}x",
            defaults={"kind": "whole", "eighths": 8, "quota_eighths": 8 * count, "gpu_count": count},
        )


def _current_price(gpu_model: str, profile: str) -> int | None:
    price = (
        Price.objects.filter(gpu_model=gpu_model, profile=profile).order_by("-effective_from", "-id").first()
    )
    return price.price_micros_per_hour if price else None


def _ensure_token_file(node: Node, path: Path) -> str:
    """The node's token on disk: kept when it matches, rewritten from the sealed copy when not, rotated
    only when the sealed copy cannot be read (SECRET_KEY changed)."""
    on_disk = path.read_text().strip() if path.exists() else ""
    if on_disk and token_hash(on_disk) == node.token_hash:
        return "kept"
    try:
        token = node_token(node=node)
    except Exception:  # cryptography.fernet.InvalidToken: sealed under another SECRET_KEY
        token = node_enroll(name=node.name, address=node.address, labels=node.labels).token
        write_token_file(path, token)
        return "rotated"
    write_token_file(path, token)
    return "written"


def seed_hardware() -> list[str]:
    """The profiles and the GPU models of the fake fleets (also the chaos run's); returns the names."""
    for name, kind, eighths, quota in PROFILES:
        Profile.objects.get_or_create(
            name=name, defaults={"kind": kind, "eighths": eighths, "quota_eighths": quota}
        )
    multi_gpu_profiles_ensure()
    for name, memory_mib, tflops, profiles, nvml_names in GPU_MODELS:
        GpuModel.objects.update_or_create(
            name=name,
            defaults={
                "memory_mib": memory_mib,
                "peak_tflops": tflops,
                "profiles": profiles,
                "nvml_names": nvml_names,
            },
        )
    return [name for name, *_ in GPU_MODELS]


def seed(*, data_dir: Path | str) -> dict:
    """Create or refresh the demo fleet; returns what it did (for the lines the demo prints)."""
    data_dir = Path(data_dir)
    done: dict = {"gpu_models": [], "prices": [], "nodes": {}}
    done["gpu_models"] = seed_hardware()
    Environment.objects.update_or_create(
        name=ENVIRONMENT, owner=None, defaults={"python": sys.executable, "image": "", "enabled": True}
    )
    Environment.objects.update_or_create(
        name=VSCODE_ENVIRONMENT,
        owner=None,
        defaults={"python": sys.executable, "image": "", "interface": "vscode", "enabled": True},
    )
    for gpu_model, profile, micros in [*PRICES, ("", "cpu", CPU_PRICE)]:
        if _current_price(gpu_model, profile) != micros:
            price_set(gpu_model=gpu_model, profile=profile, price_micros_per_hour=micros, reason="demo seed")
            done["prices"].append(f"{gpu_model or 'cpu'} {profile}")
    for name, port_variable, default_port in NODES:
        address = f"http://127.0.0.1:{os.environ.get(port_variable) or default_port}"
        path = data_dir / "agents" / name / "token"
        node = Node.objects.filter(name=name).first()
        if node is None:
            token = node_enroll(name=name, address=address, labels=dict(NODE_LABELS)).token
            write_token_file(path, token)
            outcome = "enrolled"
        else:
            outcome = _ensure_token_file(node, path)
            if node.address != address:  # the demo's agents moved to other ports since the last run
                Node.objects.filter(pk=node.pk).update(address=address)
        done["nodes"][name] = {"address": address, "token_file": str(path), "token": outcome}
    return done


def demo_fleet(*, url: str, data_dir: Path) -> list[str]:
    """The lines ``make run`` prints about what this step seeded (idempotent)."""
    done = seed(data_dir=data_dir)
    lines = [f"GPU models:         {', '.join(done['gpu_models'])}"]
    for name, node in done["nodes"].items():
        lines.append(f"node {name}:        {node['address']} (token {node['token']}: {node['token_file']})")
    return lines
