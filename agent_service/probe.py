"""A training agent's probe: is the task it trains for still standing?"""

from __future__ import annotations

import threading
import time

import grpc

from fedrl.proto.v1 import federation_pb2
from fedrl.wire.rpc import StopFlag


class TaskProbe:
    """While a round trains: every ``every`` seconds, ask the aggregator (NextTask with ``probe``:
    at once, no weights) whether the task still stands. A run stopped or a round closed under
    it makes :meth:`stop_now` true, so the round is abandoned within about ``every`` seconds
    instead of finishing minutes of local steps whose update would be refused. The polling thread
    starts only once a round has trained ``every`` seconds: a short round (the services' round
    overhead) pays nothing for it."""

    def __init__(self, stub, agent_id: str, task, stopped: StopFlag, every: float) -> None:
        self.reason: str | None = None
        self._stopped, self._done = stopped, threading.Event()
        self._stub, self._agent_id, self._task, self._every = stub, agent_id, task, every
        self._start_after = time.monotonic() + every if every > 0 else None

    def stop_now(self) -> bool:
        if self._start_after is not None and time.monotonic() >= self._start_after:
            self._start_after = None
            threading.Thread(target=self._poll, name="task-probe", daemon=True).start()
        return self._stopped.is_set() or self.reason is not None

    def close(self) -> None:
        self._done.set()

    def _poll(self) -> None:
        while not self._done.is_set() and not self._stopped.is_set():
            try:
                t = self._stub.NextTask(federation_pb2.TaskRequest(agent_id=self._agent_id, probe=True,
                                                                   run_id=self._task.run_id),
                                        timeout=max(self._every, 5.0))
            except grpc.RpcError:  # the stream's own errors decide about the connection
                if self._done.wait(self._every):
                    return
                continue
            if t.kind == federation_pb2.Task.STOP:
                self.reason = f"run {t.run_id} was stopped"
            elif t.kind == federation_pb2.Task.TRAIN and (t.run_id, t.round) != (self._task.run_id, self._task.round):
                self.reason = f"round {self._task.round} of run {self._task.run_id} closed without it"
            elif t.kind == federation_pb2.Task.WAIT:
                self.reason = f"round {self._task.round} of run {self._task.run_id} is no longer open"
            if self.reason is not None or self._done.wait(self._every):
                return
