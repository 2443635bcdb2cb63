from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RetryReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RETRY_REASON_UNSPECIFIED: _ClassVar[RetryReason]
    UNKNOWN_ARENA: _ClassVar[RetryReason]
    ARENA_TOO_SMALL: _ClassVar[RetryReason]
    CALLER_MEMORY_REFUSED: _ClassVar[RetryReason]
    CALLER_MEMORY_TOO_SMALL: _ClassVar[RetryReason]
RETRY_REASON_UNSPECIFIED: RetryReason
UNKNOWN_ARENA: RetryReason
ARENA_TOO_SMALL: RetryReason
CALLER_MEMORY_REFUSED: RetryReason
CALLER_MEMORY_TOO_SMALL: RetryReason

class DeviceBufferHandle(_message.Message):
    __slots__ = ("gpu_uuid", "handle", "storage_bytes", "storage_offset", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "size")
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    gpu_uuid: str
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    size: int
    def __init__(self, gpu_uuid: _Optional[str] = ..., handle: _Optional[bytes] = ..., storage_bytes: _Optional[int] = ..., storage_offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., size: _Optional[int] = ...) -> None: ...

class AttachDeviceBufferRequest(_message.Message):
    __slots__ = ("buffer",)
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    buffer: DeviceBufferHandle
    def __init__(self, buffer: _Optional[_Union[DeviceBufferHandle, _Mapping]] = ...) -> None: ...

class AttachDeviceBufferResponse(_message.Message):
    __slots__ = ("buffer_id",)
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    buffer_id: str
    def __init__(self, buffer_id: _Optional[str] = ...) -> None: ...

class LoadSessionToDeviceRequest(_message.Message):
    __slots__ = ("namespace", "session_id", "buffer_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    session_id: str
    buffer_id: str
    def __init__(self, namespace: _Optional[str] = ..., session_id: _Optional[str] = ..., buffer_id: _Optional[str] = ...) -> None: ...

class DeviceChunk(_message.Message):
    __slots__ = ("index", "offset", "size")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    size: int
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class LoadSessionToDeviceResponse(_message.Message):
    __slots__ = ("session", "chunks", "needed_bytes", "device_chunks")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NEEDED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    session: Session
    chunks: _containers.RepeatedCompositeFieldContainer[DeviceChunk]
    needed_bytes: int
    device_chunks: int
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[DeviceChunk, _Mapping]]] = ..., needed_bytes: _Optional[int] = ..., device_chunks: _Optional[int] = ...) -> None: ...

class AttachArenaRequest(_message.Message):
    __slots__ = ("path", "size", "nonce")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    nonce: bytes
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class AttachArenaResponse(_message.Message):
    __slots__ = ("arena_id",)
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    arena_id: str
    def __init__(self, arena_id: _Optional[str] = ...) -> None: ...

class DetachArenaRequest(_message.Message):
    __slots__ = ("arena_id",)
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    arena_id: str
    def __init__(self, arena_id: _Optional[str] = ...) -> None: ...

class DetachArenaResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("version", "chunk_tokens", "layouts", "tiers", "host_id", "shm_dir", "max_message_bytes", "write_mode", "carriers", "layout_info", "local_socket")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_DIR_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITE_MODE_FIELD_NUMBER: _ClassVar[int]
    CARRIERS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_INFO_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    version: str
    chunk_tokens: int
    layouts: _containers.RepeatedScalarFieldContainer[str]
    tiers: _containers.RepeatedScalarFieldContainer[str]
    host_id: str
    shm_dir: str
    max_message_bytes: int
    write_mode: str
    carriers: _containers.RepeatedScalarFieldContainer[str]
    layout_info: _containers.RepeatedCompositeFieldContainer[LayoutInfo]
    local_socket: str
    def __init__(self, version: _Optional[str] = ..., chunk_tokens: _Optional[int] = ..., layouts: _Optional[_Iterable[str]] = ..., tiers: _Optional[_Iterable[str]] = ..., host_id: _Optional[str] = ..., shm_dir: _Optional[str] = ..., max_message_bytes: _Optional[int] = ..., write_mode: _Optional[str] = ..., carriers: _Optional[_Iterable[str]] = ..., layout_info: _Optional[_Iterable[_Union[LayoutInfo, _Mapping]]] = ..., local_socket: _Optional[str] = ...) -> None: ...

