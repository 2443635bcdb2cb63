"""The KVStore methods as both front ends serve them: each servicer body, what it receives of its call,
and how its messages are (de)serialized.

A servicer body (service.py) is a plain synchronous function, or a generator for a server-streaming
method, called as ``body(request, call)`` (a client-streaming body gets an iterable of requests):
proto messages in and out, a domain exception (kvstore.errors) for a refusal. It blocks as long as
its store calls do; where that runs is the front end's business: the gRPC adapter
(grpc_adapter.py) runs it in worker threads, off the event loop; the local socket (local.py) calls
it on the connection's own thread. ``Call`` is all a body knows of the transport.

Every request is checked before its body sees it (``parsed``: request_checks.check_request, the
shape of its fields), so a quick-path test, an auth check or a tier never sees a malformed key.

Request bytes that do not parse are the caller's error: gRPC's generated
``add_KVStoreServicer_to_server`` deserializes with ``Message.FromString``, and when that raises,
grpc answers before any handler runs (UNKNOWN in grpc.aio 1.85, INTERNAL in the sync server, with
a logged traceback), which would read as a daemon bug. Here each request deserializer returns an
``Undecodable`` instead of raising, and ``Method.handler`` turns it into INVALID_ARGUMENT when the
body reaches it (a client stream's messages one by one, in order).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from kvstore.errors import InvalidArgument
from kvstore.server.request_checks import check_request, is_valid
from kvstore.transport.fastpb import Encoded
from kvstore.transport.sender import Sender
from kvstore.v1 import kvstore_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"]
Metadata = Sequence[tuple[str, str | bytes]]
_F = TypeVar("_F", bound=Callable[..., Any])


@dataclass
class Call:
    """What a servicer body knows of its call besides the request: the caller's metadata (its bearer
    token: auth.py) and the fds it passed with the call (SCM_RIGHTS: an arena's memfd; only the
    local socket carries fds), and over the local socket the process that sent this request
    (``sender``: named by the kernel on the request's own messages, kvstore/transport/sender.py;
    the only process a body may read or write the memory of, through ``sender.reaching()``; None
    over gRPC, where no process can be named). The front end closes the fds no body took
    (``take_fds``)."""

    metadata: Metadata = ()
    fds: list[int] = field(default_factory=list)
    sender: Sender | None = None

    def take_fds(self) -> list[int]:
        """The fds passed with this call, now the caller's to close."""
        fds, self.fds = self.fds, []
        return fds

    def close_fds(self) -> None:
        for fd in self.take_fds():
            with contextlib.suppress(OSError):
                os.close(fd)


class Undecodable:
    """Stands in for a request message whose bytes did not parse."""

    def __init__(self, message_type: str, error: Exception) -> None:
        self.reason = f"request is not a valid {message_type} message: {error}"


def parsed(request: Any) -> Any:
    """``request``, parsed and checked: INVALID_ARGUMENT when its bytes did not parse or a field's
    shape is wrong (request_checks.py: before any body, auth check or tier sees it)."""
    if isinstance(request, Undecodable):
        raise InvalidArgument(request.reason)
    check_request(request)
    return request


# -- what a front end may ask of a body, beyond calling it (set on the body by a decorator) ----------------
def first_checked_by(check: Callable[[Any, Any, Call], None]) -> Callable[[_F], _F]:
    """A client-streaming body whose first message ``check(servicer, first, call)`` vets: a cheap,
    non-blocking check (auth, the header) that a front end collecting the stream runs as soon as the
    first message arrives, so that a stream that will be refused is not buffered whole first. The
    body still checks everything itself."""
    def mark(fn: _F) -> _F:
        fn.first_check = check  # type: ignore[attr-defined]
        return fn
    return mark


def quick_when(predicate: Callable[[Any, Any, Call], bool]) -> Callable[[_F], _F]:
    """A body that ``predicate(servicer, request, call)`` may declare quick: it will neither block nor
    run long (a small load the memory tier holds), so a front end with an event loop may run it
    right there instead of paying worker-thread hops. The predicate itself must be cheap, non-blocking
    and must not raise."""
    def mark(fn: _F) -> _F:
        fn.quick = predicate  # type: ignore[attr-defined]
        return fn
    return mark


# -- the method table -----------------------------------------------------------------------------------
def _lenient(cls: Any) -> Callable[[bytes | bytearray], Any]:
    def parse(data: bytes | bytearray) -> Any:
        try:
            return cls.FromString(data)
        except Exception as e:  # any failure to parse client bytes is the client's error
            return Undecodable(cls.DESCRIPTOR.full_name, e)
    return parse


def _serializer(cls: Any) -> Callable[[Any], bytes]:
    """``cls.SerializeToString``, and an answer the servicer encoded itself (kvstore/transport/fastpb.py) as it is."""
    serialize = cls.SerializeToString

    def to_bytes(msg: Any) -> bytes:
        return msg.raw if isinstance(msg, Encoded) else serialize(msg)
    return to_bytes


class Method(NamedTuple):
    """One KVStore method as both front ends serve it."""

    name: str
    #: ``handler(request, call)``: the body, requests checked with ``parsed`` (a client-streaming
    #: method's: an iterable of requests; a server-streaming method's answer: an iterator)
    handler: Callable[[Any, Call], Any]
    deserialize: Callable[[bytes | bytearray], Any]
    serialize: Callable[[Any], bytes]
    client_streaming: bool
    server_streaming: bool
    #: ``first_check(first_request, call)`` (``first_checked_by``), or None
    first_check: Callable[[Any, Call], None] | None
    #: ``quick(request, call)`` (``quick_when``), or None: never quick
    quick: Callable[[Any, Call], bool] | None


def _checked(body: Callable[[Any, Call], Any], client_streaming: bool) -> Callable[[Any, Call], Any]:
    if client_streaming:
        def each(requests: Iterable[Any]) -> Iterator[Any]:
            for r in requests:
                yield parsed(r)
        return lambda requests, call: body(each(requests), call)
    return lambda request, call: body(parsed(request), call)


def _bound(servicer: Any, fn: Callable[..., Any] | None) -> Callable[..., Any] | None:
    return None if fn is None else functools.partial(fn, servicer)


def _quick(servicer: Any, fn: Callable[..., bool] | None) -> Callable[[Any, Call], bool] | None:
    if fn is None:
        return None

    def quick(request: Any, call: Call) -> bool:  # a request the body will refuse is never quick
        return not isinstance(request, Undecodable) and is_valid(request) and fn(servicer, request, call)
    return quick


def methods(servicer: Any) -> dict[str, Method]:
    """Every method of the service by its full path ("/kvstore.v1.KVStore/LoadSession"), with lenient
    request deserializers and serializers that pass pre-encoded answers through. ``servicer`` must
    define a body for every method (a missing one fails here, at startup). The proto has unary,
    server-streaming and client-streaming methods only; a bidirectional one would have neither a
    body shape nor a front end here, so it is refused at startup too."""
    out = {}
    for m in SERVICE.methods:
        if m.client_streaming and m.server_streaming:
            raise TypeError(f"{m.name}: a bidirectional method, which neither front end serves")
        body = getattr(servicer, m.name)
        out[f"/{SERVICE.full_name}/{m.name}"] = Method(
            m.name, _checked(body, m.client_streaming), _lenient(getattr(pb, m.input_type.name)),
            _serializer(getattr(pb, m.output_type.name)), m.client_streaming, m.server_streaming,
            _bound(servicer, getattr(body, "first_check", None)), _quick(servicer, getattr(body, "quick", None)))
    return out
