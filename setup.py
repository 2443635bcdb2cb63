"""Builds the optional fused FP4 CPU kernels; kvstore falls back to torch when they are absent."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstore.format._fp4",
            ["kvstore/format/_fp4.c"],
            extra_compile_args=["-O3", "-fno-math-errno", "-fno-trapping-math", "-std=c11"],
            extra_link_args=["-lpthread"],
            optional=True,
        )
    ]
)
