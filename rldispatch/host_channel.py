"""Frames between the ranks of one host over loopback sockets, written and read by the calling thread.

gloo's point-to-point messages meet in a rendezvous that each process's gloo thread completes: a message leaves
only once the sender's thread has read the receiver's ready notice. On a host whose cores are all busy (every rank
computing between two exchanges) that thread waits for a core until the scheduler's next tick; on this project's
2-core CI machine a quarter to two thirds of a step's exchanges took 2-4 ms instead of 0.2 ms. A socket the
calling thread writes and reads needs no other thread: the kernel carries the bytes. The step's small exchanges
(:func:`rldispatch.collectives.exchange_frames`) take this path when every rank of the group shares this host's
loopback; other groups keep gloo's.
"""
from __future__ import annotations

import os
import selectors
import socket
import struct
import time
import weakref
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

__all__ = ["HostChannel", "HostChannelError", "host_channel", "set_host_channels", "host_identity"]

_HEAD = 8  # a frame starts with its own byte count (int64, the count included): rldispatch.collectives.frame
_LOOPBACK = "127.0.0.1"
_CONNECT_S = 60.0  # a loopback connection takes microseconds; a rank that cannot make one in this long falls back


class HostChannelError(RuntimeError):
    """A peer closed its connection or sent nothing for the channel's timeout."""


