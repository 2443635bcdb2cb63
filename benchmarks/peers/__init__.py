"""kvstore beside LMCache's server, redis-py and raw LMDB, on the same session bytes."""
