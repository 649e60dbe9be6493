"""The hardware spec: links by node, a group's slowest link, TOML round trip, and one-line errors on bad specs."""

from __future__ import annotations

import math

import pytest

from stratum.errors import StratumError
from stratum.ir.hardware import FREE, Device, Hardware, Link, dump_hardware, load_hardware

SPEC = """
[hardware]
host_bytes = "64GB"
disk_bytes = "1TB"
host_link = { bandwidth = "16GB/s", latency = "10us" }
disk_link = { bandwidth = "2GB/s", latency = "0.1ms" }
intra_node = { bandwidth = "300GB/s", latency = 2e-6 }
inter_node = { bandwidth = 25000000000, latency = "5us" }

[[hardware.devices]]
name = "a100"
memory_bytes = "40GB"
count = 2

[[hardware.devices]]
name = "v100"
memory_bytes = "16GiB"
speed = 0.5
node = 1
"""


def _write(tmp_path, text):
    p = tmp_path / "hw.toml"
    p.write_text(text)
    return p


def test_a_spec_loads_with_units_counts_and_defaults(tmp_path):
    hw = load_hardware(_write(tmp_path, SPEC))
    assert hw.num_devices == 3 and hw.host_bytes == 64 * 10**9 and hw.disk_bytes == 10**12
    assert hw.devices[0] == Device(name="a100", memory_bytes=40 * 10**9, speed=1.0, node=0) == hw.devices[1]
    assert hw.devices[2] == Device(name="v100", memory_bytes=16 * 2**30, speed=0.5, node=1)
    assert hw.host_link == Link(bandwidth=16e9, latency=10e-6)
    assert hw.disk_link == Link(bandwidth=2e9, latency=1e-4)
    assert hw.inter_node == Link(bandwidth=25e9, latency=5e-6)
    assert hw.sharded_scale == 1.0  # a ring's reduce-scatter and all-gather: an all-reduce's halves
    assert hw.shared_cores == 0  # each device computes on its own
    text = SPEC.replace('host_bytes = "64GB"', 'host_bytes = "64GB"\nsharded_scale = 2.5\nshared_cores = 2')
    scaled = load_hardware(_write(tmp_path, text))
    assert scaled.sharded_scale == 2.5 and scaled.shared_cores == 2
    assert load_hardware(_write(tmp_path, dump_hardware(scaled))) == scaled


def test_links_by_node_and_a_groups_slowest_link(tmp_path):
    hw = load_hardware(_write(tmp_path, SPEC))
    assert hw.link(0, 1) == hw.intra_node and hw.link(1, 2) == hw.inter_node and hw.link(2, 2) == FREE
    assert hw.group_link([0, 1]) == hw.intra_node
    assert hw.group_link([0, 1, 2]) == hw.inter_node
    assert hw.group_link([1]) == FREE and math.isinf(FREE.bandwidth)
    with pytest.raises(StratumError, match="outside the hardware's 3 devices"):
        hw.link(0, 3)


def test_dump_reads_back_equal(tmp_path):
    hw = load_hardware(_write(tmp_path, SPEC))
    text = dump_hardware(hw)
    assert text.count("[[hardware.devices]]") == 2 and "count = 2" in text
    assert load_hardware(_write(tmp_path, text)) == hw
    uni = Hardware.uniform(8, memory_bytes=10**9, per_node=4, speed=2.0)
    assert [d.node for d in uni.devices] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert uni.group_link(range(4)) == uni.intra_node and uni.group_link([3, 4]) == uni.inter_node
    assert load_hardware(_write(tmp_path, dump_hardware(uni))) == uni


