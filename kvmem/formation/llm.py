"""`OpenAIExtractor` ("openai"): atomic facts from any OpenAI-compatible `/v1/chat/completions` endpoint,
with the stdlib only (urllib.request, json): a json_schema response format, its own retries with backoff,
a repaired reply (`json_repair.py`), dates resolved and slots normalized like the rule extractor's.

Knows nothing of the store or consolidation. The API key goes in one header and is never logged or put in
an error message.
"""

from __future__ import annotations

import http.client
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from datetime import date

from kvmem.formation.dates import WEEKDAYS, iso_time, parse_chat_time, resolve_dates
from kvmem.formation.errors import ExtractionError
from kvmem.formation.json_repair import fact_items
from kvmem.formation.types import Fact, TurnInput
from kvmem.formation.values import plain

logger = logging.getLogger(__name__)

KINDS = ("fact", "preference", "plan", "relation", "event")
_FIELDS = ("text", "kind", "subject", "attribute", "value", "date")
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "facts",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {
                "facts": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "text": {"type": "string"},
                            "kind": {"type": "string", "enum": list(KINDS)},
                            "subject": {"type": ["string", "null"]},
                            "attribute": {"type": ["string", "null"]},
                            "value": {"type": ["string", "null"]},
                            "date": {"type": ["string", "null"]},
                        },
                        "required": list(_FIELDS),
                        "additionalProperties": False,
                    },
                }
            },
            "required": ["facts"],
            "additionalProperties": False,
        },
    },
}
INSTRUCTIONS = """You turn a chat log into long-term memories about the user.
Read only the lines marked "user"; other lines are context. Return every atomic fact the user states about
themselves or their world (where they live, work, who they know, pets, preferences, diet, plans, events),
one fact per item, in the user's own first-person words. Skip greetings, thanks, questions, requests to the
assistant, filler, hypotheticals ("if I were...", "maybe I should") and anything about the assistant.
Replace relative dates with absolute ones using the line's date ("yesterday" -> "on 2026-11-25").
For each fact give: text; kind (fact, preference, plan, relation or event); subject ("user" or a relative
such as "sister") and attribute (e.g. home_city, job, employer, relationship, dog.name, favourite:colour,
likes:coffee, diet, age, email, name) when the fact sets one, with value its short value ("berlin", "yes",
"no", "none"), else null; date: the ISO day the event happened, if named, else null.
Answer with JSON only: {"facts": [...]}."""
_USER_SUBJECTS = {"i", "me", "myself", "user", "the user", "the_user", "speaker", "self"}
_CONTEXT_CHARS = 500  # other speakers' lines are context only: each is cut to this many characters


def _endpoint(url: str) -> str:
    base = url.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")


def _slot_part(raw: object) -> str | None:
    """A slot's subject or attribute: lowercase, spaces as "_"."""
    if not isinstance(raw, str) or not raw.strip():
        return None
    return "_".join(raw.strip().lower().split())


def _timed_out(error: BaseException) -> bool:
    """Whether a urllib failure was a timeout (URLError wraps the socket's)."""
    reason = getattr(error, "reason", None)
    return isinstance(error, TimeoutError) or isinstance(reason, TimeoutError)


