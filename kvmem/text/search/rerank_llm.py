"""`LLMJudge` ("llm"): the served LLM as a pointwise judge of the first stage's candidates (off by default).

For deployments whose served model is large enough to judge relevance: one `/v1/chat/completions` request per
search lists the candidates (each cut to 300 characters) and asks for a 0-10 relevance grade for each, as
JSON. The grade / 10 is the candidate's score (ties keep the first-stage order). stdlib only (urllib, json),
like kvmem/formation/llm.py. Any failure (network, status, a reply that is not one grade per candidate) is a
RerankerUnavailable, and search keeps the first stage's order. With no model configured it asks the endpoint's
first served model (/models). The default 135M model cannot judge: probed through kvmem serve on the 2-core CPU,
it answered 2 of 2 requests of 10 and 20 candidates with no parsable grade list, in 14-45 s each. Knows nothing
of the store.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np

from kvmem.text.errors import RerankerUnavailable

_TEXT_CHARS = 300
INSTRUCTIONS = (
    "You grade how useful each numbered memory is for answering the question, from 0 (useless) to 10 "
    '(answers it). Reply with JSON only: {"grades": [g1, g2, ...]}, one integer per memory, in order.'
)


class LLMJudge:
    """Grades candidates with an OpenAI-compatible chat endpoint at `base_url` (e.g. http://host:8000/v1)."""

    name = "llm"

    def __init__(
        self, base_url: str, model: str = "", timeout_s: float = 10.0, api_key: str | None = None
    ) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self._models_url = base_url.rstrip("/") + "/models"
        self.model = model  # "": the endpoint's first served model, asked once (kvmem serve refuses "")
        self.timeout_s = timeout_s
        self._api_key = api_key

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        return headers

    def _served_model(self) -> str:
        """The model to ask: the configured one, else the first the endpoint lists at /models."""
        if not self.model:
            request = urllib.request.Request(self._models_url, headers=self._headers(), method="GET")
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                self.model = str(json.loads(response.read().decode("utf-8"))["data"][0]["id"])
        return self.model

    def prompt(self, query: str, texts: list[str]) -> str:
        lines = [f"{i}. {' '.join(t.split())[:_TEXT_CHARS]}" for i, t in enumerate(texts, start=1)]
        return f"Question: {query}\n\nMemories:\n" + "\n".join(lines)

    def score(self, query: str, texts: list[str], features: np.ndarray) -> np.ndarray:
        try:
            body = {
                "model": self._served_model(),
                "messages": [
                    {"role": "system", "content": INSTRUCTIONS},
                    {"role": "user", "content": self.prompt(query, texts)},
                ],
                "temperature": 0,
                "max_tokens": 8 + 4 * len(texts),
            }
            data = json.dumps(body).encode("utf-8")
            request = urllib.request.Request(self.url, data, self._headers(), method="POST")
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                reply = json.loads(response.read().decode("utf-8"))
            grades = parse_grades(reply["choices"][0]["message"]["content"], len(texts))
        except (OSError, urllib.error.URLError, KeyError, IndexError, TypeError, ValueError) as exc:
            raise RerankerUnavailable(f"LLM judge at {self.url}: {exc}") from exc
        return grades / 10.0


def parse_grades(content: str, num: int) -> np.ndarray:
    """The `num` grades of a reply (clipped to 0..10); ValueError unless it is {"grades": [num numbers]}."""
    start, end = content.find("{"), content.rfind("}")
    document = json.loads(content[start : end + 1] if start >= 0 else content)
    grades = document.get("grades") if isinstance(document, dict) else None
    if not isinstance(grades, list) or len(grades) != num:
        raise ValueError(f"expected {num} grades, got {grades!r:.200}")
    if not all(isinstance(g, (int, float)) and not isinstance(g, bool) for g in grades):
        raise ValueError("grades must be numbers")
    return np.clip(np.array(grades, dtype=np.float64), 0.0, 10.0)