BAD = [
    ('intra_node = { bandwidth = "300GB/s", latency = 2e-6 }', 'intra_node = { bandwidth = -5, latency = 0 }',
     "hardware.intra_node.bandwidth = -5 must be a positive bandwidth"),
    ('intra_node = { bandwidth = "300GB/s", latency = 2e-6 }', 'intra_node = { bandwidth = 0, latency = 0 }',
     "must be a positive bandwidth"),
    ('latency = "10us"', 'latency = -1.0', "hardware.host_link.latency = -1.0 must be a time >= 0"),
    ('latency = "10us"', 'latency = "3 fortnights"', "is not a time"),
    ('bandwidth = "16GB/s"', 'bandwidth = "16 parsecs/s"', "is not a size"),
    ('bandwidth = "16GB/s"', 'bandwidth = "16GB"', "is not a bandwidth"),
    ('bandwidth = "16GB/s"', 'bandwidth = "200Gb/s"', "= '200Gb/s' is in bits; write bytes: 25GB/s"),
    ('bandwidth = "16GB/s"', 'bandwidth = "-300GB/s"', "= '-300GB/s' must be a positive bandwidth"),
    ('host_bytes = "64GB"', 'host_bytes = "64 lots"', "hardware.host_bytes = '64 lots' is not a size"),
    ('host_bytes = "64GB"', 'host_bytes = "64GB"\nfloppy = 1', "unknown key 'floppy'"),
    ('count = 2', 'count = 2\ncolour = "red"', "hardware.devices[0]: unknown key 'colour'"),
    ('count = 2', 'count = 0', "count = 0 must be a whole number in [1, 1,000,000]"),
    ('count = 2', 'count = 1000000000000000', "count = 1000000000000000 must be a whole number in [1, 1,000,000]"),
    ('speed = 0.5', 'speed = -1', "speed = -1 must be a number in (0, 1e+09]"),
    ('speed = 0.5', 'speed = 1e308', "speed = 1e+308 must be a number in (0, 1e+09]"),
    ('memory_bytes = "40GB"', 'memory_bytes = 0', "memory_bytes must be > 0"),
    ('memory_bytes = "40GB"', 'memory_bytes = "99999999999999999999999999TB"', "is more than a device has"),
    ('memory_bytes = "40GB"', 'memory_bytes = "40 lots"', "hardware.devices[0].memory_bytes = '40 lots' is not a"),
    ('name = "a100"', 'name = 5', "hardware.devices[0].name = 5 must be a string"),
    ('count = 2', 'count = 2\nlaunch_s = -1', ": hardware.devices[0].launch_s = -1 must be a time >= 0"),
    ('host_bytes = "64GB"', 'host_bytes = "64GB"\nsharded_scale = 0', "sharded_scale must be a positive number"),
    ('host_bytes = "64GB"', 'host_bytes = "64GB"\nsharded_scale = "2x"', "sharded_scale must be a number"),
    ('host_bytes = "64GB"', 'host_bytes = "64GB"\nshared_cores = 1.5', "shared_cores must be a whole number >= 0"),
    ('host_bytes = "64GB"', 'host_bytes = "64GB"\nshared_cores = -2', "shared_cores must be a whole number >= 0"),
]


@pytest.mark.parametrize("old, new, message", BAD)
def test_bad_specs_are_one_line_errors(tmp_path, old, new, message):
    with pytest.raises(StratumError, match="^[^\n]*$") as e:
        load_hardware(_write(tmp_path, SPEC.replace(old, new, 1)))
    assert message in str(e.value) and str(e.value).count("hardware.devices[0]") <= 1


def test_no_devices_and_missing_files_are_one_line_errors(tmp_path):
    no_devices = SPEC[:SPEC.index("[[hardware.devices]]")]
    with pytest.raises(StratumError, match="no devices"):
        load_hardware(_write(tmp_path, no_devices))
    with pytest.raises(StratumError, match="does not exist"):
        load_hardware(tmp_path / "missing.toml")
    with pytest.raises(StratumError, match="has no \\[hardware\\] table"):
        load_hardware(_write(tmp_path, "[model]\npreset = 'tiny'\n"))
    with pytest.raises(StratumError, match="not valid TOML"):
        load_hardware(_write(tmp_path, "[hardware\n"))
    with pytest.raises(StratumError, match="nests arrays or tables too deeply"):
        load_hardware(_write(tmp_path, "[hardware]\nx = " + "[" * 50_000 + "]" * 50_000 + "\n"))
    with pytest.raises(StratumError, match="latency must be >= 0"):
        Link(bandwidth=1.0, latency=-1.0)
