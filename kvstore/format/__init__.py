"""What kvstore stores, as bytes: model layouts and their FP4 codecs, chunks, keys, manifests, engine pages.

Nothing here talks to a network or a disk; the daemon, the clients and the tools all build on it."""
