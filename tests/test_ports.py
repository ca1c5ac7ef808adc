"""A rendezvous port is drawn where no outgoing connection can take it before it is used."""

import socket

from t2train import ports


def test_a_port_is_free_and_below_the_ephemeral_range():
    low, high = ports.ephemeral_range()
    assert 1024 < low <= high
    drawn = {ports.free_port("127.0.0.1") for _ in range(20)}
    assert all(ports.LOWEST <= port < low for port in drawn)
    assert len(drawn) > 1  # drawn at random: two launchers at once do not pick alike
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", drawn.pop()))


def test_an_outgoing_connection_never_gets_the_drawn_port():
    """Many outgoing connections (each takes an ephemeral local port, as the other ranks'
    and the other tests' do) never land on the drawn port."""
    port = ports.free_port("127.0.0.1")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(256)
        target = server.getsockname()
        clients = [socket.create_connection(target) for _ in range(200)]
        try:
            assert port not in {client.getsockname()[1] for client in clients}
        finally:
            for client in clients:
                client.close()
    assert ports.bindable(port, "127.0.0.1")


def test_a_taken_port_is_not_drawn_and_a_low_range_falls_back(tmp_path, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        assert not ports.bindable(taken.getsockname()[1], "127.0.0.1")
    low = tmp_path / "range"
    low.write_text("5000\t60999\n")  # no room below it: any free port
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", low)
    assert ports.ephemeral_range() == (5000, 60999)
    assert ports.bindable(ports.free_port("127.0.0.1"), "127.0.0.1")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "missing")
    assert ports.ephemeral_range() == (32768, 60999)
