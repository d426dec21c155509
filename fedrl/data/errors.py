"""The one error type for bad dataset files: its message always names the file."""

from __future__ import annotations

from pathlib import Path


class DatasetError(ValueError):
    """A dataset file or directory that cannot be used, and why."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path, self.problem = str(path), problem
        super().__init__(f"{path}: {problem}")
