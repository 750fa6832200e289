"""The served model as the "self" extractor's `generate` (kvmem/formation/self_model.py): a chat turn laid out
as any request's prompt (no memories), its reply constrained to a JSON schema (the engine's token mask),
greedy, run in the server's own engine as a background request: no HTTP hop, and within the engine's budget
for low-priority rows (serving/engine/batcher.py: a chat row is never delayed a step by it). Called on the
formation worker's thread; waits for the reply there. Knows nothing of HTTP.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

from kvmem.formation.errors import ExtractionError
from serving.backends.base import (
    Backend,
    BackendError,
    GenerationRequest,
    GenerationResult,
    InvalidResponseFormat,
    PromptTooLong,
    ResponseFormat,
    SamplingParams,
    TokenDelta,
)
from serving.engine.errors import PoolFull, PoolTooSmall
from serving.engine.model_loop import LoopClosed

FORMATION_USER = "kvmem-formation"  # the user id its requests run under (no memories, no session)
_ids = itertools.count()


def backend_generate(backend: Backend):
    """`generate(messages, schema, max_tokens) -> (text, finish_reason)` over `backend`. The engine's refusals
    become the extractor's errors, so the worker retries or bisects as it does for any extractor: a prompt the
    pool or the context can never hold is permanent (the worker splits the batch, down to the turn that fails
    alone, which is dead-lettered); a full pool or queue, or a backend that stopped, is transient (the turns
    stay pending, the user backs off)."""

    def generate(messages: list[dict], schema: dict, max_tokens: int) -> tuple[str, str]:
        fmt = ResponseFormat("json_schema", json.dumps(schema), "formation")
        try:
            backend.check_response_format(fmt)  # compiled once, cached
            prompt = backend.layout_prompt([], [], messages)  # NotReady while the model loads
            sampling = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, response_format=fmt)
            request = GenerationRequest(
                f"formation-{next(_ids)}", FORMATION_USER, prompt, None, sampling, background=True
            )
            return asyncio.run(_collect(backend, request))
        except (PoolTooSmall, PromptTooLong) as e:
            raise ExtractionError(f"the formation prompt can never be served: {e}", False, "too_long") from e
        except (
            InvalidResponseFormat
        ) as e:  # the backend's, not the turns': nothing dead-lettered, the circuit opens
            raise ExtractionError(
                f"the backend cannot constrain the reply: {e}", True, "response_format"
            ) from e
        except (PoolFull, BackendError, LoopClosed) as e:  # QueueFull is a BackendError
            raise ExtractionError(f"the engine is busy or stopped: {e}", True, "engine_busy") from e

    return generate


async def _collect(backend: Any, request: GenerationRequest) -> tuple[str, str]:
    text: list[str] = []
    finish = "length"
    async for item in backend.stream(request):
        if isinstance(item, TokenDelta):
            text.append(item.text)
        elif isinstance(item, GenerationResult):
            finish = item.finish_reason
    return "".join(text), finish
