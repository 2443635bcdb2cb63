"""CUDA paths of kvstore (codec kernels in ``codecs``, and others beside them). Every module here
imports on machines without a GPU or triton: what needs them loads lazily."""
