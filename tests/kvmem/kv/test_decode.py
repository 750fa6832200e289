"""The decode loop's state is its own: generators advanced in turns on one thread (as the model loop does)
each run every forward under inference mode, build no autograd graph, and leave the thread's mode as found."""

from __future__ import annotations

import torch

from kvmem.kv import PromptLayout, Sampling, build_item, generate
from tests.conftest import ForwardLog


def test_interleaved_generators_each_run_every_step_in_inference_mode(tiny_handle):
    model, layout = tiny_handle.model, PromptLayout(tiny_handle.tokenizer)
    assert any(p.requires_grad for p in model.parameters())  # so a forward outside inference mode has grad
    memories = ["I live in Lisbon.", "My dog is called Miso."]
    item = build_item(tiny_handle, layout.block_ids(memories), user_id="u", memory_ids=["m1", "m2"])
    short = layout.prompt(memories, [], [{"role": "user", "content": "Hi"}])
    long = layout.prompt([], [], [{"role": "user", "content": "Tell me everything about my dog, please."}])
    alone = [
        list(generate(model, short.ids, item=item, sampling=Sampling(max_new_tokens=3))),
        list(generate(model, long.ids, sampling=Sampling(max_new_tokens=9))),
    ]
    log = ForwardLog(model)
    try:
        first = generate(model, short.ids, item=item, sampling=Sampling(max_new_tokens=3))
        second = generate(model, long.ids, sampling=Sampling(max_new_tokens=9))
        running, tokens = [first, second], {id(first): [], id(second): []}
        while running:  # one step each in turn, as the model loop does; `first` ends while `second` runs
            for gen in list(running):
                try:
                    tokens[id(gen)].append(next(gen))
                except StopIteration:
                    running.remove(gen)
        mode_after = torch.is_inference_mode_enabled()
    finally:
        log.remove()
    assert [tokens[id(first)], tokens[id(second)]] == alone
    assert len(log.calls) == 3 + 9
    assert [n > 1 for n, *_ in log.calls] == [True, True] + [False] * 10  # two prefills, then decode steps
    assert [tuple(state) for _, *state in log.calls] == [(True, False, False)] * 12
    assert mode_after is False
