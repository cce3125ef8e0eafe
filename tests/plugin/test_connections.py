"""A response cycle's writes within one turn of the event loop reach the socket as one send."""

import asyncio

from omnigraph.plugin.api.connections import _CycleTransport


class _Transport:
    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.sent.append(data)

    def is_closing(self) -> bool:
        return self.closing


class _Protocol:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport = _Transport()
        self.closed_with: list[list[bytes]] = []

    def close_after_response(self) -> None:
        self.closed_with.append(list(self.transport.sent))


def test_a_head_and_its_body_go_out_in_one_send_and_close_sends_what_is_held_first():
    async def scenario() -> _Protocol:
        protocol = _Protocol(asyncio.get_running_loop())
        cycle = _CycleTransport(protocol)  # type: ignore[arg-type]
        cycle.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        cycle.write(b"{}")
        assert protocol.transport.sent == []  # held until the loop turns
        await asyncio.sleep(0)
        assert protocol.transport.sent == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
        cycle.write(b"HTTP/1.1 413 Content Too Large\r\n\r\n")
        cycle.close()  # a Connection: close answer: sent before the connection closes
        assert protocol.closed_with == [[protocol.transport.sent[0], b"HTTP/1.1 413 Content Too Large\r\n\r\n"]]
        await asyncio.sleep(0)  # the turn's flush finds nothing left
        assert len(protocol.transport.sent) == 2
        return protocol

    asyncio.run(scenario())


def test_nothing_is_written_to_a_closing_transport():
    async def scenario() -> None:
        protocol = _Protocol(asyncio.get_running_loop())
        cycle = _CycleTransport(protocol)  # type: ignore[arg-type]
        cycle.write(b"late")
        protocol.transport.closing = True  # the client hung up meanwhile
        await asyncio.sleep(0)
        assert protocol.transport.sent == []

    asyncio.run(scenario())
