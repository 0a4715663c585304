"""A fleet from Python: three CPU-backend servers on loopback ports, each advertising its address, and one Client
whose target names all three (ipv4:a,b,c). Sequences are placed round robin and each step reaches the server
that holds its sequence, its O and LSE checked against float64 attention."""
import socket
from collections import Counter

import numpy as np
import pytest

import attnd
from conftest import Server
from test_sequences import KV_HEADS, HEAD_DIM, History, step_checked


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fleet(tmpdir_short):
    servers = []
    try:
        for i in range(3):
            port = free_port()
            servers.append(Server([f"--listen=127.0.0.1:{port}", f"--advertise_address=127.0.0.1:{port}"],
                                  tmpdir_short, f"fleet{i}"))
        yield servers
    finally:
        for s in servers:
            s.stop()


def test_fleet_places_sequences_and_steps_follow_them(fleet):
    rng = np.random.default_rng(11)
    target = "ipv4:" + ",".join(s.target for s in fleet)
    with attnd.Client(target) as c:
        # Round robin reaches a server once its connection is up: until then the first ready one takes the calls.
        for _ in range(50):
            probe = c.open_sequence(layers=1, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
            probe.close()
        seqs = [c.open_sequence(layers=1, kv_heads=KV_HEADS, head_dim=HEAD_DIM) for _ in range(12)]
        where = Counter(s.id.rsplit("@", 1)[1] for s in seqs)
        assert set(where) == {s.target for s in fleet}
        assert all(3 <= n <= 5 for n in where.values()), where
        for seq in seqs:
            hist = History(layers=1)
            step_checked(seq, hist, 0, rng, 5)
            step_checked(seq, hist, 0, rng, 1)
            assert seq.lengths == [6]
        for seq in seqs:
            seq.close()
        for s in fleet:
            with attnd.Client(s.target) as direct:
                assert direct.stats()["sequences"].get("open", 0) == 0


def test_a_sequence_moves_to_another_server_and_follows(fleet):
    """Sequence.move: the cached K and V go to another server of the fleet, the object takes the new id, steps go on
    over the whole history there, and the old id says where the sequence went."""
    rng = np.random.default_rng(12)
    target = "ipv4:" + ",".join(s.target for s in fleet)
    with attnd.Client(target) as c:
        seq = c.open_sequence(layers=2, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
        hist = History(layers=2)
        step_checked(seq, hist, 0, rng, 21)
        step_checked(seq, hist, 1, rng, 9)
        old, here = seq.id, seq.id.rsplit("@", 1)[1]
        there = next(s.target for s in fleet if s.target != here)
        new = seq.move(there)
        assert new == seq.id and new != old and new.rsplit("@", 1)[1] == there
        assert c.last_move_path == "bytes"  # CPU servers share no GPU
        assert seq.info()["lengths"] == [21, 9]
        step_checked(seq, hist, 0, rng, 1)
        step_checked(seq, hist, 1, rng, 2)
        # The old id is followed to the new one, and remembered.
        assert c.sequence_info(old)["sequence_id"] == new
        assert c.current_sequence_id(old) == new
        with pytest.raises(attnd.AttndError) as again:
            seq.move(there)
        assert again.value.code == attnd.StatusCode.INVALID_ARGUMENT, again.value
        # The device path needs a GPU: the CPU exporter refuses it, and the sequence stays.
        with pytest.raises(attnd.AttndError) as no_gpu:
            seq.move(here, path="device")
        assert no_gpu.value.code == attnd.StatusCode.FAILED_PRECONDITION, no_gpu.value
        assert seq.id == new and seq.info()["lengths"] == [22, 11]
        with pytest.raises(attnd.AttndError) as bad:
            seq.move(here, path="ipc")
        assert bad.value.code == attnd.StatusCode.INVALID_ARGUMENT, bad.value
        seq.close()


def test_move_sequences_moves_a_batch_and_names_each_one_that_failed(fleet):
    """Client.move_sequences: several sequences at once to another server, each Sequence following its move and its
    steps going on over the whole history there; an id that no server knows fails alone, named by its index."""
    rng = np.random.default_rng(14)
    target = "ipv4:" + ",".join(s.target for s in fleet)
    with attnd.Client(target) as c:
        probe = c.open_sequence(layers=1, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
        here = probe.id.rsplit("@", 1)[1]
        probe.close()
        with attnd.Client(here) as direct:
            seqs = [direct.open_sequence(layers=2, kv_heads=KV_HEADS, head_dim=HEAD_DIM) for _ in range(5)]
            hists = [History(layers=2) for _ in seqs]
            for seq, hist in zip(seqs, hists):
                step_checked(seq, hist, 0, rng, int(rng.integers(3, 30)))
                step_checked(seq, hist, 1, rng, int(rng.integers(3, 30)))
            there = next(s.target for s in fleet if s.target != here)
            old = [s.id for s in seqs]
            new = direct.move_sequences(seqs, there, at_once=3)
            assert new == [s.id for s in seqs] and all(n.rsplit("@", 1)[1] == there for n in new)
            for seq, hist, o in zip(seqs, hists, old):
                assert direct.sequence_info(o)["sequence_id"] == seq.id  # the old id says where it went
                step_checked(seq, hist, 0, rng, 1)
                step_checked(seq, hist, 1, rng, 2)
            ghost = f"nosuch@{there}"
            with pytest.raises(attnd.AttndError) as failed:
                direct.move_sequences([seqs[0], ghost, seqs[1]], here)
            assert failed.value.code == attnd.StatusCode.NOT_FOUND, failed.value
            assert "sequences[1]" in failed.value.message and "sequences[0]" not in failed.value.message
            assert [s.id.rsplit("@", 1)[1] for s in seqs[:2]] == [here, here]
            for seq, hist in zip(seqs[:2], hists):
                step_checked(seq, hist, 1, rng, 1)
            assert direct.move_sequences([], there) == []
            for bad in (0, -1, 1.5, True):
                with pytest.raises(attnd.AttndError) as refused:
                    direct.move_sequences(seqs, there, at_once=bad)
                assert refused.value.code == attnd.StatusCode.INVALID_ARGUMENT and "at_once" in refused.value.message
            with pytest.raises(attnd.AttndError) as refused:
                direct.move_sequences([seqs[0], ""], there)
            assert "sequences[1]" in refused.value.message
            for seq in seqs:  # on two servers now: one close each
                seq.close()


def test_moves_go_over_connections_of_their_own_or_the_calls_ones(fleet):
    """Client(move_connections=...): moves by bytes at once over two connections of their own and over the calls'
    ones arrive whole; a count that is not an int from 0 to 64 is refused naming the field."""
    rng = np.random.default_rng(15)
    here, there = fleet[0].target, fleet[1].target
    for lanes in (2, 0):
        with attnd.Client(here, move_connections=lanes) as c:
            seqs = [c.open_sequence(layers=2, kv_heads=KV_HEADS, head_dim=HEAD_DIM) for _ in range(3)]
            hists = [History(layers=2) for _ in seqs]
            for seq, hist in zip(seqs, hists):
                step_checked(seq, hist, 0, rng, int(rng.integers(3, 30)))
                step_checked(seq, hist, 1, rng, int(rng.integers(3, 30)))
            c.move_sequences(seqs, there, path="bytes", at_once=3)
            assert c.last_move_path == "bytes" and all(s.id.rsplit("@", 1)[1] == there for s in seqs)
            for seq, hist in zip(seqs, hists):
                step_checked(seq, hist, 0, rng, 1)
                step_checked(seq, hist, 1, rng, 2)
                seq.close()
    for bad in (-1, 65, 1.5, True, "8"):
        with pytest.raises(attnd.AttndError) as refused:
            attnd.Client(here, move_connections=bad)
        assert refused.value.code == attnd.StatusCode.INVALID_ARGUMENT and "move_connections" in refused.value.message


def test_a_sequence_its_server_moved_is_followed_by_its_next_call(fleet):
    """A Sequence moved by someone else (as a draining server moves its sequences) is followed by its next step:
    the step runs on the new server over the whole history, and the object's id is the new one."""
    rng = np.random.default_rng(13)
    target = "ipv4:" + ",".join(s.target for s in fleet)
    with attnd.Client(target) as c, attnd.Client(target) as mover:
        seq = c.open_sequence(layers=1, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
        hist = History(layers=1)
        step_checked(seq, hist, 0, rng, 5)
        old, here = seq.id, seq.id.rsplit("@", 1)[1]
        there = next(s.target for s in fleet if s.target != here)
        new = mover.move_sequence(old, there)
        assert seq.id == old  # nothing told this client yet
        step_checked(seq, hist, 0, rng, 1)
        assert seq.id == new and c.current_sequence_id(old) == new
        assert seq.info()["lengths"] == [6]
        seq.close()
