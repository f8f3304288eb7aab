"""A request's class (interactive or bulk) and latency budget, from its body, its headers and the server's defaults.

`priority` in the body (vLLM's field: an integer, lower is served first; or
the name "interactive" / "bulk"), else the `X-Jaxserve-Priority` header, else
the server's default (`--default-priority`), else automatic: a request of at
most `--interactive-max-sequences` sequences is interactive, a larger one bulk.
`deadline_ms` in the body or the `X-Jaxserve-Deadline-Ms` header: its latency
budget, served earliest deadline first within its class and counted in
/metrics' deadlines met. See docs/api.md, "Request classes".
"""

from __future__ import annotations

import dataclasses
import math

from jaxserve.api import ApiError
from jaxserve.batcher import BULK, CLASSES, INTERACTIVE

INTERACTIVE_MAX_SEQUENCES = 8  # the automatic default's threshold: up to this many sequences is interactive
PRIORITY_HEADER = "X-Jaxserve-Priority"
DEADLINE_HEADER = "X-Jaxserve-Deadline-Ms"


@dataclasses.dataclass(frozen=True)
class Ask:
    """What the request asked for: a class (None: the default) and a budget (None: none)."""

    cls: int | None = None
    deadline_ms: float | None = None


NO_ASK = Ask()


def _class(value, where: str) -> int:
    if isinstance(value, bool):
        raise ApiError(400, f"`{where}` must be an integer or one of {list(CLASSES)}, not {value!r}")
    if isinstance(value, str):
        name = value.strip().lower()
        if name in CLASSES:
            return CLASSES.index(name)
        try:
            value = int(name)
        except ValueError:
            raise ApiError(400, f"`{where}` must be an integer or one of {list(CLASSES)}, not {value!r}") from None
    if isinstance(value, int):
        return INTERACTIVE if value <= 0 else BULK  # vLLM: lower is earlier, 0 the default
    raise ApiError(400, f"`{where}` must be an integer or one of {list(CLASSES)}, not {value!r}")


def _deadline(value, where: str) -> float:
    try:
        ms = float(value)
    except (TypeError, ValueError):
        ms = math.nan
    if isinstance(value, bool) or not math.isfinite(ms) or ms <= 0:
        raise ApiError(400, f"`{where}` must be a positive number of milliseconds, not {value!r}")
    return ms


def ask_of(body, headers) -> Ask:
    """The class and budget a request asked for; 400 on a malformed one."""
    body = body if isinstance(body, dict) else {}
    cls = deadline = None
    if body.get("priority") is not None:
        cls = _class(body["priority"], "priority")
    elif headers.get(PRIORITY_HEADER):
        cls = _class(headers[PRIORITY_HEADER], PRIORITY_HEADER)
    if body.get("deadline_ms") is not None:
        deadline = _deadline(body["deadline_ms"], "deadline_ms")
    elif headers.get(DEADLINE_HEADER):
        deadline = _deadline(headers[DEADLINE_HEADER], DEADLINE_HEADER)
    return Ask(cls, deadline)


def class_of(ask: Ask, sequences: int, default: str = "auto", threshold: int = INTERACTIVE_MAX_SEQUENCES) -> int:
    """The class a request runs in: asked, else the server's default, else automatic by its size."""
    if ask.cls is not None:
        return ask.cls
    if default != "auto":
        return CLASSES.index(default)
    return INTERACTIVE if sequences <= threshold else BULK
