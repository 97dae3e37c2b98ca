"""The netns harness's CPU pinning (raycoll.testing_netns.NetnsCluster's ``pin``), checked
without namespaces: one ``taskset`` CPU list a node, each of this machine's CPUs, parsed
before anything starts (the pinned runs themselves are benchmarks/netns.py ``--pin``'s, which
print each rank's CPUs)."""

from __future__ import annotations

import os

import pytest

from raycoll.testing_netns import NetnsCluster

pytestmark = pytest.mark.timeout(30)


def test_a_pin_a_node_is_parsed_into_cpu_numbers():
    last = (os.cpu_count() or 1) - 1
    cluster = NetnsCluster(2, pin=["0", f"0-{last}"])
    assert cluster.pin == [[0], list(range(last + 1))]
    assert NetnsCluster(1, pin=[f"{last},0,{last}"]).pin == [sorted({0, last})]
    assert NetnsCluster(2).pin is None  # not pinned: the nodes share every CPU


@pytest.mark.parametrize("pin,why", [
    (["0"], "one CPU list for each of the 2 nodes"),
    ("0/1", "one CPU list for each of the 2 nodes"),  # a string, not one list a node
    (["0", "x"], "CPU lists like '0', '0,2' or '0-1'"),
    (["0", str(os.cpu_count() or 1)], "CPU lists like"),  # past this machine's CPUs
    (["0", "1-0"], "CPU lists like"),  # an empty range
])
def test_a_bad_pin_is_refused_naming_what_was_expected(pin, why):
    with pytest.raises(ValueError, match=f"pin: expected {why}"):
        NetnsCluster(2, pin=pin)
