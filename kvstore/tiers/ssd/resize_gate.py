"""The ssd tier's gate between its LMDB readers and the writer that resizes the map (``SsdTier._abort``):
a map may be resized only while no transaction is open."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class Gate:
    """Many read transactions at once, or the writer's abort-and-resize alone (see ``_abort``)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = 0
        self._resizing = False

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._resizing)
            self._open += 1
        try:
            yield
        finally:
            with self._cond:
                self._open -= 1
                if not self._open:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        # Only holders of the tier's write lock call this, so two exclusives never overlap.
        # New transactions wait from here on, and the ones open drain.
        with self._cond:
            self._resizing = True
            self._cond.wait_for(lambda: not self._open)
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()
