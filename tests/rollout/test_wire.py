"""The generator workers' frames and handshake (grpolab/rollout/remote/wire.py): tensors round-trip bit for bit, and
anything that is not a well-formed frame of this run is refused before it is read."""

import socket
import struct

import pytest
import torch

from grpolab.rollout.remote import wire


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    yield a, b
    a.close()
    b.close()


def test_every_dtype_round_trips_bit_for_bit(pair):
    g = torch.Generator().manual_seed(0)
    sent = [
        torch.randn(3, 5, generator=g, dtype=torch.float64),
        torch.randn(7, generator=g),
        torch.randn(2, 3, generator=g).bfloat16(),
        torch.randn(4, generator=g).half(),
        torch.randint(-(2**40), 2**40, (6,), generator=g),
        torch.randint(0, 100, (2, 2), generator=g, dtype=torch.int32),
        torch.tensor([True, False, True]),
        torch.empty(0, 4),
        torch.randn(4, 6, generator=g).t(),  # not contiguous
    ]
    wire.send_frame(pair[0], {"kind": "draw", "rows": [[1, 2], [3]]}, sent)
    header, got = wire.recv_frame(pair[1], max_payload=1 << 20)
    assert header == {"kind": "draw", "rows": [[1, 2], [3]]}
    assert len(got) == len(sent)
    for s, r in zip(sent, got):
        assert r.dtype == s.dtype and r.shape == s.shape
        assert torch.equal(
            r.view(torch.int16) if r.dtype == torch.bfloat16 else r,
            s.view(torch.int16) if s.dtype == torch.bfloat16 else s,
        )


def test_a_stranger_is_refused_before_its_payload_is_read(pair):
    a, b = pair
    a.sendall(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(wire.WireError, match="not a grpolab frame"):
        wire.recv_frame(b, max_payload=1 << 20)


def test_a_header_over_the_limit_is_refused_unread(pair):
    a, b = pair
    a.sendall(wire.MAGIC + struct.pack(">I", wire.MAX_HEADER + 1))
    with pytest.raises(wire.WireError, match="over the limit"):
        wire.recv_frame(b, max_payload=1 << 20)


@pytest.mark.parametrize(
    "header, match",
    [
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"tensors": [["object", [1]]]}', "payload described"),
        (b'{"tensors": [["float32", [-1]]]}', "payload described"),
        (b'{"tensors": [["float32", [1024, 1024]]]}', "over the limit"),
    ],
)
def test_a_malformed_header_is_refused(pair, header, match):
    a, b = pair
    a.sendall(wire.MAGIC + struct.pack(">I", len(header)) + header)
    with pytest.raises(wire.WireError, match=match):
        wire.recv_frame(b, max_payload=1 << 20)


def test_a_payload_over_the_receivers_limit_is_refused(pair):
    wire.send_frame(pair[0], {"kind": "x"}, [torch.zeros(1000)])
    with pytest.raises(wire.WireError, match="4000 bytes is over the limit of 3999"):
        wire.recv_frame(pair[1], max_payload=3999)


def test_a_peer_that_closes_mid_frame_is_a_connection_error(pair):
    a, b = pair
    a.sendall(wire.MAGIC + struct.pack(">I", 100) + b'{"kind"')
    a.close()
    with pytest.raises(ConnectionError, match="closed"):
        wire.recv_frame(b, max_payload=1 << 20)


def test_the_handshake_admits_the_token_and_run_and_refuses_the_rest():
    token = b"secret"
    sent = wire.challenge("run-a")
    hello = wire.answer_challenge(sent, token, "run-a", {"device": "cpu"})
    assert wire.check_answer(sent, hello, token) == {"device": "cpu"}
    # a worker not told its run joins whichever it reaches
    assert wire.check_answer(sent, wire.answer_challenge(sent, token, None, {}), token) == {}
    with pytest.raises(wire.WireError, match="token"):
        wire.check_answer(sent, wire.answer_challenge(sent, b"other", None, {}), token)
    with pytest.raises(wire.WireError, match="not 'run-b'"):
        wire.answer_challenge(sent, token, "run-b", {})
    # a replayed answer to another challenge does not pass
    with pytest.raises(wire.WireError, match="token"):
        wire.check_answer(wire.challenge("run-a"), hello, token)
    with pytest.raises(wire.WireError, match="protocol"):
        wire.check_answer(sent, dict(hello, protocol=wire.PROTOCOL + 1), token)
    with pytest.raises(wire.WireError, match="run id"):
        wire.check_answer(sent, dict(hello, run="run-b"), token)
    with pytest.raises(wire.WireError, match="not a hello"):
        wire.check_answer(sent, {"kind": "draw"}, token)
    with pytest.raises(wire.WireError, match="protocol"):
        wire.answer_challenge(dict(sent, protocol=0), token, None, {})
