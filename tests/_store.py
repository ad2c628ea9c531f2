"""A stand-in for a c10d key-value store, for code that talks to the process group's store."""

from __future__ import annotations

import threading


class DictStore:
    """The calls the watchdog and the save at an exception make of a c10d store, over a dict shared by threads."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def set(self, key: str, value: str) -> None:
        with self.lock:
            self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        with self.lock:
            return self.data[key]

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(k in self.data for k in keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        with self.lock:  # c10d's semantics: a missing key counts as "" (set it), else keep what is there
            if self.data.get(key, b"") == expected.encode():
                self.data[key] = desired.encode()
            return self.data[key]
