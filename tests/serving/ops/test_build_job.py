"""`kvmem build --input` (serving.ops.offline_build.run_build): builds every good line, reports bad lines by
number and carries on, exits 1 if any failed, resumes (valid items skipped, corrupt ones rebuilt)."""

from __future__ import annotations

import json

import pytest

from benchmarks.ttft.ttft_grid import reference_tokens
from kvmem.kv import KVStoreConfig, PromptLayout, TieredKVStore
from kvmem.kv.io import item_paths, load_item
from kvmem.kv.item import item_id_for
from kvmem.text import HashEmbedder, MemoryStore
from serving.ops.build_cli import main
from serving.ops.offline_build import add_missing


def write_lines(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")


def stored_memories(data, user):
    from kvmem.text import MemoryStore

    with MemoryStore(data / "memories.sqlite") as store:
        return store.list(user, page_size=100).items


def expected_id(handle, data, user):
    """The block the server's policy serves for memories added together (equal heat): all of them, ordered
    by memory id (choose_block's tie-break), addressed by the user's store ids."""
    mems = sorted(stored_memories(data, user), key=lambda m: m.id)
    ids = PromptLayout(handle.tokenizer).block_ids([m.text for m in mems])
    return item_id_for(user, handle.fingerprint, tuple(ids), tuple(m.id for m in mems))


def test_build_reports_bad_lines_and_resumes(tmp_path, tiny_model_dir, tiny_handle, capsys):
    from kvmem.models import load_model

    handle = load_model(str(tiny_model_dir))  # reloaded from disk: same weights, same fingerprint
    assert handle.fingerprint == tiny_handle.fingerprint
    src = tmp_path / "blocks.jsonl"
    good = [
        {"user_id": "alice", "memories": ["I live in Lisbon.", "I have a cat named Miso."]},
        {"user_id": "bob", "memories": ["I play the violin."]},
    ]
    write_lines(
        src,
        [
            good[0],
            "{not json",
            {"user_id": "", "memories": ["x"]},
            {"user_id": "carol", "memories": []},
            good[1],
            {"user_id": "dave", "memories": ["a"], "memory_ids": ["b"]},
        ],
    )
    data = tmp_path / "data"
    argv = ["--input", str(src), "--model", str(tiny_model_dir), "--data-dir", str(data), "--no-progress"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    for line_no, text in [
        (2, "not valid JSON"),
        (3, "'user_id' must be a non-empty string"),
        (4, "'memories' must be a non-empty list"),
        (6, "exactly one of"),
    ]:
        assert f"line {line_no}: {text}" in err
    assert "built 2, skipped 0 (already valid), failed 4; added 3 memories to the store (model loaded)" in err
    ids = [expected_id(handle, data, g["user_id"]) for g in good]
    kv_dir = data / "kv"
    store = TieredKVStore(KVStoreConfig(directory=str(kv_dir)), handle.fingerprint)
    assert store.item_ids() == sorted(ids)

    # resume: valid items are skipped; a corrupted one is rebuilt identically
    tensor_path, _ = item_paths(kv_dir, ids[1])
    raw = bytearray(tensor_path.read_bytes())
    raw[-5] ^= 0xFF
    tensor_path.write_bytes(bytes(raw))
    write_lines(src, good)
    assert main(argv) == 0
    assert "built 1, skipped 1 (already valid), failed 0 (model loaded)" in capsys.readouterr().err
    rebuilt = load_item(kv_dir, ids[1], handle.fingerprint)
    assert rebuilt.meta.memory_ids == tuple(m.id for m in stored_memories(data, "bob"))
    # idempotent: the texts were not added again
    assert sorted(m.text for m in stored_memories(data, "alice")) == sorted(good[0]["memories"])
    assert [m.text for m in stored_memories(data, "bob")] == ["I play the violin."]

    # nothing to build: the weights are not loaded (the fingerprint comes from the cache)
    assert main(argv) == 0
    assert "built 0, skipped 2 (already valid), failed 0 (model not loaded)" in capsys.readouterr().err


def test_missing_input_file_is_exit_2(tmp_path, capsys):
    assert main(["--input", str(tmp_path / "nope.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_unknown_model_path_is_exit_1(tmp_path, capsys):
    src = tmp_path / "b.jsonl"
    write_lines(src, [{"user_id": "a", "memories": ["x"]}])
    assert (
        main(["--input", str(src), "--model", str(tmp_path / "no-such-model"), "--data-dir", str(tmp_path)])
        == 1
    )
    assert "does not exist" in capsys.readouterr().err


def test_a_quota_below_one_mib_is_exit_2_naming_it(tmp_path, capsys):
    assert main(["--data-dir", str(tmp_path), "--kv-user-mb", "0"]) == 2
    assert capsys.readouterr().err == "kvmem build: --kv-user-mb must be >= 1 (MiB), got 0\n"


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as exc:
        main(["--bogus"])
    assert exc.value.code == 2


def test_built_item_serves_exact_generation(tmp_path, tiny_model_dir, tiny_handle):
    """End to end: an item from the offline job, loaded from disk, gives the reference tokens."""
    from kvmem.kv import Sampling, generate

    src = tmp_path / "b.jsonl"
    texts = ["I live in Lisbon.", "I have a cat named Miso."]
    write_lines(src, [{"user_id": "alice", "memories": texts}])
    assert (
        main(
            [
                "--input",
                str(src),
                "--model",
                str(tiny_model_dir),
                "--data-dir",
                str(tmp_path),
                "--no-progress",
            ]
        )
        == 0
    )
    item = load_item(tmp_path / "kv", expected_id(tiny_handle, tmp_path, "alice"), tiny_handle.fingerprint)
    block_texts = [m.text for m in sorted(stored_memories(tmp_path, "alice"), key=lambda m: m.id)]
    messages = [{"role": "user", "content": "Pet name?"}]
    prompt = PromptLayout(tiny_handle.tokenizer).prompt(block_texts, [], messages)
    ours = list(generate(tiny_handle.model, prompt.ids, item=item, sampling=Sampling(max_new_tokens=6)))
    assert ours == reference_tokens(tiny_handle.model, list(prompt.ids), 6, "cpu")


# A rerun of `kvmem build --input` (the documented resume) added again a text the user had archived or a newer
# memory had superseded: the stale fact was served again.


def _served_texts(store, user):
    return sorted(m.text for m in store.list(user, page_size=100).items)


def test_rerun_does_not_resurrect_an_archived_memory(tmp_path):
    with MemoryStore(tmp_path / "m.db", embedder=HashEmbedder()) as store:
        assert add_missing(store, "alice", ["I live in Oslo", "I have a cat"]) == 2
        oslo = next(m for m in store.list("alice", page_size=100).items if m.text == "I live in Oslo")
        store.update("alice", oslo.id, state="archived")  # the user archived it: no longer served
        assert _served_texts(store, "alice") == ["I have a cat"]
        # the operator re-runs the same input file (resume after a failed line)
        added = add_missing(store, "alice", ["I live in Oslo", "I have a cat"])
        assert added == 0, "the archived memory was added again as a new active memory"
        assert _served_texts(store, "alice") == ["I have a cat"]


def test_rerun_does_not_resurrect_a_superseded_memory(tmp_path):
    with MemoryStore(tmp_path / "m.db", embedder=HashEmbedder()) as store:
        assert add_missing(store, "alice", ["I live in Oslo"]) == 1
        [old] = store.list("alice").items
        [new] = store.add("alice", "I live in Bergen")
        store.supersede("alice", old.id, new.id)  # what formation does when the user moves
        assert _served_texts(store, "alice") == ["I live in Bergen"]
        added = add_missing(store, "alice", ["I live in Oslo"])
        assert added == 0, "the superseded memory was added again"
        # the stale fact is served again beside the new one
        assert _served_texts(store, "alice") == ["I live in Bergen"]
