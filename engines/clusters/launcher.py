"""The engine processes of one local cluster: spawned (``multiprocessing`` spawn context) with
their shared buffers, waited for until ready, watched (a process that died, whatever its
role, is reported by :meth:`EngineProcesses.failures`), stopped — killed if they do not stop
— and reaped even if the owner is garbage-collected or the interpreter exits."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import weakref
from collections.abc import Sequence

import torch.multiprocessing as mp
import zmq

from tokenlake.engines.clusters.engine_process import EngineSpec, main
from tokenlake.engines.core.engine_base import EngineHost
from tokenlake.engines.core.shared_buffers import InstanceBuffers
from tokenlake.engines.dataplane_config import DataPlaneConfig, PeerFailedError
from tokenlake.engines.transport import messages
from tokenlake.engines.transport.auth import AuthError, FrameAuth
from tokenlake.engines.transport.peers import LauncherId, PeerKey, bind_random
from tokenlake.engines.transport.process_group import GroupSpec
from tokenlake.wire import WireError

_PRELOAD = [
    "tokenlake.engines.clusters.engine_process",
    "tokenlake.engines.core.query_engine",
    "tokenlake.engines.core.transfer_engine",
    "tokenlake.engines.clusters.compute_process",
]


def process_context():
    """Where engine and compute processes come from: a fork server that imported torch and
    the engines once (a clean, single-threaded process that never touched CUDA), so starting
    or restarting an engine takes a fork instead of a fresh interpreter importing torch."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def stop_helper_processes(timeout_s: float = 5.0) -> None:
    """Stop the fork server and ``multiprocessing``'s resource tracker, which otherwise
    outlive this process by the seconds they take to notice its exit. Call it last, once
    every process they served is stopped (a later start makes new ones); one that does not
    stop within ``timeout_s`` (a process still holds its pipe) is killed."""
    from multiprocessing import forkserver, resource_tracker

    for helper, pid_attr in (
        (forkserver._forkserver, "_forkserver_pid"),
        (resource_tracker._resource_tracker, "_pid"),
    ):
        pid, stop = getattr(helper, pid_attr, None), getattr(helper, "_stop", None)
        if pid is None or stop is None:
            continue
        stopper = threading.Thread(target=_quietly, args=(stop,), daemon=True)
        stopper.start()
        stopper.join(timeout_s)
        if stopper.is_alive():  # _stop waits for the process: end it
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            stopper.join(timeout_s)


def _quietly(stop) -> None:
    with contextlib.suppress(OSError):  # already gone
        stop()


class Started:
    """A started process and its identity (pid and start time). Whether it runs is read from
    ``/proc``, not from the fork server that forked it: a killed fork server makes every
    child it forked look dead to ``multiprocessing`` (and unkillable through it), though
    they all still run."""

    def __init__(self, process) -> None:
        self.process = process
        self.identity = LauncherId.of(process.pid)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.identity.alive()

    def kill(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def stop_processes(processes: Sequence[Started], grace_s: float) -> None:
    """Wait ``grace_s`` in total for every process to end, then kill the rest (a stopped or
    hung engine ignores ``Stop``; ``SIGKILL`` also ends a stopped one)."""
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.process.join(max(0.0, deadline - time.monotonic()))
    while any(p.alive() for p in processes) and time.monotonic() < deadline:
        time.sleep(0.02)  # the fork server is gone: join no longer waits
    for p in processes:
        p.kill()
    for p in processes:
        p.process.join(5.0)


class EngineProcesses:
    """Spawns and tracks the engine processes of ``num_instances`` instances.

    With ``config.separate_hosts`` each engine is handed only its own instance's buffers;
    otherwise every instance's, as processes on one host can map them all.
    """

    def __init__(
        self,
        config: DataPlaneConfig,
        ctx: zmq.Context,
        buffers: list[InstanceBuffers],
        group: GroupSpec | None,
        event_handles: dict[int, bytes] | None,
        auth: FrameAuth,
        secret_path: str,
    ) -> None:
        self._auth, self._secret_path = auth, secret_path
        self.config = config
        self._ctx = ctx
        self._buffers = buffers
        self._group = group
        self._event_handles = event_handles
        self.processes: dict[PeerKey, Started] = {}
        self._finalizer = weakref.finalize(self, stop_processes, [], 0.0)

    def spawn(self, keys: list[PeerKey]) -> dict[PeerKey, str]:
        """Start engines ``keys`` and wait until each reported ready; returns their endpoints.
        Raises :class:`PeerFailedError` if one exits or is not ready in time."""
        cfg = self.config
        ready = self._ctx.socket(zmq.PULL)
        ready.setsockopt(zmq.LINGER, 0)
        try:
            endpoint = bind_random(ready, cfg.host)
            spawn = process_context()
            for role, i in keys:
                visible = dict(enumerate(self._buffers))
                if cfg.separate_hosts:
                    visible = {i: self._buffers[i]}
                host = EngineHost(
                    i, len(self._buffers), visible, cfg.timeout_s,
                    self._group.backend if self._group else "gloo", self._event_handles,
                )  # fmt: skip
                spec = EngineSpec(
                    role, host, self._secret_path, endpoint, cfg.host, LauncherId.this_process(),
                    cfg.kernel_threads, self._group,
                )  # fmt: skip
                p = spawn.Process(
                    target=main, args=(spec,), name=f"tokenlake-{role}-{i}", daemon=True
                )
                p.start()
                self.processes[(role, i)] = Started(p)
            self._finalizer.detach()
            self._finalizer = weakref.finalize(
                self, stop_processes, list(self.processes.values()), 2.0
            )
            return self._wait_ready(ready, keys, endpoint.encode())
        finally:
            ready.close(linger=0)

    def _wait_ready(
        self, ready: zmq.Socket, keys: list[PeerKey], audience: bytes
    ) -> dict[PeerKey, str]:
        endpoints = {}
        deadline = time.monotonic() + self.config.startup_timeout_s
        while len(endpoints) < len(keys):
            for key in keys:
                started = self.processes[key]
                if not started.alive() and key not in endpoints:
                    code = started.process.exitcode
                    raise PeerFailedError(key[1], key[0], f"exited at start-up ({code})")
            if time.monotonic() > deadline:
                missing = sorted(set(keys) - set(endpoints))
                raise PeerFailedError(missing[0][1], missing[0][0], "not ready in time")
            if ready.poll(100):
                try:
                    msg = messages.decode(self._auth.open(ready.recv(), audience))
                except (AuthError, WireError):
                    continue  # not from an engine of ours
                endpoints[(msg.role, msg.instance_id)] = msg.endpoint
        return endpoints

    def is_alive(self, key: PeerKey) -> bool:
        p = self.processes.get(key)
        return p is not None and p.alive()

    def failures(self) -> list[PeerKey]:
        """The processes that died (killed, crashed), whatever their role."""
        return sorted(key for key, p in self.processes.items() if not p.alive())

    @property
    def pids(self) -> dict[PeerKey, int]:
        return {key: p.pid for key, p in self.processes.items()}

    def kill(self, keys: list[PeerKey]) -> None:
        procs = [self.processes[k] for k in keys if k in self.processes]
        for p in procs:
            p.kill()
        stop_processes(procs, 1.0)

    def stop_all(self, grace_s: float) -> None:
        """After ``Stop`` was sent: wait ``grace_s``, kill the rest, drop the finalizer."""
        stop_processes(list(self.processes.values()), grace_s)
        self._finalizer.detach()