class CacheInfo(_message.Message):
    __slots__ = ("name", "layer", "m", "channels", "format", "code_bytes", "scale_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    M_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    CODE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCALE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    layer: int
    m: int
    channels: int
    format: str
    code_bytes: int
    scale_bytes: int
    def __init__(self, name: _Optional[str] = ..., layer: _Optional[int] = ..., m: _Optional[int] = ..., channels: _Optional[int] = ..., format: _Optional[str] = ..., code_bytes: _Optional[int] = ..., scale_bytes: _Optional[int] = ...) -> None: ...

class LayoutInfo(_message.Message):
    __slots__ = ("name", "layout_id", "bytes_per_token", "n_layers", "window", "chunk_bytes", "caches")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHES_FIELD_NUMBER: _ClassVar[int]
    name: str
    layout_id: bytes
    bytes_per_token: float
    n_layers: int
    window: int
    chunk_bytes: int
    caches: _containers.RepeatedCompositeFieldContainer[CacheInfo]
    def __init__(self, name: _Optional[str] = ..., layout_id: _Optional[bytes] = ..., bytes_per_token: _Optional[float] = ..., n_layers: _Optional[int] = ..., window: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., caches: _Optional[_Iterable[_Union[CacheInfo, _Mapping]]] = ...) -> None: ...

class SaveHeader(_message.Message):
    __slots__ = ("namespace", "layout_id", "parent_key", "first_index", "arena_id", "arena_bytes", "commit", "from_caller", "append", "more_from_caller")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    FROM_CALLER_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    MORE_FROM_CALLER_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    layout_id: bytes
    parent_key: bytes
    first_index: int
    arena_id: str
    arena_bytes: int
    commit: Session
    from_caller: CallerPages
    append: SessionAppend
    more_from_caller: _containers.RepeatedCompositeFieldContainer[CallerPages]
    def __init__(self, namespace: _Optional[str] = ..., layout_id: _Optional[bytes] = ..., parent_key: _Optional[bytes] = ..., first_index: _Optional[int] = ..., arena_id: _Optional[str] = ..., arena_bytes: _Optional[int] = ..., commit: _Optional[_Union[Session, _Mapping]] = ..., from_caller: _Optional[_Union[CallerPages, _Mapping]] = ..., append: _Optional[_Union[SessionAppend, _Mapping]] = ..., more_from_caller: _Optional[_Iterable[_Union[CallerPages, _Mapping]]] = ...) -> None: ...

class SessionAppend(_message.Message):
    __slots__ = ("session_id", "base", "chunk_keys", "token_count", "tail", "last_token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    LAST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    base: int
    chunk_keys: _containers.RepeatedScalarFieldContainer[bytes]
    token_count: int
    tail: bytes
    last_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., base: _Optional[int] = ..., chunk_keys: _Optional[_Iterable[bytes]] = ..., token_count: _Optional[int] = ..., tail: _Optional[bytes] = ..., last_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CallerPages(_message.Message):
    __slots__ = ("region", "groups", "block_hashes")
    REGION_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    region: CallerMemory
    groups: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, region: _Optional[_Union[CallerMemory, _Mapping]] = ..., groups: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SaveChunksRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: SaveHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[SaveHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SaveChunksResponse(_message.Message):
    __slots__ = ("keys", "written", "session", "generation", "created_at", "updated_at", "chunk_count")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    written: int
    session: Session
    generation: int
    created_at: float
    updated_at: float
    chunk_count: int
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., written: _Optional[int] = ..., session: _Optional[_Union[Session, _Mapping]] = ..., generation: _Optional[int] = ..., created_at: _Optional[float] = ..., updated_at: _Optional[float] = ..., chunk_count: _Optional[int] = ...) -> None: ...

class LoadChunksRequest(_message.Message):
    __slots__ = ("namespace", "keys", "arena_id", "into", "more_into")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    INTO_FIELD_NUMBER: _ClassVar[int]
    MORE_INTO_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    arena_id: str
    into: CallerMemory
    more_into: _containers.RepeatedCompositeFieldContainer[CallerMemory]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., arena_id: _Optional[str] = ..., into: _Optional[_Union[CallerMemory, _Mapping]] = ..., more_into: _Optional[_Iterable[_Union[CallerMemory, _Mapping]]] = ...) -> None: ...

class CallerMemory(_message.Message):
    __slots__ = ("address", "size", "slot_offsets", "slot_bytes")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SLOT_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    address: int
    size: int
    slot_offsets: _containers.RepeatedScalarFieldContainer[int]
    slot_bytes: int
    def __init__(self, address: _Optional[int] = ..., size: _Optional[int] = ..., slot_offsets: _Optional[_Iterable[int]] = ..., slot_bytes: _Optional[int] = ...) -> None: ...

class ChunkData(_message.Message):
    __slots__ = ("data", "indices", "shm")
    DATA_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    indices: _containers.RepeatedScalarFieldContainer[int]
    shm: ShmHandle
    def __init__(self, data: _Optional[bytes] = ..., indices: _Optional[_Iterable[int]] = ..., shm: _Optional[_Union[ShmHandle, _Mapping]] = ...) -> None: ...

class ShmHandle(_message.Message):
    __slots__ = ("size", "indices", "offsets", "sizes", "arena_id", "caller_memory")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    CALLER_MEMORY_FIELD_NUMBER: _ClassVar[int]
    size: int
    indices: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    arena_id: str
    caller_memory: bool
    def __init__(self, size: _Optional[int] = ..., indices: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ..., arena_id: _Optional[str] = ..., caller_memory: _Optional[bool] = ...) -> None: ...

class Retention(_message.Message):
    __slots__ = ("pinned", "ttl_s")
    PINNED_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    pinned: bool
    ttl_s: float
    def __init__(self, pinned: _Optional[bool] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "namespace", "layout_id", "layout_name", "token_count", "chunk_tokens", "chunk_keys", "tail", "last_token_ids", "created_at", "updated_at", "retention", "metadata", "generation")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_KEYS_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    LAST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace: str
    layout_id: bytes
    layout_name: str
    token_count: int
    chunk_tokens: int
    chunk_keys: _containers.RepeatedScalarFieldContainer[bytes]
    tail: bytes
    last_token_ids: _containers.RepeatedScalarFieldContainer[int]
    created_at: float
    updated_at: float
    retention: Retention
    metadata: _containers.ScalarMap[str, str]
    generation: int
    def __init__(self, session_id: _Optional[str] = ..., namespace: _Optional[str] = ..., layout_id: _Optional[bytes] = ..., layout_name: _Optional[str] = ..., token_count: _Optional[int] = ..., chunk_tokens: _Optional[int] = ..., chunk_keys: _Optional[_Iterable[bytes]] = ..., tail: _Optional[bytes] = ..., last_token_ids: _Optional[_Iterable[int]] = ..., created_at: _Optional[float] = ..., updated_at: _Optional[float] = ..., retention: _Optional[_Union[Retention, _Mapping]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., generation: _Optional[int] = ...) -> None: ...

class LoadSessionRequest(_message.Message):
    __slots__ = ("namespace", "session_id", "arena_id", "into")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    INTO_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    session_id: str
    arena_id: str
    into: CallerMemory
    def __init__(self, namespace: _Optional[str] = ..., session_id: _Optional[str] = ..., arena_id: _Optional[str] = ..., into: _Optional[_Union[CallerMemory, _Mapping]] = ...) -> None: ...

class LoadSessionResponse(_message.Message):
    __slots__ = ("session", "chunks")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    session: Session
    chunks: ChunkData
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ..., chunks: _Optional[_Union[ChunkData, _Mapping]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "layout_id", "token_ids")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    layout_id: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[str] = ..., layout_id: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TierCount(_message.Message):
    __slots__ = ("tier", "chunks")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    chunks: int
    def __init__(self, tier: _Optional[str] = ..., chunks: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("cached_tokens", "requested_tokens", "chunks", "tiers")
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    requested_tokens: int
    chunks: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierCount]
    def __init__(self, cached_tokens: _Optional[int] = ..., requested_tokens: _Optional[int] = ..., chunks: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierCount, _Mapping]]] = ...) -> None: ...

class CommitSessionRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: Session
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ...) -> None: ...

class CommitSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: Session
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("namespace", "session_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    session_id: str
    def __init__(self, namespace: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class GetSessionResponse(_message.Message):
    __slots__ = ("session", "tiers")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    session: Session
    tiers: _containers.RepeatedCompositeFieldContainer[TierCount]
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ..., tiers: _Optional[_Iterable[_Union[TierCount, _Mapping]]] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class SessionSummary(_message.Message):
    __slots__ = ("namespace", "session_id", "layout_name", "token_count", "chunks", "updated_at", "retention")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    session_id: str
    layout_name: str
    token_count: int
    chunks: int
    updated_at: float
    retention: Retention
    def __init__(self, namespace: _Optional[str] = ..., session_id: _Optional[str] = ..., layout_name: _Optional[str] = ..., token_count: _Optional[int] = ..., chunks: _Optional[int] = ..., updated_at: _Optional[float] = ..., retention: _Optional[_Union[Retention, _Mapping]] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionSummary]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionSummary, _Mapping]]] = ...) -> None: ...

class DeleteSessionRequest(_message.Message):
    __slots__ = ("namespace", "session_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    session_id: str
    def __init__(self, namespace: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class DeleteSessionResponse(_message.Message):
    __slots__ = ("freed_chunks",)
    FREED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    freed_chunks: int
    def __init__(self, freed_chunks: _Optional[int] = ...) -> None: ...

class TouchSessionRequest(_message.Message):
    __slots__ = ("namespace", "session_id", "retention")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    session_id: str
    retention: Retention
    def __init__(self, namespace: _Optional[str] = ..., session_id: _Optional[str] = ..., retention: _Optional[_Union[Retention, _Mapping]] = ...) -> None: ...

class TouchSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: Session
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "persistent", "used_bytes", "capacity_bytes", "items", "raw_bytes", "hits", "evictions", "demotions", "promotions", "verify_failures", "errors", "degraded", "last_error")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FAILURES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    persistent: bool
    used_bytes: int
    capacity_bytes: int
    items: int
    raw_bytes: int
    hits: int
    evictions: int
    demotions: int
    promotions: int
    verify_failures: int
    errors: int
    degraded: bool
    last_error: str
    def __init__(self, name: _Optional[str] = ..., persistent: _Optional[bool] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., items: _Optional[int] = ..., raw_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., evictions: _Optional[int] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ..., verify_failures: _Optional[int] = ..., errors: _Optional[int] = ..., degraded: _Optional[bool] = ..., last_error: _Optional[str] = ...) -> None: ...

class BytesPerToken(_message.Message):
    __slots__ = ("tokens", "sessions", "unique_chunks", "formula", "payload", "chunk_overhead", "manifests", "stored", "raw", "lmdb_overhead", "measured", "baseline_swa_snapshot")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    UNIQUE_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    FORMULA_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CHUNK_OVERHEAD_FIELD_NUMBER: _ClassVar[int]
    MANIFESTS_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    LMDB_OVERHEAD_FIELD_NUMBER: _ClassVar[int]
    MEASURED_FIELD_NUMBER: _ClassVar[int]
    BASELINE_SWA_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    sessions: int
    unique_chunks: int
    formula: float
    payload: int
    chunk_overhead: int
    manifests: int
    stored: int
    raw: int
    lmdb_overhead: int
    measured: float
    baseline_swa_snapshot: int
    def __init__(self, tokens: _Optional[int] = ..., sessions: _Optional[int] = ..., unique_chunks: _Optional[int] = ..., formula: _Optional[float] = ..., payload: _Optional[int] = ..., chunk_overhead: _Optional[int] = ..., manifests: _Optional[int] = ..., stored: _Optional[int] = ..., raw: _Optional[int] = ..., lmdb_overhead: _Optional[int] = ..., measured: _Optional[float] = ..., baseline_swa_snapshot: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "lookups", "requested_tokens", "hit_tokens", "loaded_chunks", "missed_chunks", "sessions", "bytes_per_token", "transport", "prefetch", "namespaces")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOADED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    MISSED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    lookups: int
    requested_tokens: int
    hit_tokens: int
    loaded_chunks: int
    missed_chunks: int
    sessions: int
    bytes_per_token: BytesPerToken
    transport: TransportStats
    prefetch: PrefetchStats
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceUsage]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., lookups: _Optional[int] = ..., requested_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., loaded_chunks: _Optional[int] = ..., missed_chunks: _Optional[int] = ..., sessions: _Optional[int] = ..., bytes_per_token: _Optional[_Union[BytesPerToken, _Mapping]] = ..., transport: _Optional[_Union[TransportStats, _Mapping]] = ..., prefetch: _Optional[_Union[PrefetchStats, _Mapping]] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceUsage, _Mapping]]] = ...) -> None: ...

