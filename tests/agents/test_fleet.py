"""Fleet files are validated strictly; every error names the line at fault."""

from __future__ import annotations

import pytest

from agents.nvml.fleet import FleetError, load_fleet, parse_fleet

GOOD = """\
node: n1
gpus:
  - model: A100-SXM4-80GB
    memory_mib: 81920
    mig: ["1g.10gb", "1g.10gb"]
"""


@pytest.mark.parametrize(
    ("text", "line", "needle"),
    [
        ("", 1, "empty"),
        ("node: n1\n", 1, "gpus"),
        ("node: n1\ngpus: []\n", 2, "non-empty"),
        ("node: n1\ngpus:\n  - model: A100\n", 3, "memory_mib"),
        ("node: n1\ngpus:\n  - model: A100\n    memory_mib: lots\n", 4, "memory_mib must be int"),
        (
            "node: n1\ngpus:\n  - model: A100\n    memory_mib: 81920\n    colour: red\n",
            5,
            "unknown key 'colour'",
        ),
        (
            "node: n1\ngpus:\n  - model: Tesla T4\n    memory_mib: 15360\n    mig: [1g.5gb]\n",
            5,
            "does not support MIG",
        ),
        ("node: n1\ngpus:\n  - model: A100\n    memory_mib: 81920\n    mig: [big]\n", 5, "not a MIG profile"),
        (
            "node: n1\ngpus:\n  - model: A100\n    memory_mib: 81920\n    mig: {'4g.40gb': 2}\n",
            5,
            "a GPU has 7",
        ),
        (
            "node: n1\ngpus:\n  - model: A100\n    memory_mib: 81920\n    utilization: {gpu: 120}\n",
            5,
            "at most 100",
        ),
        (
            "node: n1\ngpus:\n  - model: A100\n    memory_mib: 81920\n    faults: {not_supported: [x]}\n",
            5,
            "unknown figure",
        ),
        ("node: n1\nnode: n2\ngpus: []\n", 2, "duplicate key"),
        ("node: n1\ngpus:\n  - model: A100\n    memory_mib: [81920\n", 5, "not valid YAML"),
        ("node: 'bad name'\ngpus: []\n", 1, "host-like"),
        (
            "node: n1\ngpus:\n  - {model: A100, memory_mib: 81920, uuid: GPU-11111111-1}\n"
            "  - {model: A100, memory_mib: 81920, uuid: GPU-11111111-1}\n",
            4,
            "appears twice",
        ),
    ],
)
def test_bad_fleet_names_the_line(text, line, needle):
    with pytest.raises(FleetError) as caught:
        parse_fleet(text, source="f.yaml")
    assert caught.value.line == line, str(caught.value)
    assert needle in str(caught.value)
    assert str(caught.value).startswith(f"f.yaml:{line}: ")


def test_good_fleet_and_missing_file(tmp_path):
    fleet = parse_fleet(GOOD)
    assert [m.profile for m in fleet.gpus[0].mig] == ["1g.10gb", "1g.10gb"]
    with pytest.raises(FleetError, match="cannot read"):
        load_fleet(tmp_path / "absent.yaml")
