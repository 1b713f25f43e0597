"""The messages between worker processes and the host's scheduling authority.

One Unix-domain stream socket per worker; each message is one JSON object on one line (a JSON
encoder never writes a raw newline). Messages are per request, never per token:

worker → authority                          authority → worker
  hello   {worker, pid}                       pool       {backends: [...]}  (on change)
  ready   {}  (listening on the port)         startable  {models: {model: bool}}  (on change)
  admit   {rid, job, now?}                    admitted   {rid, grant?}, error {rid, error},
                                              later {rid}  (with `now`: not at once)
  tokens  {rid, generated}  (review point)    grant      {rid, backend, priority, review_at}
  ended   {rid, attempt, down, generated}     review     {rid, review_at}
  finish  {rid, generated}                    preempt    {rid}
  resized {rid, prompt_tokens}                error      {rid, error}  (timeout, shed, retries)
  refused {rid}  (preempt came too late)      scrape     {sid}  → exposition {sid, text}
  call    {sid, what, ...}                     reply      {sid, data} or {sid, error}
    what: metrics, queue, backends (admin views); predictor (its config), predict {vector,
    prompt_tokens, max_tokens, model}, global {prompt_tokens, model}
  learn   {model, vector, prompt_tokens, output_tokens}  (a completion, for the host's predictor)

`rid` is the worker's own job id; the authority keys its jobs by (connection, rid). A
`GatewayError` crosses as its class name and fields and is raised again as the same class.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np

from gateway import errors
from gateway.errors import GatewayError
from policies import Job, LengthDist

Message = dict[str, Any]

LINE_LIMIT = 64 * 1024 * 1024
"""Longest message (bytes): a merged metrics exposition is the largest, a job ~1-10 kB."""
BUFFER_LIMIT = 64 * 1024 * 1024
"""Bytes waiting to be sent to a peer that does not read them: beyond it the connection is
closed (a stuck worker's requests are then finished, not its messages kept)."""


def pack(msg: Message) -> bytes:
    """One message as one line."""
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"


def unpack(line: bytes) -> Message:
    msg = json.loads(line)
    if not isinstance(msg, dict) or "op" not in msg:
        raise ValueError(f"not a message: {line[:200]!r}")
    return msg


def kind(msg: Message) -> str:
    """What a message is, as the authority counts it: its op, and for a call what it asks
    ("call predict")."""
    return f"call {msg.get('what')}" if msg["op"] == "call" else str(msg["op"])


def job_fields(job: Job) -> Message:
    """What the authority needs to queue and route a worker's job (ids, times, sizes,
    prediction, the prompt's block chain and session)."""
    ticket = job.ctx
    call = ticket.call
    dist = job.dist
    return {
        "arrival": job.arrival_s,
        "model": call.model,
        "kind": call.kind,
        "stream": call.stream,
        "continuable": call.continuable,
        "max_tokens": job.max_tokens,
        "prompt_tokens": job.prompt_tokens,
        "tenant": job.tenant,
        "klass": ticket.klass.name,
        **({"support": None, "probs": None} if dist is None else dist_field(dist)),
        "rank_score": job.rank_score,
        "prefix": job.prefix,
        "block_tokens": job.block_tokens,
        "session": job.session,
    }


def dist_of(fields: Message) -> LengthDist | None:
    support = fields.get("support")
    return None if support is None else LengthDist(support, fields["probs"])


def vector_field(vec: Any) -> str:
    """A prompt embedding as text: its float32 bytes in base64 (exact, 2 kB for 384-d)."""
    return base64.b64encode(np.asarray(vec, dtype=np.float32).reshape(-1).tobytes()).decode()


def vector_of(field: str) -> np.ndarray[Any, np.dtype[np.float32]]:
    return np.frombuffer(base64.b64decode(field), dtype=np.float32)


def dist_field(dist: LengthDist) -> Message:
    return {"support": dist.support.tolist(), "probs": dist.probs.tolist()}


def error_fields(exc: GatewayError) -> Message:
    """A `GatewayError` as plain data (`raise_error` rebuilds it)."""
    out: Message = {"cls": type(exc).__name__, "message": exc.message, "param": exc.param,
                    "status": exc.status}  # fmt: skip
    retry_after = getattr(exc, "retry_after_s", None)
    if retry_after is not None:
        out["retry_after_s"] = retry_after
    return out


def rebuild_error(fields: Message) -> GatewayError:
    """The same `GatewayError` class with the same message, status and Retry-After."""
    cls = _error_classes().get(str(fields.get("cls")), GatewayError)
    exc = cls.__new__(cls)
    Exception.__init__(exc, fields["message"])
    exc.message, exc.param = fields["message"], fields.get("param")
    if exc.status != fields["status"]:
        exc.status = fields["status"]
    if "retry_after_s" in fields:
        exc.retry_after_s = fields["retry_after_s"]  # type: ignore[attr-defined]
    return exc


def _error_classes() -> dict[str, type[GatewayError]]:
    found: dict[str, type[GatewayError]] = {}
    todo: list[type[GatewayError]] = [errors.GatewayError]
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return found
