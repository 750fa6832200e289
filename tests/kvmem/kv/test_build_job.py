"""`kvmem build`: builds every good line, reports bad lines by number and carries on, exits 1 if any
failed, resumes (valid items skipped, corrupt ones rebuilt)."""

from __future__ import annotations

import json

import pytest

from benchmarks.ttft_grid import reference_tokens
from kvmem.kv import KVStoreConfig, PromptLayout, TieredKVStore
from kvmem.kv.blocks import text_memory_id
from kvmem.kv.build_cli import main
from kvmem.kv.io import item_paths, load_item
from kvmem.kv.item import item_id_for


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tiny_handle):
    d = tmp_path_factory.mktemp("tiny-model")
    tiny_handle.model.save_pretrained(d)
    tiny_handle.tokenizer.save_pretrained(d)
    return d


def write_lines(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")


def expected_id(handle, user, texts):
    ids = PromptLayout(handle.tokenizer).block_ids(texts)
    return item_id_for(user, handle.fingerprint, tuple(ids), tuple(text_memory_id(t) for t in texts))


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
    assert "built 2, skipped 0 (already valid), failed 4" in err
    ids = [expected_id(handle, g["user_id"], g["memories"]) for g in good]
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
    assert "built 1, skipped 1 (already valid), failed 0" in capsys.readouterr().err
    rebuilt = load_item(kv_dir, ids[1], handle.fingerprint)
    assert rebuilt.meta.memory_ids == (text_memory_id("I play the violin."),)


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
    item = load_item(tmp_path / "kv", expected_id(tiny_handle, "alice", texts), tiny_handle.fingerprint)
    prompt = PromptLayout(tiny_handle.tokenizer).prompt(texts, [], [{"role": "user", "content": "Pet name?"}])
    ours = list(generate(tiny_handle.model, prompt.ids, item=item, sampling=Sampling(max_new_tokens=6)))
    assert ours == reference_tokens(tiny_handle.model, list(prompt.ids), 6, "cpu")