def host_identity() -> tuple[str, int] | None:
    """What ranks that share a loopback interface have in common: this boot of the machine and this network
    namespace (containers on one machine may not share loopback). None where Linux does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return boot, os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return None


class HostChannel:
    """One connected socket to each peer of a group whose ranks run on this host (index = group rank)."""

    def __init__(self, rank: int, peers: Mapping[int, socket.socket], timeout_s: float):
        self.rank, self.timeout_s = rank, timeout_s
        self.peers = dict(peers)
        self.exchanges = 0

    @classmethod
    def connect(cls, group: Any = None, timeout_s: float = 1800.0) -> "HostChannel | None":
        """Collective over ``group`` (gloo): connect every pair of its ranks, or None on every rank when the ranks
        do not all share this host's loopback or any rank could not connect (the caller keeps gloo then)."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((_LOOPBACK, 0))
        listener.listen(world)
        setup_s = min(timeout_s, _CONNECT_S)
        seen: list = [None] * world
        dist.all_gather_object(seen, (host_identity(), listener.getsockname()[1]), group=group)
        peers: dict[int, socket.socket] = {}
        ok = seen[0][0] is not None and all(ident == seen[0][0] for ident, _ in seen)
        try:
            if ok:
                peers = cls._pair_up(rank, world, listener, [port for _, port in seen], setup_s)
        except OSError:
            ok = False
        finally:
            listener.close()
        agreed: list = [None] * world
        dist.all_gather_object(agreed, ok, group=group)  # every rank takes the same path
        if not all(agreed):
            for s in peers.values():
                s.close()
            return None
        return cls(rank, peers, timeout_s)

    @staticmethod
    def _pair_up(rank: int, world: int, listener: socket.socket, ports: list[int], timeout_s: float
                 ) -> dict[int, socket.socket]:
        """Connect to every lower rank (saying who this is), accept every higher one (a listener's backlog takes a
        connection before its accept, so no order of the ranks can block); each step waits at most ``timeout_s``."""
        listener.settimeout(timeout_s)
        peers: dict[int, socket.socket] = {}
        for peer in range(rank):
            s = socket.create_connection((_LOOPBACK, ports[peer]), timeout=timeout_s)
            s.sendall(struct.pack("<q", rank))
            peers[peer] = s
        while len(peers) < world - 1:
            s, _ = listener.accept()
            s.settimeout(timeout_s)
            peer = struct.unpack("<q", _read_exactly(s, 8))[0]
            if not rank < peer < world or peer in peers:
                raise OSError(f"host channel: a connection said it was rank {peer}")
            peers[peer] = s
        for s in peers.values():
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setblocking(False)
        return peers

    def exchange(self, frames: Mapping[int, torch.Tensor], meanwhile: Callable[[], Any] | None = None
                 ) -> tuple[dict[int, torch.Tensor], Any]:
        """Send ``frames[peer]`` (a CPU uint8 frame) to every peer and receive each peer's frame; returns ({peer: its
        frame}, what ``meanwhile()`` returned). What the sockets take at once is written before ``meanwhile()``
        runs; the rest of the transfer completes after it, whatever it did."""
        self.exchanges += 1
        out = {p: memoryview(frames[p].contiguous().numpy()).cast("B") for p in self.peers}
        sent = dict.fromkeys(self.peers, 0)
        heads = {p: bytearray(_HEAD) for p in self.peers}
        got: dict[int, int] = dict.fromkeys(self.peers, 0)
        bufs: dict[int, torch.Tensor] = {}
        for p in self.peers:
            self._send_some(p, out[p], sent)
        try:
            done = meanwhile() if meanwhile is not None else None
        finally:
            self._complete(out, sent, heads, got, bufs)
        return bufs, done

    def _send_some(self, peer: int, data: memoryview, sent: dict[int, int]) -> None:
        try:
            while sent[peer] < len(data):
                sent[peer] += self.peers[peer].send(data[sent[peer]:])
        except BlockingIOError:
            pass
        except (BrokenPipeError, ConnectionResetError):
            raise self._closed(peer) from None

    def _recv_some(self, peer: int, heads: dict[int, bytearray], got: dict[int, int],
                   bufs: dict[int, torch.Tensor]) -> None:
        """Read what ``peer``'s socket holds of its frame, never past the frame's end (the next exchange's bytes
        stay in the socket)."""
        s = self.peers[peer]
        try:
            while True:
                if peer not in bufs:
                    n = s.recv_into(memoryview(heads[peer])[got[peer]:])
                    if n == 0:
                        raise self._closed(peer)
                    got[peer] += n
                    if got[peer] < _HEAD:
                        continue
                    total = struct.unpack("<q", heads[peer])[0]
                    if total < _HEAD:
                        raise HostChannelError(f"host channel: rank {peer} sent a frame of {total} bytes")
                    bufs[peer] = buf = torch.empty(total, dtype=torch.uint8)
                    buf[:_HEAD] = torch.frombuffer(heads[peer], dtype=torch.uint8)
                buf = bufs[peer]
                if got[peer] == buf.numel():
                    return
                n = s.recv_into(memoryview(buf.numpy()).cast("B")[got[peer]:])
                if n == 0:
                    raise self._closed(peer)
                got[peer] += n
        except BlockingIOError:
            pass
        except ConnectionResetError:
            raise self._closed(peer) from None

    def _closed(self, peer: int) -> HostChannelError:
        return HostChannelError(f"host channel: rank {peer} closed its connection to rank {self.rank} in the middle "
                                "of an exchange (it exited or failed; see its log)")

    def _complete(self, out: dict[int, memoryview], sent: dict[int, int], heads: dict[int, bytearray],
                  got: dict[int, int], bufs: dict[int, torch.Tensor]) -> None:
        def receiving(p: int) -> bool:
            return p not in bufs or got[p] < bufs[p].numel()

        def waits_for(p: int) -> int:
            """The socket events the exchange with ``p`` still waits for (0: done)."""
            return (selectors.EVENT_READ if receiving(p) else 0) | \
                (selectors.EVENT_WRITE if sent[p] < len(out[p]) else 0)

        deadline = time.monotonic() + self.timeout_s
        with selectors.DefaultSelector() as sel:
            for p, s in self.peers.items():
                self._recv_some(p, heads, got, bufs)
                if waits_for(p):
                    sel.register(s, waits_for(p), p)
            while sel.get_map():
                left = deadline - time.monotonic()
                ready = sel.select(timeout=max(left, 0.0))
                if not ready and left <= 0:
                    waiting = sorted(key.data for key in sel.get_map().values())
                    raise HostChannelError(f"host channel: rank {self.rank} timed out after {self.timeout_s:g} s "
                                           f"(trainer.dist_timeout_s) waiting for ranks {waiting} in an exchange; a "
                                           "peer is stuck or dead")
                for key, _ in ready:
                    p = key.data
                    if sent[p] < len(out[p]):
                        self._send_some(p, out[p], sent)
                    if receiving(p):
                        self._recv_some(p, heads, got, bufs)
                    events = waits_for(p)
                    if not events:
                        sel.unregister(key.fileobj)
                    elif events != key.events:
                        sel.modify(key.fileobj, events, p)

    def close(self) -> None:
        for s in self.peers.values():
            s.close()
        self.peers = {}


def _read_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise OSError("host channel: a peer closed its connection while connecting")
        data += chunk
    return data


_channels: "weakref.WeakKeyDictionary[Any, HostChannel | None]" = weakref.WeakKeyDictionary()
_settings = {"enabled": True, "timeout_s": 1800.0}


def set_host_channels(enabled: bool, timeout_s: float | None = None) -> None:
    """Whether groups whose ranks share this host exchange frames over loopback sockets (else gloo's point-to-point
    messages), and how long an exchange waits for a peer (the process group's timeout, ``trainer.dist_timeout_s``).
    Groups keep the channel they already have."""
    _settings["enabled"] = bool(enabled)
    if timeout_s is not None:
        _settings["timeout_s"] = float(timeout_s)


def host_channel(group: Any = None) -> HostChannel | None:
    """``group``'s channel, connected at its first exchange (a collective: every rank of the group calls it at the
    same point); None when channels are off or its ranks do not share this host."""
    if not _settings["enabled"]:
        return None
    pg = group if group is not None else dist.group.WORLD
    if pg not in _channels:
        _channels[pg] = HostChannel.connect(group, _settings["timeout_s"])
    return _channels[pg]
