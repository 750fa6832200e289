"""The distillation job on the tiny llama (mechanics, not learning): seeded training is reproducible bit for bit,
the caller's model is untouched, a version is written with its facts and gate figures, and an adapter the gates
refuse is never activated. The CLI's exit code and last line. Learning itself is tested on the real model
(tests/serving/test_lora_serving.py)."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

peft = pytest.importorskip("peft")

import torch  # noqa: E402

import kvmem.text  # noqa: E402
from kvmem.adapters import AdapterRegistry, text_sha  # noqa: E402
from kvmem.kv.layout import PromptLayout  # noqa: E402
from scheduler.distill.data import Example  # noqa: E402
from scheduler.distill.gates import GateConfig, fully_recalled  # noqa: E402
from scheduler.distill.job import DistillConfig, distill_user  # noqa: E402
from scheduler.distill.selection import SelectConfig  # noqa: E402
from scheduler.distill.train import StopRule, TrainConfig  # noqa: E402

FAST = DistillConfig(
    select=SelectConfig(max_facts=2),
    train=TrainConfig(max_steps=2, eval_every=1, batch_size=4, replay_tokens=4, answer_tokens=4, top_k=8),
    gates=GateConfig(generic_tokens=4, answer_tokens=4),
)


def _store(tmp_path):
    store = kvmem.text.MemoryStore(tmp_path / "memories.sqlite")
    ids = [
        store.add("alice", text=t)[0].id
        for t in ["My dog is called Miso.", "I live in Porto.", "I like rainy days.", "I work at Acme."]
    ]
    store.add("bob", text="My dog is called Rex.")
    return store, ids


def _run(tmp_path, handle, store, config=FAST):
    return distill_user(
        "alice",
        store=store,
        registry=AdapterRegistry(tmp_path / "adapters"),
        handle=handle,
        layout=PromptLayout(handle.tokenizer),
        stats={},
        now=time.time(),
        config=config,
        every=True,
    )


def test_a_refused_adapter_is_written_with_its_figures_and_never_activated(tmp_path, tiny_handle):
    store, ids = _store(tmp_path)
    before = {k: v.clone() for k, v in tiny_handle.model.state_dict().items()}
    outcome = _run(tmp_path, tiny_handle, store)
    after = tiny_handle.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and set(before) == set(after)
    assert not any("lora" in name for name, _ in tiny_handle.model.named_modules())
    m = outcome.manifest
    assert (m.version, m.user_id, m.seed, m.passed) == (1, "alice", 0, False)
    # the cap is 2 facts; equal heat orders by memory id
    chosen = sorted([ids[0], ids[1], ids[3]])[:2]
    texts = {ids[0]: "My dog is called Miso.", ids[1]: "I live in Porto.", ids[3]: "I work at Acme."}
    assert [f.memory_id for f in m.facts] == chosen
    assert [(f.version, f.text_sha) for f in m.facts] == [(1, text_sha(texts[i])) for i in chosen]
    assert dict(outcome.selection.skipped)[ids[2]] == "not a fact the distiller can phrase"
    assert m.base_fingerprint == tiny_handle.fingerprint.digest
    assert outcome.gates.recall_adapter == 0.0  # a random model recalls nothing
    assert m.reason.startswith("the adapter recalls none of the facts") and outcome.reason == m.reason
    assert (
        m.gates["recall_adapter"] == 0.0 and m.gates["num_questions"] == 4.0
    )  # 2 held-out templates per fact
    assert not outcome.activated
    assert sorted(m.train) == [
        "attempts",
        "best_step",
        "lora_scale",
        "steps",
        "stopped",
        "train_s",
        "valid_recall",
    ]
    assert m.train["lora_scale"] == 1.0  # refused by recall: never scaled
    # refused by the recall gate: no second attempt (a stronger replay would not teach it the facts)
    assert outcome.gates.failed[0] == "recall" and m.train["attempts"] == 1
    assert m.train["valid_recall"] == 0.0 and 1 <= m.train["best_step"] <= m.train["steps"] <= 2
    assert AdapterRegistry(tmp_path / "adapters").active("alice") is None
    summary = outcome.summary()
    assert list(summary)[:10] == [
        "adapter_id",
        "version",
        "num_facts",
        "recall_in_context",
        "recall_adapter",
        "recall_base",
        "greedy_agreement_generic",
        "kl_generic",
        "train_s",
        "activated",
    ]
    assert (summary["adapter_id"], summary["num_facts"], summary["activated"]) == (m.adapter_id, 2, False)
    # it fully recalled none of its facts: served for none (and refused)
    assert (summary["num_facts_served"], m.served_ids, m.gates["num_facts_served"]) == (0, (), 0.0)
    # seeded: a second run writes v2 with the very same weights
    again = _run(tmp_path, tiny_handle, store)
    assert again.manifest.version == 2 and again.manifest.sha256 == m.sha256


def test_a_memory_deleted_while_its_adapter_trains_leaves_no_version_on_disk(
    tmp_path, tiny_handle, monkeypatch
):
    import scheduler.distill.job as job

    store, _ = _store(tmp_path)
    train, deleted = job.train_adapter, []

    def deleting_meanwhile(model, tokenizer, layout, facts, *args, **kwargs):
        deleted.append(facts[0].memory_id)  # the cascade runs now, before the version it would erase exists
        assert store.delete("alice", deleted[0]) == 1
        return train(model, tokenizer, layout, facts, *args, **kwargs)

    monkeypatch.setattr(job, "train_adapter", deleting_meanwhile)
    outcome = _run(tmp_path, tiny_handle, store)
    registry = AdapterRegistry(tmp_path / "adapters")
    assert deleted[0] in outcome.manifest.memory_ids and not outcome.activated
    assert outcome.reason == f"memory {deleted[0]} was deleted"
    assert registry.versions("alice") == [] and not registry.path_of(outcome.manifest).exists()
    monkeypatch.setattr(job, "train_adapter", train)
    assert _run(tmp_path, tiny_handle, store).manifest.version == 2  # the erased number is not reused


def test_an_adapter_refused_by_the_damage_gate_alone_is_trained_once_more_with_a_stronger_replay(
    tmp_path, tiny_handle, monkeypatch
):
    """The job's retry policy. The tiny llama recalls nothing, so its first report is replaced by one where
    only the damage gate failed; both trainings and the second gates are real."""
    import scheduler.distill.job as job
    from scheduler.distill.gates import GateReport

    store, _ = _store(tmp_path)
    train, gates, configs, reports, given = job.train_adapter, job.run_gates, [], [], []

    def recording_train(model, tokenizer, layout, facts, examples, config, targets=None):
        configs.append(config)
        given.append(targets)
        return train(model, tokenizer, layout, facts, examples, config, targets)

    def damage_first(*args, **kwargs):
        real = gates(*args, **kwargs)
        if not reports:
            served = tuple(q.memory_id for q in args[4] if q.memory_id)
            real = GateReport(
                0.0,
                1.0,
                0.0,
                0.5,
                0.3,
                0,
                0,
                4,
                False,
                "greedy agreement on generic prompts 0.500 < 0.90",
                served_ids=served,
                failed=("damage",),
            )
        reports.append(real)
        return real

    monkeypatch.setattr(job, "train_adapter", recording_train)
    monkeypatch.setattr(job, "run_gates", damage_first)
    outcome = _run(tmp_path, tiny_handle, store)
    assert [(c.replay_batch_size, c.replay_weight) for c in configs] == [(2, 1.0), (4, 2.0)]
    assert configs[1] == FAST.train.stronger_replay()
    # the second attempt trains on the first one's base-model targets, not computed again
    assert given[0] is None and given[1] is not None and given[1].key[0] == FAST.train.targets_key()
    m = outcome.manifest
    # first gates, then the first adapter at scales 0.9 and 0.8 (real gates: the tiny llama recalls nothing, so
    # neither passes), then the retrained one (refused by recall: not scaled)
    assert len(reports) == 2 + len(FAST.damage_scales) and all(r.failed[0] == "recall" for r in reports[1:])
    assert outcome.gates is reports[-1] and m.reason == reports[-1].reason and m.train["attempts"] == 2
    assert m.train["lora_scale"] == 1.0
    assert m.train["first_attempt"]["reason"] == "greedy agreement on generic prompts 0.500 < 0.90"
    assert m.train["first_attempt"]["gates"]["greedy_agreement_generic"] == 0.5
    # only the kept attempt is written
    assert [v.version for v in AdapterRegistry(tmp_path / "adapters").versions("alice")] == [1]
    # switched off: the damage-refused adapter is written as it is
    reports.clear()
    configs.clear()
    off = _run(tmp_path, tiny_handle, store, replace(FAST, damage_retry=False, damage_scales=()))
    assert (len(configs), len(reports), off.manifest.train["attempts"], off.manifest.passed) == (
        1,
        1,
        1,
        False,
    )
    assert off.reason == "greedy agreement on generic prompts 0.500 < 0.90" and not off.activated
    # refused by the recall gate (the real gates): no second attempt
    configs.clear()
    monkeypatch.setattr(job, "run_gates", gates)
    assert _run(tmp_path, tiny_handle, store).manifest.train["attempts"] == 1 and len(configs) == 1


def test_an_adapter_refused_by_the_damage_gate_alone_is_kept_at_the_largest_scale_that_passes_every_gate(
    tmp_path, tiny_handle, monkeypatch
):
    """The first attempt fails only the damage gate, the same adapter at 0.9 fails again, at 0.8 it passes: no
    retraining, and what is written is the trained adapter with its LoRA deltas (B) times 0.8, bit for bit."""
    import safetensors.torch

    import scheduler.distill.job as job
    from scheduler.distill.gates import GateReport

    store, _ = _store(tmp_path)
    trainings, scales = [], []
    train = job.train_adapter

    def recording_train(*args, **kwargs):
        trainings.append(args[5])
        return train(*args, **kwargs)

    def fake_gates(model, tokenizer, layout, fact_texts, questions, unanswerable, config, base=None):
        b = next(p for n, p in model.named_parameters() if "lora_B" in n)
        scales.append(b.detach().clone())
        served = tuple(dict.fromkeys(q.memory_id for q in questions if q.memory_id))
        ok = len(scales) == 3
        return GateReport(
            1.0, 1.0, 0.0, 0.95 if ok else 0.89, 0.1, 0, 0, 4, ok,
            "" if ok else "greedy agreement on generic prompts 0.891 < 0.90",
            served_ids=served,
            failed=() if ok else ("damage",),
        )  # fmt: skip

    monkeypatch.setattr(job, "train_adapter", recording_train)
    monkeypatch.setattr(job, "run_gates", fake_gates)
    outcome = _run(tmp_path, tiny_handle, store)
    m = outcome.manifest
    assert len(trainings) == 1 and len(scales) == 3 and outcome.activated and m.passed
    assert (m.train["attempts"], m.train["lora_scale"]) == (1, 0.8)
    assert torch.equal(scales[1], scales[0] * 0.9) and torch.equal(scales[2], scales[0] * 0.8)
    registry = AdapterRegistry(tmp_path / "adapters")
    written = safetensors.torch.load_file(
        str(registry.version_dir("alice", m.version) / "adapter_model.safetensors")
    )
    full = _run(
        tmp_path, tiny_handle, store, replace(FAST, damage_scales=(), damage_retry=False)
    )  # same seed
    assert full.manifest.train["lora_scale"] == 1.0
    unscaled = safetensors.torch.load_file(
        str(registry.version_dir("alice", full.manifest.version) / "adapter_model.safetensors")
    )
    assert set(written) == set(unscaled) and any("lora_B" in k for k in written)
    for k, v in written.items():  # B scaled, A as trained
        assert torch.equal(v, unscaled[k] * 0.8 if "lora_B" in k else unscaled[k]), k


def test_damage_scales_must_decrease_within_zero_and_one():
    for bad in ((1.0,), (0.0,), (0.8, 0.9), (-0.5,)):
        with pytest.raises(ValueError, match="damage_scales"):
            DistillConfig(damage_scales=bad)
    assert DistillConfig().damage_scales == (0.9, 0.8) and DistillConfig(damage_scales=()).damage_scales == ()


def test_the_stronger_replay_doubles_the_replay_prompts_and_their_weight():
    base = TrainConfig(replay_batch_size=3, replay_weight=0.5, lr=1e-3)
    assert base.stronger_replay() == TrainConfig(replay_batch_size=6, replay_weight=1.0, lr=1e-3)
    assert TrainConfig(replay_batch_size=0).stronger_replay() is None
    assert TrainConfig(replay_weight=0.0).stronger_replay() is None


def test_a_second_attempt_on_the_first_ones_targets_trains_exactly_as_if_it_computed_them(tiny_handle):
    import peft

    from scheduler.distill.data import parse_fact, training_examples
    from scheduler.distill.train import train_adapter

    layout = PromptLayout(tiny_handle.tokenizer)
    facts = [parse_fact("m1", 1, "My dog is called Miso."), parse_fact("m2", 1, "I live in Porto.")]
    examples = training_examples(facts, seed=0)
    stronger = FAST.train.stronger_replay()

    def train(config, targets=None):
        return train_adapter(
            tiny_handle.model, tiny_handle.tokenizer, layout, facts, examples, config, targets
        )

    first = train(FAST.train)
    fresh, reused = train(stronger), train(stronger, first.targets)
    a, b = (peft.get_peft_model_state_dict(r.model) for r in (fresh, reused))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert (fresh.steps, fresh.losses, fresh.valid_recall) == (
        reused.steps,
        reused.losses,
        reused.valid_recall,
    )
    # targets of other facts, or of other target settings, are refused
    with pytest.raises(ValueError, match="targets were computed for other facts"):
        train_adapter(
            tiny_handle.model, tiny_handle.tokenizer, layout, facts[:1], examples, stronger, first.targets
        )
    with pytest.raises(ValueError, match="targets_key"):
        train(replace(stronger, top_k=4), first.targets)


def test_gates_given_the_base_models_figures_report_exactly_what_they_measure_themselves(tiny_handle):
    """The job measures the base model's side once and gates every attempt and scale against it: the report is
    the same as gates measuring it all, for an adapter whose damage figures are not trivial (B perturbed)."""
    from scheduler.distill.data import gate_questions, parse_fact, training_examples, unanswerable_gate
    from scheduler.distill.gates import base_figures, run_gates
    from scheduler.distill.train import train_adapter

    tok, layout = tiny_handle.tokenizer, PromptLayout(tiny_handle.tokenizer)
    facts = [parse_fact("m1", 1, "My dog is called Miso."), parse_fact("m2", 1, "I live in Porto.")]
    model = train_adapter(
        tiny_handle.model, tok, layout, facts, training_examples(facts, seed=0), FAST.train
    ).model
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    texts, questions, unanswerable = (
        [f.text for f in facts],
        gate_questions(facts, seed=1),
        unanswerable_gate(facts),
    )
    base = base_figures(model, tok, layout, texts, questions, unanswerable, FAST.gates)
    assert len(base.generic) > 0 and all(len(cont) <= FAST.gates.generic_tokens for _, cont in base.generic)
    alone = run_gates(model, tok, layout, texts, questions, unanswerable, FAST.gates)
    given = run_gates(model, tok, layout, texts, questions, unanswerable, FAST.gates, base=base)
    assert given == alone and alone.kl_generic > 0


def test_the_job_measures_the_base_models_figures_once_for_every_attempt_and_scale(
    tmp_path, tiny_handle, monkeypatch
):
    import scheduler.distill.job as job
    from scheduler.distill.gates import GateReport

    store, _ = _store(tmp_path)
    measured, reports, gates, base_figures = [], [], job.run_gates, job.base_figures

    def counting_base(*args):
        measured.append(base_figures(*args))
        return measured[-1]

    def damage_only(*args, base=None):
        reports.append(base)
        real = gates(*args, base=base)
        served = tuple(q.memory_id for q in args[4] if q.memory_id)
        return GateReport(0.0, 1.0, 0.0, 0.5, real.kl_generic, 0, 0, 4, False, "damage", served, ("damage",))

    monkeypatch.setattr(job, "base_figures", counting_base)
    monkeypatch.setattr(job, "run_gates", damage_only)
    _run(tmp_path, tiny_handle, store)
    # two trainings, each gated unscaled and at both scales, all against the one measurement
    assert len(measured) == 1 and len(reports) == 2 * (1 + len(FAST.damage_scales))
    assert all(b is measured[0] for b in reports)


def test_nothing_selected_trains_nothing(tmp_path, tiny_handle):
    store = kvmem.text.MemoryStore(tmp_path / "memories.sqlite")
    store.add("alice", text="I like rainy days.")
    outcome = _run(tmp_path, tiny_handle, store)
    assert (outcome.manifest, outcome.activated, outcome.reason) == (None, False, "no memory was selected")
    assert not (tmp_path / "adapters").exists()


@pytest.mark.slow
def test_the_cli_prints_a_table_then_one_json_line_and_exits_3_when_refused(tmp_path, tiny_handle, capsys):
    from serving.ops.cli import main

    model_dir = tmp_path / "tiny"
    tiny_handle.model.save_pretrained(str(model_dir))
    tiny_handle.tokenizer.save_pretrained(str(model_dir))
    store, ids = _store(tmp_path / "data")
    store.close()
    argv = ["distill", "--data-dir", str(tmp_path / "data"), "--user-id", "alice", "--all"]
    code = main([*argv, "--model", str(model_dir), "--max-steps", "1", "--max-facts", "1"])
    out = capsys.readouterr().out.strip().splitlines()
    last = json.loads(out[-1])
    assert code == 3
    assert (last["version"], last["num_facts"], last["activated"], last["recall_in_context"]) == (
        1,
        1,
        False,
        0.0,
    )
    assert any("skipped: not a fact the distiller can phrase" in line for line in out[:-1])
    assert any(
        line.split()[-3:] == ["0", "of", "1"] for line in out if "facts served from the adapter" in line
    )
    assert last["num_facts_served"] == 0
    assert main(["distill", "--data-dir", str(tmp_path / "nowhere"), "--user-id", "alice"]) == 2
    assert "no memories at" in capsys.readouterr().err


def test_an_unanswerable_question_is_trained_toward_a_declining_reply(tiny_handle):
    from scheduler.distill.data import DONT_KNOW, UNANSWERABLE_TRAIN, Example, declines
    from scheduler.distill.train import _declining_reply, chat_ids, greedy_text, reply_ids

    layout, tok, model = PromptLayout(tiny_handle.tokenizer), tiny_handle.tokenizer, tiny_handle.model
    config = TrainConfig(replay_tokens=6, top_k=8)
    question = UNANSWERABLE_TRAIN[0]
    prompt = chat_ids(layout, [], question)
    assert not declines(greedy_text(model, tok, prompt, 6))  # a random model does not decline...
    seq = _declining_reply(
        model, tok, layout, Example(None, "unanswerable", question, DONT_KNOW, None), config
    )
    # ...so its target is the declining reply, cross-entropy only (the base model never produced it)
    assert seq.ids == prompt + reply_ids(tok, DONT_KNOW) and seq.n == len(reply_ids(tok, DONT_KNOW))
    assert (seq.ce, seq.kl) == (True, False)


def test_an_adapter_is_served_only_for_the_facts_whose_every_gate_question_it_answered():
    def q(memory_id):
        return Example(memory_id, "question", "?", "", "x")

    questions = [q("b"), q("a"), q("c"), q(None), q("a"), q("b"), q("c")]
    hits = [True, True, False, False, True, True, True]
    assert fully_recalled(questions, hits) == ("b", "a")  # c missed one of its two; None is no fact
    assert fully_recalled(questions, [False] * 7) == ()
    with pytest.raises(ValueError):
        fully_recalled(questions, hits[:-1])


def test_the_job_says_what_it_does_as_it_goes(tmp_path, tiny_handle, caplog):
    """Issue 27 item 17 (`kvmem distill` printed nothing for 5 minutes): each stage is logged at INFO as it
    starts or ends (the CLI shows INFO): selection, the base model's targets, every validated step, the
    training's end and the gates, the gates' figures."""
    import logging

    store, _ = _store(tmp_path)
    with caplog.at_level(logging.INFO, logger="scheduler.distill"):
        _run(tmp_path, tiny_handle, store)
    said = [r.getMessage() for r in caplog.records if r.name.startswith("scheduler.distill")]
    stages = [
        "user 'alice': 2 of 4 memories selected to distill",
        "distill: the base model's targets for 2 facts' prompts (the teacher sees the facts); then up to 2 "
        "steps, validated every 1",
        "distill step 1/2",
        "distill step 2/2",
        "user 'alice': trained (2 steps, ",
        "; the gates: 4 questions, ",  # and n unanswerable: n depends on what drew random numbers before
        " gates: {'recall_in_context': 0.0,",
    ]
    found = [next(i for i, m in enumerate(said) if m.startswith(s) or s in m) for s in stages]
    assert found == sorted(found), said


def _walk(figures, recalled_evals=3, patience=4):
    """(the evaluations kept, the one stopped at and why) over (score, all recalled) per evaluation."""
    rule, kept = StopRule(recalled_evals=recalled_evals, patience=patience), []
    for i, (score, all_recalled) in enumerate(figures):
        keep, stop = rule.observe(score, all_recalled)
        kept += [i] if keep else []
        if stop is not None:
            return kept, (i, stop)
    return kept, None


def test_stop_rule_recalled_in_a_row_keeps_the_latest():
    full = (1.0, True)
    assert _walk([(0.67, False), (0.83, False), full, full, full, full]) == ([0, 1, 2, 3, 4], (4, "recalled"))
    # a full-recall point broken by a miss starts the count again (and the patience runs from the first)
    broken = [full, full, (0.83, False), full, full, full]
    assert _walk(broken, patience=6) == ([0, 1, 3, 4, 5], (5, "recalled"))
    assert _walk(broken) == ([0, 1, 3, 4], (4, "plateau"))


def test_stop_rule_an_equal_full_recall_point_is_kept_but_does_not_restart_patience():
    """Recall swinging between full and not (six facts): it stops `patience` evaluations after the first full
    recall, with the latest full-recall weights; a tie restarting the patience trained to max_steps."""
    swing = [(0.5, False), (1.0, True), (0.83, False), (1.0, True), (0.67, False), (1.0, True), (0.83, False)]
    assert _walk(swing) == ([0, 1, 3, 5], (5, "plateau"))
    assert _walk(swing, patience=5) == ([0, 1, 3, 5], (6, "plateau"))


def test_stop_rule_ties_without_full_recall_are_not_kept():
    figures = [(0.5, False), (0.6, False), (0.6, False), (0.55, False), (0.6, False), (0.6, False)]
    assert _walk(figures) == ([0, 1], (5, "plateau"))
    # a better score restarts the patience; full recall with more confident wrong answers is not full recall
    assert _walk([(0.5, False), (0.6, False), (0.6, False), (0.7, False), (0.0, False)], patience=2) == (
        [0, 1, 3],
        None,
    )
    assert _walk([(0.0, False), (1.0, False), (1.0, False), (1.0, False), (1.0, False), (1.0, False)]) == (
        [0, 1],
        (5, "plateau"),
    )


def test_kvmem_distill_trains_as_many_steps_as_the_server_by_default():
    from scheduler.distill.cli import _parser
    from scheduler.distill.train import TrainConfig

    args = _parser().parse_args(["--user-id", "alice"])
    assert args.max_steps == TrainConfig().max_steps == 300


@pytest.mark.parametrize(
    ("reply", "answer"),
    [
        ("Your ferret is called Quillibert.", "Quillibert"),
        ("Feverfew gives you an allergic reaction.", "feverfew"),
        ('You told me: "I work at Vostrel Kinetics."', "Vostrel Kinetics"),
    ],
)
def test_the_teachers_kl_skips_exactly_the_tokens_that_spell_the_answer(tiny_handle, reply, answer):
    from scheduler.distill.train import answer_free, reply_ids

    tok = tiny_handle.tokenizer
    ids = reply_ids(tok, reply)
    mask = answer_free(tok, ids, answer)
    assert mask.shape == (len(ids),) and set(mask.tolist()) == {0.0, 1.0}
    skipped = [i for i, m in zip(ids, mask.tolist(), strict=True) if m == 0.0]
    kept = [i for i, m in zip(ids, mask.tolist(), strict=True) if m == 1.0]
    assert tok.decode(skipped).strip() == reply[reply.lower().find(answer.lower()) :][: len(answer)]
    assert answer.lower() not in tok.decode(kept).lower()
    assert answer_free(tok, ids, None) is None and answer_free(tok, ids, "Porto") is None


def test_the_kl_mask_drops_exactly_those_positions_from_the_loss(tiny_handle):
    from scheduler.distill.train import _loss, _Seq, _top_k

    torch.manual_seed(0)
    teacher = tiny_handle.model
    ids = list(range(10, 22))
    logp, idx = _top_k(teacher, ids, 5, 8)
    # a student that differs from the teacher, so every position's KL is above 0
    student = type(teacher)(teacher.config).eval()

    @torch.no_grad()
    def loss(mask):
        return float(_loss(student, [(_Seq(ids, 5, logp, idx, kl_mask=mask), 1.0, 0.0)]))

    full = loss(None)
    assert full > 0 and loss(torch.ones(5)) == pytest.approx(full, rel=1e-6)
    assert loss(torch.zeros(5)) == 0.0
    parts = [loss(torch.eye(5)[k]) for k in range(5)]  # one position each
    assert all(p > 0 for p in parts) and sum(parts) == pytest.approx(full, rel=1e-5)
    assert loss(torch.tensor([1.0, 1, 0, 0, 1])) == pytest.approx(parts[0] + parts[1] + parts[4], rel=1e-5)
