"""The aggregator's state directory: every global version on disk, written before it is announced.

Layout::

    <state-dir>/runs/<run_id>/config.json          the validated run config
    <state-dir>/runs/<run_id>/v000003.safetensors  global version 3 (policy.*, maybe critic.*)
    <state-dir>/runs/<run_id>/v000003.xxh3          its XXH3-128, written with it: every read
                                                   (a late fetch, a restart) checks it
    <state-dir>/runs/<run_id>/events.jsonl         round events (a round's close is journaled
                                                   just before its version is written)
    <state-dir>/runs/<run_id>/participants.json    the agents a running run selected, their
                                                   normalisers and env (what a restart needs)
    <state-dir>/runs/<run_id>/FORMAT               the run's store format (2: every version has
                                                   its checksum; a run without it predates them)

Every version (and the config and participants) is written to a temporary name, fsynced, then
renamed: a reader never sees half a file. The event log is appended without fsync, except a
round's close, which is fsynced before its version is written: a power cut cannot leave a version
on disk whose close (who made it) is lost. A version's pages leave the page cache once it is on
disk: recent versions are served from the aggregator's memory, and each version's write then
takes the pages the last one left instead of new ones (``Store._write_bytes``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import xxhash
from safetensors.torch import load

# Bytes handed to one write() call. On the Linux this project is measured on (6.18, ext4), a
# 30 MB file written by writes of 2 MiB or more took ~70 ms of CPU in the kernel's copy
# (copy_folio_from_iter_atomic), by 1 MiB writes 6.4 ms (docs/performance.md, *The version
# write*). The aggregator writes a version of that size every round.
WRITE_SLICE = 1 << 20


class DamagedVersion(ValueError):
    """A stored version whose bytes are not those written (or whose values are not finite, or
    whose checksum is missing where its run's format keeps one, or which the disk cannot read)."""


# The store's format, written into each run's folder when it is made. 2: each version's checksum
# is written with it, so a version without one is damage (a crash between the two writes, or a
# file removed). A run folder with no FORMAT was made before checksums were kept: its versions
# are read as they are.
FORMAT = 2


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Store:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        try:
            (self.root / "runs").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(f"state directory {self.root}: cannot create {self.root / 'runs'} "
                          f"({e.strerror or e})") from None
        if not os.access(self.root / "runs", os.W_OK):
            raise PermissionError(f"state directory {self.root / 'runs'} is not writable")

    def run_dir(self, run_id: str) -> Path:
        return self.root / "runs" / run_id

    def version_path(self, run_id: str, version: int) -> Path:
        return self.run_dir(run_id) / f"v{version:06d}.safetensors"

    def create_run(self, run_id: str, config_json: str) -> None:
        """The run's folder with its config; on a failure (a full or read-only disk) nothing of
        it is left behind."""
        d = self.run_dir(run_id)
        d.mkdir(parents=True, exist_ok=False)
        try:
            self._write_bytes(d / "FORMAT", f"{FORMAT}\n".encode())
            self._write_bytes(d / "config.json", config_json.encode())
            _fsync_dir(d.parent)
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)
            raise

    def save_version(self, run_id: str, version: int, payload: bytes | Sequence[bytes | memoryview],
                     checksum: str | None = None) -> Path:
        """Write a version's safetensors bytes (what the aggregator also sends: one serialisation),
        given whole or as its pieces in order (``Encoded.pieces``: written from the tensors, with
        no joined copy of the payload first), and beside them their XXH3-128 (``checksum``, the
        manifest's, or computed here), which every later read checks."""
        path = self.version_path(run_id, version)
        pieces = (payload,) if isinstance(payload, (bytes, bytearray, memoryview)) else tuple(payload)
        if checksum is None:
            h = xxhash.xxh3_128()
            for piece in pieces:
                h.update(piece)
            checksum = h.hexdigest()
        self._write_bytes(path, pieces, keep_cached=False)
        self._write_bytes(self.checksum_path(run_id, version), checksum.encode())
        _fsync_dir(path.parent)
        return path

    def checksum_path(self, run_id: str, version: int) -> Path:
        return self.run_dir(run_id) / f"v{version:06d}.xxh3"

    def format(self, run_id: str) -> int:
        """The run's store format (1: made before checksums were kept)."""
        try:
            return int((self.run_dir(run_id) / "FORMAT").read_text().strip())
        except FileNotFoundError:
            return 1
        except (OSError, ValueError) as e:
            raise DamagedVersion(f"run {run_id}'s FORMAT file cannot be read: {e}") from None

    def read_version(self, run_id: str, version: int) -> bytes:
        """A stored version's bytes, checked against the checksum written with them
        (:class:`DamagedVersion` when they differ, when the checksum is missing in a run of
        format 2, or when the disk cannot read either; a version of a run made before checksums
        were kept is read as it is). FileNotFoundError when it is not stored."""
        try:
            data = self.version_path(run_id, version).read_bytes()
        except FileNotFoundError:
            raise
        except OSError as e:
            raise DamagedVersion(f"version {version} of run {run_id} cannot be read from disk: {e}") from None
        try:
            want = self.checksum_path(run_id, version).read_text().strip()
        except FileNotFoundError:
            if self.format(run_id) >= 2:
                raise DamagedVersion(f"version {version} of run {run_id} has no checksum beside it (a crash between "
                                     "its two writes, or a file removed): it cannot be verified") from None
            return data
        except (OSError, UnicodeDecodeError) as e:
            raise DamagedVersion(f"the checksum of version {version} of run {run_id} cannot be read: {e}") from None
        if xxhash.xxh3_128_hexdigest(data) != want:
            raise DamagedVersion(f"version {version} of run {run_id} is damaged on disk: its bytes are not those "
                                 "written (their checksum differs from the one stored with them)")
        return data

    def load_version(self, run_id: str, version: int) -> dict[str, torch.Tensor]:
        """A stored version's tensors, its checksum checked and every value finite."""
        state = load(self.read_version(run_id, version))
        bad = sorted(k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all()))
        if bad:
            raise DamagedVersion(f"version {version} of run {run_id} holds non-finite values ({', '.join(bad[:3])})")
        return state

    def versions(self, run_id: str) -> list[int]:
        return sorted(int(p.stem[1:]) for p in self.run_dir(run_id).glob("v*.safetensors"))

    def save_participants(self, run_id: str, data: Mapping[str, Any]) -> None:
        self._write_bytes(self.run_dir(run_id) / "participants.json", json.dumps(data).encode())

    def selected(self, run_id: str) -> list[str]:
        """The agents a stored run selected (none if it never began, or its file is unreadable)."""
        try:
            return list(json.loads((self.run_dir(run_id) / "participants.json").read_text())["selected"])
        except (OSError, ValueError, KeyError, TypeError):
            return []

    def run_ids(self) -> list[str]:
        """Every stored run's id, oldest first (ids start with their creation time)."""
        base = self.root / "runs"
        if not base.is_dir():
            return []
        return sorted(p.name for p in base.iterdir() if (p / "config.json").exists())

    def latest_run(self) -> str | None:
        """The most recent run id (ids start with their creation time), or None."""
        runs = sorted(p.name for p in (self.root / "runs").iterdir() if (p / "config.json").exists())
        return runs[-1] if runs else None

    def read_run(self, run_id: str) -> dict[str, Any]:
        """What was persisted of a run: config JSON, participants (or None), events."""
        d = self.run_dir(run_id)
        participants = None
        if (d / "participants.json").exists():
            participants = json.loads((d / "participants.json").read_text())
        events = []
        if (d / "events.jsonl").exists():
            for line in (d / "events.jsonl").read_text().splitlines():
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut by a crash mid-append: the last one
                    break
        return {"config_json": (d / "config.json").read_text(), "participants": participants, "events": events}

    def append_event(self, run_id: str, event: Mapping[str, Any], durable: bool = False) -> None:
        """Append one event line. Written through to the OS, so a killed process loses nothing; a
        power cut may lose the newest lines unless ``durable`` (fsynced, ~0.3 ms here), which a
        round's close is: the version written after it must never outlive its journal line."""
        with open(self.run_dir(run_id) / "events.jsonl", "a") as f:
            f.write(json.dumps(event) + "\n")
            if durable:
                f.flush()
                os.fsync(f.fileno())

    def _write_bytes(self, path: Path, data: bytes | Sequence[bytes | memoryview], keep_cached: bool = True) -> None:
        """Write ``data`` (whole, or its pieces in order) to ``path`` through a fsynced temporary
        file. ``keep_cached=False``: the file's pages leave the page cache once on disk (a
        version: the aggregator serves recent ones from memory, and reads one from disk only to
        resume or for a late fetch of an old one)."""
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb", buffering=0) as f:  # unbuffered: large pieces go straight to the file
                for piece in (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data:
                    mv = memoryview(piece).cast("B")
                    while len(mv):  # a raw write may take less than it is given
                        mv = mv[f.write(mv[:WRITE_SLICE]):]
                os.fsync(f.fileno())
                if not keep_cached and hasattr(os, "posix_fadvise"):
                    # Clean after the fsync, so dropped at once: the next version's write takes
                    # these pages again instead of new ones (docs/performance.md, *The version write*).
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
