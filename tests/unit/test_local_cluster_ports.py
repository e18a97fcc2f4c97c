"""``cluster.local_cluster.free_port``: a port nobody holds, outside the kernel's ephemeral range."""

from __future__ import annotations

import socket

from cluster.local_cluster import PORT_FLOOR, _ephemeral_low, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_can_be_bound_on_every_address() -> None:
    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(PORT_FLOOR <= p < low for p in ports), (ports, low)
    assert len(ports) > 1  # picked at random, not the same one each time
    for p in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("0.0.0.0", p))


def test_a_held_port_is_not_handed_out(monkeypatch) -> None:
    import cluster.local_cluster as lc

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.3", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(lc, "PORT_FLOOR", taken)
        monkeypatch.setattr(lc, "_ephemeral_low", lambda: taken + 2)
        # two ports to pick from, the first held on one loopback address: it fails on the wildcard address, so
        # every pick is the other (or, were that one held too, the kernel's)
        assert all(free_port() != taken for _ in range(50))
