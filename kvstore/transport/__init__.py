"""How chunk bytes travel between a client and the daemon: carriers (shared-memory arena or the gRPC
stream), the stream's framing, hand-encoded load answers, the local socket's channel, proto <-> domain."""