class OpenAIExtractor:
    """Facts from an OpenAI-compatible chat endpoint.

    `url` is the server's base ("http://host:8000" or ".../v1") or the full chat completions URL. One
    request per `extract` call, retried up to `max_retries` more times after a connection error, a timeout,
    a 5xx or a 429, waiting `backoff_s`, then twice that, and so on; then `ExtractionError(transient=True)`.
    Any other 4xx, a reply that is not a chat completion, or content that is not a facts array even after
    repair raise `ExtractionError(transient=False)` at once. Each fact's turn_ids are all the user turns
    sent (the schema does not ask the model which turn said what).
    """

    name = "openai"

    def __init__(
        self,
        url: str,
        model: str,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        max_retries: int = 2,
        backoff_s: float = 0.5,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"OpenAIExtractor.url: must start with http:// or https://, got {url!r}")
        if not model:
            raise ValueError(f"OpenAIExtractor.model: must be a model name, got {model!r}")
        if not timeout_s > 0:
            raise ValueError(f"OpenAIExtractor.timeout_s: must be > 0, got {timeout_s!r}")
        if max_retries < 0:
            raise ValueError(f"OpenAIExtractor.max_retries: must be >= 0, got {max_retries!r}")
        if backoff_s < 0:
            raise ValueError(f"OpenAIExtractor.backoff_s: must be >= 0, got {backoff_s!r}")
        self.endpoint = _endpoint(url)
        self.model = model
        self._api_key = api_key
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._sleep = sleep
        self._structured = True  # send response_format (json_schema) until the server refuses it

    def __repr__(self) -> str:
        return f"OpenAIExtractor(endpoint={self.endpoint!r}, model={self.model!r})"

    # ---- request --------------------------------------------------------------------------------------

    def request_body(self, turns: Sequence[TurnInput]) -> dict:
        """The chat completion request for `turns`: the instructions, then one line per turn with its day."""
        lines = []
        for turn in turns:
            if turn.role == "system" or not turn.text.strip():
                continue
            day = parse_chat_time(turn.chat_time).date()
            text = " ".join(turn.text.split())
            if turn.role != "user":
                text = text[:_CONTEXT_CHARS]
            lines.append(
                f"[{day.isoformat()} {WEEKDAYS[day.weekday()][:3].capitalize()}] {turn.role}: {text}"
            )
        return {
            "model": self.model,
            "temperature": 0,
            "messages": [
                {"role": "system", "content": INSTRUCTIONS},
                {"role": "user", "content": "Chat log, oldest first:\n" + "\n".join(lines)},
            ],
            **({"response_format": RESPONSE_FORMAT} if self._structured else {}),
        }

    def _redact(self, text: str) -> str:
        return text.replace(self._api_key, "***") if self._api_key else text

    def _post_once(self, body: bytes) -> bytes:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        request = urllib.request.Request(self.endpoint, data=body, headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            return response.read()

    def _post(self, payload: dict) -> str:
        """The reply's message content, after this extractor's own retries."""
        body = json.dumps(payload).encode()
        reason, kind = "", "connection"
        for attempt in range(self.max_retries + 1):
            if attempt:
                self._sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                raw = self._post_once(body)
            except urllib.error.HTTPError as e:
                detail = self._redact(e.read().decode("utf-8", "replace")[:200]) if e.fp else ""
                if e.code == 400 and "response_format" in detail and "response_format" in payload:
                    # a server without structured output (many OpenAI-compatible ones): the instructions
                    # ask for the same JSON, and replies are repaired; asked that way from now on
                    logger.info(
                        "openai extractor: %s refuses response_format; asking without it", self.endpoint
                    )
                    self._structured = False
                    return self._post({k: v for k, v in payload.items() if k != "response_format"})
                if e.code != 429 and e.code < 500:
                    raise ExtractionError(
                        f"openai extractor: HTTP {e.code} from {self.endpoint}: {detail}",
                        transient=False,
                        kind=f"http_{e.code}",
                    ) from None
                reason, kind = f"HTTP {e.code}", f"http_{e.code}"
            except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out (URLError too)
                reason = self._redact(f"{type(e).__name__}: {e}")
                kind = "timeout" if _timed_out(e) else "connection"
            else:
                return self._content(raw)
            logger.warning(
                "openai extractor: %s from %s (attempt %d of %d)",
                reason,
                self.endpoint,
                attempt + 1,
                self.max_retries + 1,
            )
        raise ExtractionError(
            f"openai extractor: {reason} from {self.endpoint} after {self.max_retries + 1} attempts",
            transient=True,
            kind=kind,
        )

    def _content(self, raw: bytes) -> str:
        try:
            content = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ExtractionError(
                f"openai extractor: reply from {self.endpoint} is not a chat completion: {raw[:200]!r}",
                transient=False,
                kind="not_a_chat_completion",
            ) from None
        if not isinstance(content, str):
            raise ExtractionError(
                f"openai extractor: reply from {self.endpoint} has no text content: {content!r}",
                transient=False,
                kind="no_text_content",
            )
        return content

    # ---- reply ----------------------------------------------------------------------------------------

    def extract(self, turns: Sequence[TurnInput]) -> list[Fact]:
        user_turns = [t for t in turns if t.role == "user" and t.text.strip()]
        if not user_turns:
            return []
        content = self._post(self.request_body(turns))
        try:
            items = fact_items(content)
        except ValueError as e:
            raise ExtractionError(
                f"openai extractor: reply content is not a facts array ({e}): {content[:200]!r}",
                transient=False,
                kind="malformed_reply",
            ) from None
        turn_ids = tuple(t.id for t in user_turns)
        chat_time = user_turns[-1].chat_time
        facts: dict[str, Fact] = {}  # a fact said twice in one reply (small models loop) counts once
        for item in items:
            fact = self._fact(item, turn_ids, chat_time)
            if fact is not None:
                facts.setdefault(" ".join(fact.text.lower().split()), fact)
        return list(facts.values())

    @staticmethod
    def _fact(item: dict, turn_ids: tuple[str, ...], chat_time: str) -> Fact | None:
        """One reply item as a Fact; None for an item without text. Relative dates left in the text are
        resolved against the last user turn's time; valid_from is the item's past `date` (or the past day
        its text names), else that time."""
        raw_text = item.get("text")
        if not isinstance(raw_text, str) or not raw_text.strip():
            return None
        resolved = resolve_dates(" ".join(raw_text.split()), chat_time)
        today = parse_chat_time(chat_time).date()
        event: date | None = None
        if isinstance(item.get("date"), str):
            try:
                event = date.fromisoformat(item["date"].strip()[:10])
            except ValueError:
                event = None
        event = event or resolved.event_date
        subject, attribute = _slot_part(item.get("subject")), _slot_part(item.get("attribute"))
        value = plain(item["value"]) if isinstance(item.get("value"), str) else None
        slot = None
        if subject and attribute and value:
            slot = f"{'user' if subject in _USER_SUBJECTS else subject}|{attribute}"
        kind = item.get("kind") if item.get("kind") in KINDS else "fact"
        return Fact(
            text=resolved.text,
            turn_ids=turn_ids,
            valid_from=iso_time(event) if event is not None and event < today else chat_time,
            kind=kind,
            slot=slot,
            value=value if slot else None,
        )
