"""Builds the optional C kernels; kvstore falls back to pure Python (torch, xxhash) when they are absent:
the fused FP4 codecs (kvstore/format/_fp4.c) and the batch chunk checks (kvstore/format/_chunks.c)."""

from setuptools import Extension, setup

_FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-std=c11"]
_XXHASH = ["kvstore/format/vendor/xxhash.h", "kvstore/format/vendor/xxh_x86dispatch.c",
           "kvstore/format/vendor/xxh_x86dispatch.h"]

setup(
    ext_modules=[
        Extension(
            "kvstore.format._fp4",
            ["kvstore/format/_fp4.c"],
            extra_compile_args=_FLAGS,
            extra_link_args=["-lpthread"],
            optional=True,
        ),
        Extension(
            "kvstore.format._chunks",
            ["kvstore/format/_chunks.c"],
            depends=_XXHASH,  # included by _chunks.c, not compiled on their own
            extra_compile_args=_FLAGS,
            extra_link_args=["-lpthread"],
            optional=True,
        ),
    ]
)
