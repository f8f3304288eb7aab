"""A request's class (interactive or bulk) and latency budget, from its body, its headers, its API key, its route
and the server's policy.

What a request asks for: `priority` in the body (vLLM's field: an integer,
lower is served first; or the name "interactive" / "bulk"), else the
`X-Jaxserve-Priority` header. What it is granted: its API key's class
(`--api-key KEY=CLASS`) and its route's (`--route-priority ROUTE=CLASS`) are
ceilings (a client may demote itself, never promote), and the default for a
request that asks for nothing; else the server's default
(`--default-priority`), else automatic. Whatever it asked, a request larger
than the interactive limits (`Policy`: sequences after chunking, tokens) runs
as bulk, so no large request takes the interactive queue.

`deadline_ms` in the body or the `X-Jaxserve-Deadline-Ms` header: its latency
budget, served earliest deadline first within its class, never shorter than
`MIN_DEADLINE_MS` (a shorter one is raised to it). See docs/api.md, "Request
classes".
"""

from __future__ import annotations

import dataclasses
import math

from jaxserve.http.api import ApiError, _show
from jaxserve.scheduling.batcher import BULK, CLASSES, INTERACTIVE

INTERACTIVE_MAX_SEQUENCES = 8  # at most this many sequences (after chunking) may run as interactive ...
INTERACTIVE_MAX_TOKENS = 4096  # ... and at most this many tokens: a query's size, 8 sequences of 512
# A deadline shorter than this is raised to it: about one bulk dispatch while queries are likely
# (pipeline.BULK_DISPATCH_MS), so an earlier deadline can only reorder, never make the scheduler chase it.
MIN_DEADLINE_MS = 100.0
PRIORITY_HEADER = "X-Jaxserve-Priority"
DEADLINE_HEADER = "X-Jaxserve-Deadline-Ms"


@dataclasses.dataclass(frozen=True)
class Ask:
    """What the request asked for and what it may have.

    `cls`: the class it asked for (None: none), from `source` (body or header); `deadline_ms`: its budget (None:
    none); `ceiling`: the most its API key and route grant (BULK: bulk only; None: anything), from `ceiling_from`
    (api_key or route), also its class when it asks for none; `body_bytes`: its body's size once decoded."""

    cls: int | None = None
    deadline_ms: float | None = None
    source: str | None = None
    ceiling: int | None = None
    ceiling_from: str | None = None
    body_bytes: int = 0


NO_ASK = Ask()


@dataclasses.dataclass(frozen=True)
class Policy:
    """The server's side of the decision: its default class (auto: by size) and the interactive limits."""

    default: str = "auto"
    max_sequences: int = INTERACTIVE_MAX_SEQUENCES
    max_tokens: int = INTERACTIVE_MAX_TOKENS


DEFAULT_POLICY = Policy()


def _class(value, where: str) -> int:
    if isinstance(value, bool):
        raise ApiError(400, f"`{where}` must be an integer or one of {list(CLASSES)}, not {_show(value)}")
    if isinstance(value, str):
        name = value.strip().lower()
        if name in CLASSES:
            return CLASSES.index(name)
        try:
            value = int(name)
        except ValueError:
            raise ApiError(400, f"`{where}` must be an integer or one of {list(CLASSES)}, not {_show(value)}") from None
    if isinstance(value, int):
        return INTERACTIVE if value <= 0 else BULK  # vLLM: lower is earlier, 0 the default
    raise ApiError(400, f"`{where}` must be an integer or one of {list(CLASSES)}, not {_show(value)}")


def _deadline(value, where: str) -> float:
    try:
        ms = float(value)
    except (TypeError, ValueError):
        ms = math.nan
    if isinstance(value, bool) or not math.isfinite(ms) or ms <= 0:
        raise ApiError(400, f"`{where}` must be a positive number of milliseconds, not {_show(value)}")
    return max(ms, MIN_DEADLINE_MS)


# Paths that serve one route: a `--route-priority` ceiling set on any of them holds on each
SAME_ROUTE = (("/v1/embeddings", "/embeddings"), ("/score", "/v1/score"), ("/", "/invocations", "/vertex"),
              ("/v2/embed", "/v1/embed"))


