"""Server reflection under both names clients ask for: grpc.reflection.v1 and v1alpha.

grpcio-reflection serves only v1alpha, while grpcurl and newer grpc-go / grpc-js / grpc-java
clients ask for v1 first. The two protocols have wire-identical messages (v1 is v1alpha renamed),
so one servicer answers both: the v1 service is the v1alpha handler registered under the v1 name.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1_SERVICE = "grpc.reflection.v1.ServerReflection"
V1ALPHA_SERVICE = reflection.SERVICE_NAME


def enable_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Serve reflection v1 and v1alpha for ``service_names`` (the reflection services are added)."""
    names = [*service_names, V1_SERVICE, V1ALPHA_SERVICE]
    servicer = reflection.aio.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers([
        grpc.method_handlers_generic_handler(service, {"ServerReflectionInfo": handler})
        for service in (V1_SERVICE, V1ALPHA_SERVICE)
    ])
