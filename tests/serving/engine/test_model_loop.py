"""The model loop: one thread runs every request's steps round-robin and every call between two steps;
errors stay with their request or caller; close drops what is left and refuses more."""

from __future__ import annotations

import threading
import time

import pytest

from serving.engine.model_loop import LoopClosed, ModelLoop


def wait_until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def steps(name: str, n: int, log: list, threads: set, gate: threading.Event | None = None, inside=None):
    """n steps logging name0, name1, ...; with a gate, the second step signals `inside` and waits for it."""
    try:
        for i in range(n):
            if gate is not None and i == 1:
                inside.set()
                assert gate.wait(5)
            log.append(f"{name}{i}")
            threads.add(threading.current_thread())
            yield
    finally:
        log.append(f"{name}-end")


def block_loop(loop: ModelLoop) -> tuple[threading.Event, threading.Thread]:
    """Hold the loop thread inside a call until the returned event is set."""
    release, entered = threading.Event(), threading.Event()

    def hold():
        entered.set()
        assert release.wait(5)

    caller = threading.Thread(target=loop.call, args=(hold,))
    caller.start()
    assert entered.wait(5)
    return release, caller


def test_requests_take_turns_a_step_at_a_time_on_one_thread():
    loop, log, threads = ModelLoop(), [], set()
    release, caller = block_loop(loop)
    for name in "abc":
        loop.start(steps(name, 3 if name != "b" else 1, log, threads))
    release.set()
    caller.join(5)
    wait_until(lambda: len(log) == 10)
    assert log == ["a0", "b0", "c0", "a1", "b-end", "c1", "a2", "c2", "a-end", "c-end"]
    assert threads == {loop.thread}
    loop.close()


def test_a_call_runs_between_two_steps_and_returns_or_raises_to_its_caller():
    loop, log, threads = ModelLoop(), [], set()
    gate, inside = threading.Event(), threading.Event()
    loop.start(steps("a", 3, log, threads, gate, inside))
    assert inside.wait(5)  # a is inside its second step, waiting on the gate
    result: list = []
    caller = threading.Thread(target=lambda: result.append(loop.call(lambda: log.append("call") or 42)))
    caller.start()
    wait_until(lambda: len(loop._incoming) == 1)
    gate.set()
    caller.join(5)
    wait_until(lambda: log[-1] == "a-end")
    assert log == ["a0", "a1", "call", "a2", "a-end"] and result == [42]

    def fail():
        raise ValueError("bad block")

    with pytest.raises(ValueError, match="bad block"):
        loop.call(fail)
    assert loop.call(threading.current_thread) is loop.thread
    loop.close()


def test_a_request_that_raises_is_dropped_and_the_others_go_on(caplog):
    loop, log, threads = ModelLoop(), [], set()

    def broken():
        log.append("x0")
        yield
        raise RuntimeError("boom")

    release, caller = block_loop(loop)
    loop.start(broken())
    loop.start(steps("a", 3, log, threads))
    release.set()
    caller.join(5)
    wait_until(lambda: log[-1:] == ["a-end"])
    assert log == ["x0", "a0", "a1", "a2", "a-end"]
    assert "request dropped" in caplog.text and "boom" in caplog.text
    loop.close()


def test_close_ends_running_requests_and_refuses_new_work():
    loop, log, threads = ModelLoop(), [], set()
    gate, inside = threading.Event(), threading.Event()
    loop.start(steps("a", 3, log, threads, gate, inside))
    assert inside.wait(5)
    waiting: list = []

    def call_after_close():
        try:
            loop.call(lambda: log.append("never"))
        except LoopClosed as exc:
            waiting.append(exc)

    caller = threading.Thread(target=call_after_close)
    caller.start()
    wait_until(lambda: len(loop._incoming) == 1)
    loop.close()
    gate.set()
    caller.join(5)
    loop.thread.join(5)
    assert log == ["a0", "a1", "a-end"]  # the step in progress finished; the generator was closed
    assert len(waiting) == 1 and not loop.thread.is_alive()
    with pytest.raises(LoopClosed):
        loop.start(steps("b", 1, log, threads))
    with pytest.raises(LoopClosed):
        loop.call(lambda: None)
