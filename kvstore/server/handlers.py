"""Registering the KVStore servicer so that request bytes that do not parse are the caller's error.

gRPC's generated ``add_KVStoreServicer_to_server`` deserializes with ``Message.FromString``; when
that raises, grpc answers before any handler runs: UNKNOWN ("Unexpected <class DecodeError>") in
grpc.aio 1.85, INTERNAL ("Exception deserializing request!") in the sync server, with a logged
traceback; there is no server option to change that code. A client's garbage would read as a
daemon bug. Here each request deserializer returns an ``Undecodable``
instead of raising, and the handler (``service.rpc``) answers it with INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import grpc

from kvstore.transport.fastpb import Encoded
from kvstore.v1 import kvstore_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"]


class Undecodable:
    """Stands in for a request message whose bytes did not parse."""

    def __init__(self, message_type: str, error: Exception) -> None:
        self.reason = f"request is not a valid {message_type} message: {error}"


def _lenient(cls: Any) -> Callable[[bytes | bytearray], Any]:
    def parse(data: bytes | bytearray) -> Any:
        try:
            return cls.FromString(data)
        except Exception as e:  # any failure to parse client bytes is the client's error
            return Undecodable(cls.DESCRIPTOR.full_name, e)
    return parse


_KINDS = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
          (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}


def _serializer(cls: Any) -> Callable[[Any], bytes]:
    """``cls.SerializeToString``, and an answer the servicer encoded itself (kvstore/transport/fastpb.py) as it is."""
    serialize = cls.SerializeToString

    def to_bytes(msg: Any) -> bytes:
        return msg.raw if isinstance(msg, Encoded) else serialize(msg)
    return to_bytes


class Method(NamedTuple):
    """One KVStore method as both listeners serve it: gRPC (``add_service``) and the local socket
    (server/local.py)."""

    handler: Callable[..., Any]
    deserialize: Callable[[bytes | bytearray], Any]
    serialize: Callable[[Any], bytes]
    client_streaming: bool
    server_streaming: bool


def methods(servicer: Any) -> dict[str, Method]:
    """Every method of the service by its full path ("/kvstore.v1.KVStore/LoadSession"), with lenient
    request deserializers and serializers that pass pre-encoded answers through."""
    return {f"/{SERVICE.full_name}/{m.name}": Method(
                getattr(servicer, m.name), _lenient(getattr(pb, m.input_type.name)),
                _serializer(getattr(pb, m.output_type.name)), m.client_streaming, m.server_streaming)
            for m in SERVICE.methods}


def add_service(servicer: Any, server: grpc.aio.Server) -> None:
    """``add_KVStoreServicer_to_server``, with the lenient deserializers of ``methods``."""
    handlers = {}
    for path, m in methods(servicer).items():
        make = _KINDS[(m.client_streaming, m.server_streaming)]
        handlers[path.rsplit("/", 1)[1]] = make(m.handler, request_deserializer=m.deserialize,
                                                response_serializer=m.serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
