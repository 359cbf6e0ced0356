"""The errors the Python APIs raise for requests the engine could not finish.

Knows nothing about steps or front ends beyond request ids and outputs.
"""

from __future__ import annotations

from typing import Sequence

from .request import NONFINITE_LOGITS, RequestOutput


class EngineDeadError(RuntimeError):
    """The engine task failed; no request can make progress."""


class StepFailedError(RuntimeError):
    """The step running this request raised (a failed allocation, a kernel error) or gave it
    non-finite logits; the request was dropped, its slot and blocks freed, and the engine serves
    the others."""


class NonFiniteLogitsError(StepFailedError):
    """The named requests' logits held a NaN or an infinity (NONFINITE_LOGITS). outputs: every
    request of the call (`LLM.generate`), the failed ones with finish_reason "error", so the
    others' results are not lost."""

    def __init__(self, request_ids: Sequence[str], outputs: Sequence[RequestOutput] = ()) -> None:
        super().__init__(f"request {', '.join(request_ids)}: {NONFINITE_LOGITS}")
        self.request_ids, self.outputs = list(request_ids), list(outputs)
