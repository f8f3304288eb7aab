"""A request's class (interactive or bulk) and latency budget, from its body, its headers and the server's defaults.

`priority` in the body (vLLM's field: an integer, lower is served first; or
the name "interactive" / "bulk"), else the `X-Jaxserve-Priority` header, else
the class of the request's API key (`--api-key KEY=CLASS`), else its route's
(`--route-priority ROUTE=CLASS`), else the server's default
(`--default-priority`), else automatic: a request of at most
`--interactive-max-sequences` sequences is interactive, a larger one bulk.
`deadline_ms` in the body or the `X-Jaxserve-Deadline-Ms` header: its latency
budget, served earliest deadline first within its class and counted in
/metrics' deadlines met. See docs/api.md, "Request classes".
"""

from __future__ import annotations

import dataclasses
import math

from jaxserve.http.api import ApiError
from jaxserve.scheduling.batcher import BULK, CLASSES, INTERACTIVE

INTERACTIVE_MAX_SEQUENCES = 8  # the automatic default's threshold: up to this many sequences is interactive
PRIORITY_HEADER = "X-Jaxserve-Priority"
DEADLINE_HEADER = "X-Jaxserve-Deadline-Ms"


@dataclasses.dataclass(frozen=True)
class Ask:
    """What the request asked for: a class (None: the server's default) and a budget (None: none), and where the
    class came from (body, header, api_key or route)."""

    cls: int | None = None
    deadline_ms: float | None = None
    source: str | None = None


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


def ask_of(body, headers, key: str | None = None, route: str | None = None) -> Ask:
    """The class and budget a request asked for (`key`, `route`: the class of its API key and of its route, if the
    server gives them one); 400 on a malformed one."""
    body = body if isinstance(body, dict) else {}
    cls = deadline = source = None
    if body.get("priority") is not None:
        cls, source = _class(body["priority"], "priority"), "body"
    elif headers.get(PRIORITY_HEADER):
        cls, source = _class(headers[PRIORITY_HEADER], PRIORITY_HEADER), "header"
    elif key is not None:
        cls, source = CLASSES.index(key), "api_key"
    elif route is not None:
        cls, source = CLASSES.index(route), "route"
    if body.get("deadline_ms") is not None:
        deadline = _deadline(body["deadline_ms"], "deadline_ms")
    elif headers.get(DEADLINE_HEADER):
        deadline = _deadline(headers[DEADLINE_HEADER], DEADLINE_HEADER)
    return Ask(cls, deadline, source)


def class_of(ask: Ask, sequences: int, default: str = "auto", threshold: int = INTERACTIVE_MAX_SEQUENCES) -> int:
    """The class a request runs in: asked, else the server's default, else automatic by its size."""
    if ask.cls is not None:
        return ask.cls
    if default != "auto":
        return CLASSES.index(default)
    return INTERACTIVE if sequences <= threshold else BULK


def likely_interactive(ask: Ask, inputs: int, default: str = "auto",
                       threshold: int = INTERACTIVE_MAX_SEQUENCES) -> bool:
    """Before tokenizing: will the request (of `inputs` texts) run as interactive? Exact unless the automatic
    default decides and chunking turns a few long inputs into more than `threshold` sequences."""
    return class_of(ask, inputs, default, threshold) == INTERACTIVE


def class_from(ask: Ask, default: str = "auto") -> str:
    """Where `class_of` took the class from: body, header, api_key, route, default (--default-priority) or auto."""
    return ask.source or ("default" if default != "auto" else "auto")


def parse_key(text: str) -> tuple[str, str | None]:
    """`KEY` or `KEY=CLASS` (--api-key, --api-keys-file) -> (key, class or None). Only a class name after the
    last `=` is split off, so keys that themselves end in `=` (base64) stay whole."""
    key, sep, cls = text.strip().rpartition("=")
    if sep and key and cls.strip().lower() in CLASSES:
        return key, cls.strip().lower()
    return text.strip(), None


def parse_route(text: str) -> tuple[str, str]:
    """`ROUTE=CLASS` (--route-priority) -> (route path, class); ValueError on anything else."""
    route, _, cls = text.partition("=")
    cls = cls.strip().lower()
    if not route.startswith("/") or cls not in CLASSES:
        raise ValueError(f"expected ROUTE=CLASS with ROUTE a path such as /embed and CLASS one of {list(CLASSES)}, "
                         f"not {text!r}")
    return route.strip(), cls
