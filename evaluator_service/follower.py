"""Follow the aggregator: evaluate every new global version of every run it holds, report it
back, catch up after restarts."""

from __future__ import annotations

import logging
import queue
import random
import threading
from collections.abc import Callable

import grpc

from fedrl.algos.policy_io import policy_from_state
from fedrl.envs.evaluation import evaluate
from fedrl.federation.round import algo_config
from fedrl.federation.runconfig import NOT_EVALUATED_CHARS, parse_run_config
from fedrl.ops.metrics import EvaluatorMetrics
from fedrl.proto.v1 import control_pb2, control_pb2_grpc, federation_pb2
from fedrl.wire.codec import assemble
from fedrl.wire.rpc import EVALUATOR_HEADER, create_channel, weights_calls
from fedrl.wire.security import TLSFiles
from fedrl.wire.serde import evaluation_to_proto, event_from_proto, read_weight_messages

log = logging.getLogger("fedrl.evaluator")
MAX_IDLE_SECONDS = 5.0  # longest wait between looks for a new run
# What the aggregator answers about one version (its weights damaged or gone, its report refused):
# that version is not evaluated and the next ones are; any other code is the connection's
VERSION_FAILURES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DATA_LOSS,
                              grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE})
# An error of no kind the evaluation names (an OSError, a library's own): tried again after a
# reconnect, as a passing fault would be, and after this many tries that version is not evaluated
UNEXPECTED_TRIES = 3