def route_ceilings(given: dict[str, str]) -> dict[str, str]:
    """`--route-priority` by path, each class also on the paths serving the same route (SAME_ROUTE), the
    strictest where two name one: made once per server, looked up per request (`route_class`)."""
    out: dict[str, str] = {}
    for path, cls in given.items():
        for p in next((group for group in SAME_ROUTE if path in group), (path,)):
            out[p] = max(out.get(p, cls), cls, key=CLASSES.index)
    return out


def route_class(ceilings: dict[str, str], *paths: str | None) -> str | None:
    """The strictest class `ceilings` (`route_ceilings`) gives any of `paths`: a request is held to the ceiling of
    the route it runs, whichever name it came in by (TEI's `POST /` runs the model kind's route: /embed ...)."""
    found = [ceilings[p] for p in paths if p in ceilings] if ceilings else ()
    return max(found, key=CLASSES.index) if found else None


def ask_of(body, headers, key: str | None = None, route: str | None = None, body_bytes: int = 0) -> Ask:
    """What a request asked for (`key`, `route`: the classes its API key and its route grant, if the server gives
    them one); 400 on a malformed priority or deadline."""
    body = body if isinstance(body, dict) else {}
    cls = deadline = source = None
    if body.get("priority") is not None:
        cls, source = _class(body["priority"], "priority"), "body"
    elif headers.get(PRIORITY_HEADER):
        cls, source = _class(headers[PRIORITY_HEADER], PRIORITY_HEADER), "header"
    grants = [(CLASSES.index(c), where) for c, where in ((key, "api_key"), (route, "route")) if c is not None]
    ceiling, ceiling_from = max(grants, key=lambda g: g[0]) if grants else (None, None)  # the stricter; key first
    if body.get("deadline_ms") is not None:
        deadline = _deadline(body["deadline_ms"], "deadline_ms")
    elif headers.get(DEADLINE_HEADER):
        deadline = _deadline(headers[DEADLINE_HEADER], DEADLINE_HEADER)
    return Ask(cls, deadline, source, ceiling, ceiling_from, body_bytes)


def decide(ask: Ask, sequences: int, tokens: int, policy: Policy = DEFAULT_POLICY) -> tuple[int, str]:
    """The class a request runs in and where it came from: body, header, api_key, route, default, auto, or size
    (asked or granted interactive, but over the interactive limits)."""
    if ask.cls is not None:
        cls, source = ask.cls, ask.source
    elif ask.ceiling is not None:
        cls, source = ask.ceiling, ask.ceiling_from
    elif policy.default != "auto":
        cls, source = CLASSES.index(policy.default), "default"
    else:
        cls, source = INTERACTIVE, "auto"
    if ask.ceiling is not None and cls < ask.ceiling:  # asked above what its key or route grants
        cls, source = ask.ceiling, ask.ceiling_from
    if cls == INTERACTIVE and (sequences > policy.max_sequences or tokens > policy.max_tokens):
        cls, source = BULK, ("auto" if source == "auto" else "size")
    return cls, source


def likely_interactive(ask: Ask, inputs: int, policy: Policy = DEFAULT_POLICY, *, most_bytes: int) -> bool:
    """Before tokenizing: may the request (`inputs` texts) run as interactive, and is its body small enough
    (`most_bytes`) to tokenize on the interactive requests' own thread? Chunking may still make it bulk."""
    return ask.body_bytes <= most_bytes and decide(ask, inputs, 0, policy)[0] == INTERACTIVE


def parse_key(text: str) -> tuple[str, str | None]:
    """`KEY` or `KEY=CLASS` (--api-key, --api-keys-file) -> (key, class or None). Only a class name after the
    last `=` is split off, so keys that themselves end in `=` (base64) stay whole; `=CLASS` is an empty key
    (`ServerConfig` refuses it)."""
    key, sep, cls = text.strip().rpartition("=")
    if sep and cls.strip().lower() in CLASSES:
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
