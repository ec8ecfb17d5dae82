"""A rank's request that the Job fail at once: what it found no restart can cure (checkpoints that cannot
match the model, a fresh start refused while checkpoints exist).

A rank cannot say so by its exit code: ft_launcher restarts the worker group whatever a rank exits with
(in-job, up to fault_tolerance.max_restarts cycles without progress, then NO_PROGRESS), and the in-process
Wrapper retries an exception. So the rank writes a request into the run directory, which every node's
pod shares (FSx), and every pod's PID 1 (training.pod.launch) watches it: it stops its launcher and
exits CONFIG_ERROR, on which the Job's podFailurePolicy fails the Job, naming the cause as the container's
termination message. A request is written whole or not at all (files.replace_file).

Requests that were there when a pod (or the local controller) started are an earlier Job's, whose cause
has been dealt with since: only new ones count (`FailureRequests`).
"""
from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from training.contract.files import replace_file

REQUESTS_DIR = "job_failure"


@dataclass(frozen=True)
class FailureRequest:
    source: str  # who asked, e.g. rank3
    cause: str  # what the rank found, and what to do about it


class JobMustFail(BaseException):
    """Raised by the rank that wrote a request: a BaseException, so that the in-process Wrapper (which
    restarts on Exception) lets it through and the rank exits CONFIG_ERROR."""


def requests_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / REQUESTS_DIR


def request_job_failure(run_dir: str | os.PathLike, source: str, cause: str) -> JobMustFail:
    """Write the request; returns the exception for the caller to raise."""
    directory = requests_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    record = {"source": source, "cause": cause}
    replace_file(directory / f"{source}-{uuid.uuid4().hex[:12]}.json", json.dumps(record).encode())
    return JobMustFail(cause)


class FailureRequests:
    """The requests written since this object was made: `new()` returns the first one it has not returned
    yet (None: none). One directory listing per call."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.directory = requests_dir(run_dir)
        self._seen = self._names()

    def new(self) -> FailureRequest | None:
        """Raises OSError when the directory or a request in it cannot be read now (FSx, while its client is
        evicted); such a request is read again by the next call, and is not lost."""
        unreadable: OSError | None = None
        for name in sorted(self._names() - self._seen):
            try:
                text = (self.directory / name).read_text()
            except FileNotFoundError:  # gone since the listing: not a request this module wrote
                text = ""
            except OSError as err:
                unreadable = unreadable or err
                continue
            self._seen.add(name)
            try:
                record = json.loads(text)
                return FailureRequest(str(record["source"]), str(record["cause"]))
            except (ValueError, KeyError, TypeError):  # not a request this module wrote: skipped
                continue
        if unreadable is not None:
            raise unreadable
        return None

    def _names(self) -> set[str]:
        try:
            return {name for name in os.listdir(self.directory) if name.endswith(".json")}
        except FileNotFoundError:
            return set()
