"""Knowledge augmentation written by the served model (issue 45 item 6): for each fact, the model writes
questions a user might ask to have it recalled, under a JSON schema, and each kept question becomes a training
example answered with the fact. augment.py's templates stay (they are the default, and all there is when no
capable model is served); these add wordings no template has.

A question is kept only when it is a question (ends with "?") in the user's voice (a first-person word, no
"your": "What is the name of your cat?" would teach the model that the cat is its own), does not hold its own
answer, is not one of the validation or gate questions of these facts (data.py: the gates stay honest; compared with case,
spacing and punctuation ignored), and is not a repeat. Replies alternate the relation's reply sentences and
the bare answer, as augment.py's. A reply that is not valid JSON (cut by max_tokens) adds nothing for that
fact, logged: augmentation is best effort, the templates still train it.

`generate(messages, schema, max_tokens) -> (text, finish_reason)` is the served model at low priority
(serving/background/self_generate.py); this module knows nothing of serving.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence

from kvmem.formation.self_model import Generate  # (messages, schema, max_tokens) -> (text, finish_reason)
from scheduler.distill.data import Example, Fact, fact_reply, gate_questions, recalled, valid_questions

log = logging.getLogger(__name__)

MAX_QUESTIONS = 8
QUESTIONS_SCHEMA = {
    "type": "object",
    "properties": {
        "questions": {
            "type": "array",
            "items": {"type": "string", "minLength": 8, "maxLength": 120},
            "minItems": 1,
            "maxItems": MAX_QUESTIONS,
        }
    },
    "required": ["questions"],
    "additionalProperties": False,
}
INSTRUCTIONS = f"""You help an assistant remember what a user told it.
You get one fact the user said about themselves and its answer. Write up to {MAX_QUESTIONS} different questions
the user might ask the assistant later to be reminded of it, in the user's own voice ("my", "I"), worded in as
many different ways as you can: casual, formal, indirect. The answer to each must be the given answer, and no
question may contain it.
Answer with JSON only: {{"questions": [...]}}."""


_FIRST_PERSON = re.compile(r"\b(?:I|I'm|I've|I'd|my|me|mine|myself)\b", re.I)
_ASSISTANTS = re.compile(r"\byour(?:s|self)?\b", re.I)


def _users_question(q: str) -> bool:
    return q.endswith("?") and bool(_FIRST_PERSON.search(q)) and not _ASSISTANTS.search(q)


def _norm(text: str) -> str:
    return " ".join(re.findall(r"[0-9a-z']+", text.lower()))


def model_examples(
    facts: Sequence[Fact], generate: Generate, *, max_tokens: int = 320
) -> tuple[list[Example], dict[str, int]]:
    """The examples the model's questions make for `facts`, and counts: `asked` (facts asked), `written`
    (questions in the replies), `kept`, `unparsed` (replies that were not JSON), `closed` (replies that ran
    into max_tokens and were closed by the engine: JSON, their last question left out as possibly cut)."""
    reserved = {_norm(e.question) for e in [*valid_questions(facts), *gate_questions(facts, seed=0)]}
    counts = {"asked": 0, "written": 0, "kept": 0, "unparsed": 0, "closed": 0}
    out: list[Example] = []
    for f in facts:
        messages = [
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": f"Fact: {f.text}\nAnswer: {f.answer}"},
        ]
        counts["asked"] += 1
        text, finish = generate(messages, QUESTIONS_SCHEMA, max_tokens)
        try:
            questions = [q for q in json.loads(text)["questions"] if isinstance(q, str)]
            # closed by the engine to fit max_tokens: its last question may be cut short
            if finish == "length":
                questions, counts["closed"] = questions[:-1], counts["closed"] + 1
        except (ValueError, KeyError, TypeError):
            counts["unparsed"] += 1
            log.warning(
                "distill: the model's questions for %s ended (%s) before their JSON", f.memory_id, finish
            )
            continue
        counts["written"] += len(questions)
        seen: set[str] = set()
        n = 0
        for q in questions:
            q = " ".join(q.split())
            key = _norm(q)
            if not _users_question(q) or not key or key in reserved or key in seen or recalled(q, f.answer):
                continue
            seen.add(key)
            reply = fact_reply(f, n // 2) if n % 2 == 0 else f"{f.answer}."
            out.append(Example(f.memory_id, "question", q, reply, f.answer))
            n += 1
        counts["kept"] += n
    return out, counts
