"""The store in one process: its operations, its bytes at rest, the FP4 codecs its chunks are made of."""