class NamespaceUsage(_message.Message):
    __slots__ = ("namespace", "host_bytes", "ssd_bytes", "sessions", "host_quota", "has_host_quota", "ssd_quota", "has_ssd_quota", "sessions_quota", "has_sessions_quota")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    SSD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    HOST_QUOTA_FIELD_NUMBER: _ClassVar[int]
    HAS_HOST_QUOTA_FIELD_NUMBER: _ClassVar[int]
    SSD_QUOTA_FIELD_NUMBER: _ClassVar[int]
    HAS_SSD_QUOTA_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_QUOTA_FIELD_NUMBER: _ClassVar[int]
    HAS_SESSIONS_QUOTA_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    host_bytes: int
    ssd_bytes: int
    sessions: int
    host_quota: int
    has_host_quota: bool
    ssd_quota: int
    has_ssd_quota: bool
    sessions_quota: int
    has_sessions_quota: bool
    def __init__(self, namespace: _Optional[str] = ..., host_bytes: _Optional[int] = ..., ssd_bytes: _Optional[int] = ..., sessions: _Optional[int] = ..., host_quota: _Optional[int] = ..., has_host_quota: _Optional[bool] = ..., ssd_quota: _Optional[int] = ..., has_ssd_quota: _Optional[bool] = ..., sessions_quota: _Optional[int] = ..., has_sessions_quota: _Optional[bool] = ...) -> None: ...

class NamespaceStatsRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class NamespaceStatsResponse(_message.Message):
    __slots__ = ("namespaces",)
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceUsage]
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceUsage, _Mapping]]] = ...) -> None: ...

class TransportStats(_message.Message):
    __slots__ = ("arenas", "arena_calls", "overflow_calls", "stream_calls", "attaches", "detaches", "local_calls", "caller_memory_calls")
    ARENAS_FIELD_NUMBER: _ClassVar[int]
    ARENA_CALLS_FIELD_NUMBER: _ClassVar[int]
    OVERFLOW_CALLS_FIELD_NUMBER: _ClassVar[int]
    STREAM_CALLS_FIELD_NUMBER: _ClassVar[int]
    ATTACHES_FIELD_NUMBER: _ClassVar[int]
    DETACHES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_CALLS_FIELD_NUMBER: _ClassVar[int]
    CALLER_MEMORY_CALLS_FIELD_NUMBER: _ClassVar[int]
    arenas: int
    arena_calls: int
    overflow_calls: int
    stream_calls: int
    attaches: int
    detaches: int
    local_calls: int
    caller_memory_calls: int
    def __init__(self, arenas: _Optional[int] = ..., arena_calls: _Optional[int] = ..., overflow_calls: _Optional[int] = ..., stream_calls: _Optional[int] = ..., attaches: _Optional[int] = ..., detaches: _Optional[int] = ..., local_calls: _Optional[int] = ..., caller_memory_calls: _Optional[int] = ...) -> None: ...