class Follower:
    """Evaluates versions >= 1 of the aggregator's runs in order, each once."""

    def __init__(self, target: str, seed: int = 0, num_envs: int = 10,
                 on_report: Callable[[dict], None] = lambda r: None,
                 metrics: EvaluatorMetrics | None = None, tls: TLSFiles | None = None,
                 token: str | None = None) -> None:
        self.target, self.seed, self.num_envs, self.on_report = target, seed, num_envs, on_report
        self.tls, self.token = tls, token
        self.metrics = metrics or EvaluatorMetrics()
        self._stop = threading.Event()
        self.reports: dict[tuple[str, int], dict] = {}
        self.passes = 0  # watches followed to their end: every run then held was over and settled
        self._tries: dict[tuple[str, int], int] = {}  # unexpected errors so far, by version

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """Follow until :meth:`stop`. Nothing ends it early: a lost connection, a version that
        cannot be evaluated, or an error of any other kind is logged, and it follows again."""
        delay, idle = 0.2, 1.0
        while not self._stop.is_set():
            channel = create_channel(self.target, self.tls, self.token)
            try:
                before = len(self.reports)
                self._follow(channel)
                self.passes += 1
                delay = 0.2
                # The run is over: look for the next one, less often while nothing happens.
                idle = 1.0 if len(self.reports) > before else min(idle * 2, MAX_IDLE_SECONDS)
                self._stop.wait(idle)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # no run yet
                    idle = min(idle * 2, MAX_IDLE_SECONDS)
                    self._stop.wait(idle)
                    continue
                log.warning("aggregator at %s unavailable (%s); retrying in %.1fs", self.target, e.code().name, delay)
                self._stop.wait(delay * (0.5 + random.random()))
                delay = min(delay * 2, 10.0)
            except Exception:  # the follower thread must not end: it follows again, after a pause
                log.exception("following the aggregator at %s failed; following again in %.1fs", self.target, delay)
                self._stop.wait(delay * (0.5 + random.random()))
                delay = min(delay * 2, 10.0)
            finally:
                channel.close()

    def _follow(self, channel: grpc.Channel) -> None:
        control = control_pb2_grpc.ControlStub(channel)
        fetch, _ = weights_calls(channel)  # FetchGlobal with its chunks read in place
        # announced as an evaluator: a finished run's watchers then wait for its evaluations while
        # this stream is open (and no longer than that: without an evaluator there are none to wait for)
        stream = control.WatchRounds(control_pb2.WatchRequest(after_version=-1), wait_for_ready=True,
                                     metadata=((EVALUATOR_HEADER, "1"),))
        events: queue.Queue = queue.Queue()

        def pump() -> None:
            try:
                for ev in stream:
                    events.put(event_from_proto(ev))
            except Exception as e:  # the stream's end (an RpcError), or an event it cannot read
                events.put(e)
            events.put(None)

        threading.Thread(target=pump, daemon=True, name="evaluator-watch").start()
        pending: list[tuple[str, int]] = []
        done: set[tuple[str, int]] = set(self.reports)
        ended = False
        try:
            while not self._stop.is_set():
                # Drain what has arrived so versions already evaluated (EVALUATED) are skipped.
                block = not pending and not ended
                try:
                    item = events.get(timeout=0.5) if block else events.get_nowait()
                except queue.Empty:
                    if ended and not pending:
                        return
                    if not pending:
                        continue
                    item = "work"
                if isinstance(item, Exception):
                    raise item
                if item is None:
                    ended = True
                    continue
                if isinstance(item, dict):
                    key = (item["run_id"], item["version"])
                    if item["kind"] in ("EVALUATED", "NOT_EVALUATED"):
                        done.add(key)
                    elif item["kind"] == "ROUND_CLOSED" and key not in done and key not in pending:
                        pending.append(key)
                    continue
                pending = [k for k in pending if k not in done]
                if pending:
                    key = pending.pop(0)
                    try:
                        self._evaluate(control, fetch, *key)
                    except (ValueError, RuntimeError) as e:  # a bad model or config: report, go on
                        self._not_evaluated(control, *key, str(e))
                    except grpc.RpcError as e:
                        if e.code() not in VERSION_FAILURES:
                            raise  # the connection: reconnect, and this version is tried again
                        self._not_evaluated(control, *key, f"{e.code().name}: {e.details()}")
                    except Exception as e:  # unexpected: tried again after a reconnect, a few times
                        self._tries[key] = tries = self._tries.get(key, 0) + 1
                        if tries < UNEXPECTED_TRIES:
                            raise
                        self._not_evaluated(control, *key, f"{type(e).__name__}: {e} ({tries} tries)")
                    done.add(key)
        finally:
            stream.cancel()

    def _not_evaluated(self, control, run_id: str, version: int, why: str) -> None:
        """``version`` cannot be evaluated: logged, counted and told to the aggregator, whose
        watchers then wait for it no longer (a refusal of that report is only logged)."""
        log.error("run %s version %d not evaluated: %s", run_id, version, why)
        self.metrics.failures.inc()
        why = why if len(why) <= NOT_EVALUATED_CHARS else why[:NOT_EVALUATED_CHARS - 3] + "..."
        try:
            control.ReportEvaluation(control_pb2.EvaluationReport(run_id=run_id, version=version, not_evaluated=why),
                                     timeout=30)
        except grpc.RpcError as e:
            if e.code() not in VERSION_FAILURES:
                raise
            log.error("run %s version %d: the aggregator refused the report that it was not evaluated: %s: %s",
                      run_id, version, e.code().name, e.details())

    def _evaluate(self, control, fetch, run_id: str, version: int) -> None:
        try:
            status = control.GetStatus(control_pb2.StatusRequest(run_id=run_id), timeout=30)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return  # the run is no longer held
            raise
        if status.run_id != run_id or version in status.evaluated_versions or version in status.not_evaluated_versions:
            return  # another (or an earlier) evaluator did it (an aggregator before v1.4: another run)
        cfg = parse_run_config(status.config_json)
        if cfg.eval_episodes == 0:
            return
        manifest, chunks = read_weight_messages(fetch(
            federation_pb2.FetchRequest(run_id=run_id, version=version), timeout=120))
        state = assemble(manifest, chunks)
        hp = algo_config(cfg.algo, cfg.drpo, cfg.bc)
        policy = policy_from_state(state, hp.log_std_min, hp.log_std_max)
        env = cfg.env or status.env_id
        if not env:
            raise ValueError(f"run {run_id}: no evaluation env known; set env in the run config")
        res = evaluate(policy, env, cfg.eval_episodes, seed=self.seed, num_envs=self.num_envs)
        self.metrics.rollout("follower", len(res.returns), res.env_steps, res.seconds)
        report = {"run_id": run_id, "version": version, **res.as_dict()}
        report.pop("lengths", None)
        control.ReportEvaluation(evaluation_to_proto(report), timeout=30)
        self.reports[(run_id, version)] = report
        self.metrics.latest(report)
        self.on_report(report)
        log.info("run %s version %d: return %.1f, score %.1f", run_id, version, res.return_mean, res.score_mean)
