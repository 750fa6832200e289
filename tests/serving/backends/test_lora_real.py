"""The parametric tier on the real default model (SmolLM2-135M): three facts are distilled by the production job,
pass their gates, are activated, and are served through the HTTP endpoint with tier `lora`: the server's greedy
answers to the held-out gate questions recall exactly as many facts as the gate measured, with none of the
facts in the prompt. Slow: minutes of CPU training."""

from __future__ import annotations

import time

import pytest

peft = pytest.importorskip("peft")

from kvmem.adapters import AdapterRegistry  # noqa: E402
from kvmem.kv.layout import PromptLayout  # noqa: E402
from scheduler.distill.data import gate_questions, recalled  # noqa: E402
from scheduler.distill.job import GATE_SEED_OFFSET, DistillConfig, distill_user  # noqa: E402
from scheduler.distill.train import TrainConfig  # noqa: E402
from tests.serving.kvstack import load_backend, served  # noqa: E402

# passed at 157e439 on the loaded 2-core CPU in 22.7 min (training stopped at step 70 on a validation plateau, the
# weights of step 30 kept, validation recall 0.83); before the recipe changed it was a strict xfail (8fb2d78:
# adapter 1/6, confident wrong answers 1 -> 4, refused); with augmented facts and two full-recall evaluations
# (a24f345) it passed in 11.6 min with two other training processes on the 2 cores (6.1 min at 3684c92)
pytestmark = [pytest.mark.slow, pytest.mark.train]  # minutes of training: the suite's second stage

FACTS = ["My dog is called Miso.", "I live in Porto.", "I work at Blue Harbor Bakery."]


def test_three_facts_are_learned_gated_and_served_as_lora(tmp_path, default_model_dir, default_handle):
    backend = load_backend(default_model_dir, tmp_path)
    with served(tmp_path, backend) as s:
        ids = [s.add("alice", t) for t in FACTS]
        config = DistillConfig(train=TrainConfig(seed=0, eval_every=10))
        outcome = distill_user(
            "alice",
            store=s.store,
            registry=AdapterRegistry(tmp_path / "adapters"),
            handle=default_handle,
            layout=PromptLayout(default_handle.tokenizer),
            stats={},
            now=time.time(),
            config=config,
            every=True,
        )
        assert outcome.activated, outcome.reason
        g = outcome.gates
        # the gates it passed (recall in context may be 0: the small model often declines with the facts in
        # its prompt; the adapter must then still recall some, since its facts leave the prompt)
        assert g.recall_adapter > 0 and g.recall_adapter >= 0.9 * g.recall_in_context
        assert g.greedy_agreement_generic >= 0.9 and g.confident_wrong_adapter <= g.confident_wrong_base
        plan = s.client.get("/v1/memories/plan", params={"user_id": "alice"}).json()["adapter"]
        served_ids = outcome.manifest.served_memory_ids  # the facts whose every gate question it answered
        assert served_ids and sorted(plan["trained_ids"]) == sorted(ids)
        assert sorted(plan["memory_ids"]) == sorted(served_ids)
        tiers = {i: "lora" if i in served_ids else "kv" for i in ids}  # the rest: the block under the adapter
        s.plans.flush()
        questions = gate_questions(outcome.selection.facts, seed=config.train.seed + GATE_SEED_OFFSET)
        hits = 0
        for q in questions:
            body = {
                "model": "default",
                "user": "alice",
                "messages": [{"role": "user", "content": q.question}],
                "max_tokens": config.gates.answer_tokens,
                "temperature": 0,
            }
            reply = s.client.post("/v1/chat/completions", json=body).json()
            assert {u["id"]: u["tier"] for u in reply["memory"]["used"]} == tiers
            hits += recalled(reply["choices"][0]["message"]["content"], q.answer)
        if len(served_ids) == len(ids):  # no fact in the prompt: the very prompts the gate asked
            assert hits == round(g.recall_adapter * len(questions))