class EvictSessionRequest(_message.Message):
    __slots__ = ("namespace", "session_id", "tier")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    session_id: str
    tier: str
    def __init__(self, namespace: _Optional[str] = ..., session_id: _Optional[str] = ..., tier: _Optional[str] = ...) -> None: ...

class EvictSessionResponse(_message.Message):
    __slots__ = ("moved_chunks",)
    MOVED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    moved_chunks: int
    def __init__(self, moved_chunks: _Optional[int] = ...) -> None: ...

class PrefetchSessionRequest(_message.Message):
    __slots__ = ("namespace", "session_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    session_id: str
    def __init__(self, namespace: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class PrefetchSessionResponse(_message.Message):
    __slots__ = ("queued", "already_fast", "coalesced", "dropped", "tier")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_FAST_FIELD_NUMBER: _ClassVar[int]
    COALESCED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    queued: int
    already_fast: int
    coalesced: bool
    dropped: bool
    tier: str
    def __init__(self, queued: _Optional[int] = ..., already_fast: _Optional[int] = ..., coalesced: _Optional[bool] = ..., dropped: _Optional[bool] = ..., tier: _Optional[str] = ...) -> None: ...

class PrefetchStats(_message.Message):
    __slots__ = ("requested", "completed", "chunks_promoted", "coalesced", "dropped", "chunks_skipped", "pending")
    REQUESTED_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_PROMOTED_FIELD_NUMBER: _ClassVar[int]
    COALESCED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    requested: int
    completed: int
    chunks_promoted: int
    coalesced: int
    dropped: int
    chunks_skipped: int
    pending: int
    def __init__(self, requested: _Optional[int] = ..., completed: _Optional[int] = ..., chunks_promoted: _Optional[int] = ..., coalesced: _Optional[int] = ..., dropped: _Optional[int] = ..., chunks_skipped: _Optional[int] = ..., pending: _Optional[int] = ...) -> None: ...

class RegisterLayoutRequest(_message.Message):
    __slots__ = ("definition", "namespace")
    DEFINITION_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    definition: bytes
    namespace: str
    def __init__(self, definition: _Optional[bytes] = ..., namespace: _Optional[str] = ...) -> None: ...

class RegisterLayoutResponse(_message.Message):
    __slots__ = ("layout_id", "name", "bytes_per_token")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    layout_id: bytes
    name: str
    bytes_per_token: float
    def __init__(self, layout_id: _Optional[bytes] = ..., name: _Optional[str] = ..., bytes_per_token: _Optional[float] = ...) -> None: ...

class LookupKeysRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupKeysResponse(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tiers: _Optional[_Iterable[str]] = ...) -> None: ...

class RetryInfo(_message.Message):
    __slots__ = ("reason", "needed_bytes")
    REASON_FIELD_NUMBER: _ClassVar[int]
    NEEDED_BYTES_FIELD_NUMBER: _ClassVar[int]
    reason: RetryReason
    needed_bytes: int
    def __init__(self, reason: _Optional[_Union[RetryReason, str]] = ..., needed_bytes: _Optional[int] = ...) -> None: ...
