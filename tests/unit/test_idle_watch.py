"""The idle-stream watch is one thread for all of a server's streams: one call that raises while
it is ended (its peer gone, say) must not end the watch for every stream after it."""

from __future__ import annotations

import logging
import time

from fedrl.wire.streams import _IdleWatch


class _Context:
    def __init__(self, peer_raises: bool) -> None:
        self.peer_raises = peer_raises
        self._fedrl_idle = False

    def peer(self) -> str:
        if self.peer_raises:
            raise RuntimeError("the call is gone")
        return "ipv4:127.0.0.1:1"


def test_a_call_that_raises_as_it_is_ended_stops_no_other_streams_watch(caplog):
    watch = _IdleWatch(limit=0.05)
    broken, later = _Context(peer_raises=True), _Context(peer_raises=False)
    with caplog.at_level(logging.WARNING, logger="fedrl"):
        watch.reading(broken, "/fedrl.v1.Federation/SubmitUpdate")
        end = time.monotonic() + 60
        while "ending an idle stream raised" not in caplog.text and time.monotonic() < end:
            time.sleep(0.01)
        assert "ending an idle stream raised" in caplog.text
        watch.reading(later, "/fedrl.v1.Federation/SubmitUpdate")  # idle after the broken one was seen
        while not later._fedrl_idle and time.monotonic() < end:
            time.sleep(0.01)
    assert later._fedrl_idle and watch._thread.is_alive()
