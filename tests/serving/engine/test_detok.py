"""Incremental detokenization is exact: the streamed deltas add up to tokenizer.decode(all ids), at every
split of multi-byte characters, around special tokens and on random ids; and it decodes each token a bounded
number of times (linear, not quadratic, in the reply's length). The tiny llama of the tests shares the
default model's tokenizer, so this covers both."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.backends.base import GenerationRequest, GenerationResult, SamplingParams, TokenDelta
from serving.engine.detok import IncrementalDetokenizer
from serving.engine.stops import StopMatcher


def stream(tokenizer, ids: list[int]) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer)
    deltas = []
    for k, token in enumerate(ids):
        deltas.append(detok.add(token))
        # never ahead of, nor different from, the full decode of what has been generated so far
        assert tokenizer.decode(ids[: k + 1], skip_special_tokens=True).startswith("".join(deltas))
    deltas.append(detok.flush())
    return deltas, detok


@pytest.fixture(scope="module")
def pieces(tokenizer):
    """Ids whose own text is an incomplete character (byte-level BPE pieces of multi-byte characters)."""
    return [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]


_SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@_SETTINGS
@given(data=st.data())
def test_random_ids_stream_to_the_full_decode(tokenizer, pieces, data):
    ids = data.draw(
        st.lists(
            st.one_of(
                st.integers(0, len(tokenizer) - 1),
                st.sampled_from(pieces),
                st.sampled_from(tokenizer.all_special_ids),
            ),
            max_size=40,
        )
    )
    deltas, _ = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


@_SETTINGS
@given(text=st.text(max_size=60), cut=st.data())
def test_text_with_split_characters_streams_exactly(tokenizer, pieces, text, cut):
    """Real text (any unicode: accents, CJK, emoji) tokenized, with pieces of other characters and specials
    spliced in at random places, so characters split across tokens and around specials."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    extra = cut.draw(
        st.lists(st.tuples(st.integers(0, len(ids)), st.sampled_from(pieces + [0, 1, 2])), max_size=4)
    )
    for at, token in sorted(extra, reverse=True):
        ids.insert(at, token)
    deltas, _ = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


def test_split_emoji_is_held_back_until_complete(tokenizer):
    ids = tokenizer.encode("a 🎉 b", add_special_tokens=False)
    deltas, _ = stream(tokenizer, ids)
    assert "".join(deltas) == "a 🎉 b"
    assert all("\ufffd" not in d for d in deltas)
    assert " 🎉" in deltas  # emitted whole, once its last byte arrived
    # an incomplete character at the very end comes out as the full decode has it
    cut = ids[: ids.index(next(i for i in ids if "\ufffd" in tokenizer.decode([i]))) + 1]
    deltas, _ = stream(tokenizer, cut)
    assert deltas[-1].endswith("\ufffd") and "".join(deltas) == tokenizer.decode(cut)


def test_each_token_is_decoded_a_bounded_number_of_times(tokenizer):
    """Linear: a 2000-token reply decodes about 3 tokens per token, not the whole reply each time."""
    ids = tokenizer.encode(
        "The user likes hiking in Kyoto and baking sourdough. " * 200, add_special_tokens=False
    )
    ids = ids[:2000]
    deltas, detok = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert len(ids) == 2000 and detok.decoded_tokens <= 3 * len(ids)


@pytest.mark.parametrize("stop", ["🎉", "o K", "\n"])
def test_stop_strings_work_on_the_streamed_text(tokenizer, stop):
    text = "Hello Kyoto 🎉 and more\ntext after"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, stops = IncrementalDetokenizer(tokenizer), StopMatcher([stop])
    out = []
    for token in ids:
        ready, hit = stops.feed(detok.add(token))
        out.append(ready)
        if hit:
            break
    assert stops.hit and "".join(out) == text[: text.index(stop)]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_backend_streams_the_full_decode_of_its_tokens(tiny_backend, seed):
    """The random tiny llama sampling at temperature 1 produces arbitrary ids (pieces of characters too): the
    streamed text is exactly the decode of the token ids it streamed."""
    backend = tiny_backend
    prompt = backend.layout_prompt([], [], [{"role": "user", "content": "Say something"}], None)
    req = GenerationRequest(
        f"r{seed}", "u", prompt, None, SamplingParams(max_new_tokens=32 + seed, seed=seed)
    )

    async def run():
        return [item async for item in backend.stream(req)]

    items = asyncio.run(run())
    deltas = [x for x in items if isinstance(x, TokenDelta)]
    ids = [t for d in deltas for t in d.token_ids]
    assert isinstance(items[-1], GenerationResult) and items[-1].completion_tokens == len(ids) > 0
    text = "".join(d.text for d in deltas)
    assert text == backend.handle.tokenizer.decode(ids, skip_special_tokens=True)
