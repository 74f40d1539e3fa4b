"""The host channel's exchange on real sockets, one thread per rank (tests/dist/rldispatch_metrics_worker.py and
rldispatch_dataplane_worker.py run it between torchrun ranks)."""
from __future__ import annotations

import itertools
import socket
import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rldispatch.collectives import frame
from rldispatch.host_channel import HostChannel, HostChannelError, host_identity


def mesh(world: int, timeout_s: float = 30.0) -> list[HostChannel]:
    """``world`` channels whose every pair is joined by a connected socket pair (what ``connect`` builds)."""
    peers: list[dict[int, socket.socket]] = [{} for _ in range(world)]
    for a, b in itertools.combinations(range(world), 2):
        peers[a][b], peers[b][a] = socket.socketpair()
    for ends in peers:
        for s in ends.values():
            s.setblocking(False)
    return [HostChannel(r, peers[r], timeout_s) for r in range(world)]


def run_ranks(channels: list[HostChannel], body) -> list:
    """``body(channel)`` on one thread per channel; returns each one's result, or raises the first error."""
    results: list = [None] * len(channels)
    errors: list = []

    def go(r: int) -> None:
        try:
            results[r] = body(channels[r])
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(r,)) for r in range(len(channels))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "an exchange hung"
    if errors:
        raise errors[0]
    return results


def payload(src: int, dst: int, step: int, size: int) -> torch.Tensor:
    return frame([torch.arange(size, dtype=torch.int64).to(torch.uint8) ^ (src * 7 + dst * 3 + step) % 256])


@settings(max_examples=25, deadline=None)
@given(world=st.integers(2, 4), steps=st.integers(1, 4),
       sizes=st.lists(st.sampled_from([0, 1, 7, 4096, 65536, 3 << 20]), min_size=48, max_size=48))
def test_every_rank_gets_each_peers_frame_bit_for_bit(world, steps, sizes):
    """Any number of ranks, several exchanges back to back (a fast rank's next frame already waits in the socket
    while a slow one reads), frames of 8 bytes (nothing) to several MiB (more than a socket holds, sent both ways at
    once): each rank gets exactly what each peer addressed to it, in order, and nothing of the next exchange."""
    channels = mesh(world)
    size = iter(itertools.cycle(sizes))
    plan = {(s, src, dst): next(size) for s in range(steps) for src in range(world) for dst in range(world)}

    def body(ch: HostChannel):
        for s in range(steps):
            frames = {p: payload(ch.rank, p, s, plan[s, ch.rank, p]) for p in range(world) if p != ch.rank}
            got, done = ch.exchange(frames, meanwhile=lambda: s)
            assert done == s and sorted(got) == sorted(frames)
            for p, f in got.items():
                assert torch.equal(f, payload(p, ch.rank, s, plan[s, p, ch.rank])), (s, p, ch.rank)
        return ch.exchanges

    assert run_ranks(channels, body) == [steps] * world
    for ch in channels:
        ch.close()


def test_local_work_runs_while_the_frames_travel_and_its_error_comes_after_them():
    """``meanwhile`` runs after the sockets took what they could; when it raises, the exchange still completes on
    both ranks (the peer is not left half-way) and the error reaches the caller."""
    a, b = mesh(2)
    big = 4 << 20

    def body(ch: HostChannel):
        def work():
            if ch.rank == 0:
                raise ValueError("local work failed")
            return "done"

        try:
            got, done = ch.exchange({1 - ch.rank: payload(ch.rank, 1 - ch.rank, 0, big)}, work)
        except ValueError as exc:
            assert ch.rank == 0
            return str(exc)
        assert torch.equal(got[0], payload(0, 1, 0, big))
        return done

    assert run_ranks([a, b], body) == ["local work failed", "done"]
    # the sockets are where they were: the next exchange works
    assert run_ranks([a, b], lambda ch: ch.exchange({1 - ch.rank: frame([])})[0][1 - ch.rank].numel()) == [8, 8]


def test_a_peer_that_closes_or_stays_silent_is_named():
    a, b = mesh(2, timeout_s=0.3)
    with pytest.raises(HostChannelError, match=r"rank 1 timed out after 0.3 s .*waiting for ranks \[0\]"):
        b.exchange({0: frame([])})
    a.close()
    with pytest.raises(HostChannelError, match="rank 0 closed its connection to rank 1"):
        b.exchange({0: frame([])})
    c, d = mesh(2)
    bad = torch.tensor([4], dtype=torch.int64).view(torch.uint8)  # a frame that says it has 4 bytes
    run_ranks([c], lambda ch: ch.peers[1].send(bad.numpy().tobytes()))
    with pytest.raises(HostChannelError, match="rank 0 sent a frame of 4 bytes"):
        d.exchange({0: frame([])})


def test_the_host_identity_is_this_boot_and_network_namespace():
    ident = host_identity()
    assert ident is not None and len(ident[0]) == 36 and ident == host_identity()  # a boot id is a UUID
    assert isinstance(ident[1], int) and ident[1] > 0
