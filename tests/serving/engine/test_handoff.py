"""serving/engine/handoff.py: a model-loop turn's items reach their streams in one event-loop hop per loop, in
order per stream; a stream's reader takes everything there at once, or waits until its timeout."""

from __future__ import annotations

import asyncio
import threading

from serving.engine.handoff import Handoff, Inbox


def counting(loop: asyncio.AbstractEventLoop) -> list:
    """The handoff's callbacks handed to `loop` from other threads (its call_soon_threadsafe, counted)."""
    hops, real = [], loop.call_soon_threadsafe

    def hop(callback, *args):
        if callback.__name__ == "_deliver":  # the handoff's (not asyncio.to_thread's own)
            hops.append(callback)
        return real(callback, *args)

    loop.call_soon_threadsafe = hop  # type: ignore[method-assign]
    return hops


def test_a_turns_items_reach_each_stream_in_order_in_one_hop():
    async def main():
        loop = asyncio.get_running_loop()
        hops = counting(loop)
        handoff, a, b = Handoff(), Inbox(loop), Inbox(loop)

        def turn():  # as the model thread does: items of two streams, then the flush
            for item in ("a1", "b1", "a2", "a3", "b2"):
                handoff.put(a if item[0] == "a" else b, item)
            handoff.flush()
            handoff.flush()  # nothing left: no hop

        await asyncio.to_thread(turn)
        assert len(hops) == 1
        assert await a.take(1.0) == ["a1", "a2", "a3"]
        assert await b.take(1.0) == ["b1", "b2"]
        assert await a.take(0.01) == []  # taken: nothing more within the timeout

    asyncio.run(main())


def test_a_reader_waits_for_the_next_flush():
    async def main():
        loop = asyncio.get_running_loop()
        handoff, inbox = Handoff(), Inbox(loop)
        go = threading.Event()

        def model_thread():
            handoff.put(inbox, 1)
            go.wait(10)  # not delivered before the flush
            handoff.put(inbox, 2)
            handoff.flush()

        thread = threading.Thread(target=model_thread)
        thread.start()
        assert await inbox.take(0.05) == []
        go.set()
        assert await inbox.take(10) == [1, 2]
        thread.join(10)

    asyncio.run(main())


def test_a_flush_to_a_closed_loop_drops_its_items_and_keeps_the_others():
    closed = asyncio.new_event_loop()
    gone = Inbox(closed)
    closed.close()

    async def main():
        loop = asyncio.get_running_loop()
        handoff, inbox = Handoff(), Inbox(loop)
        handoff.put(gone, "lost")
        handoff.put(inbox, "kept")
        await asyncio.to_thread(handoff.flush)
        assert await inbox.take(1.0) == ["kept"]

    asyncio.run(main())
