"""The video job table of ``/v1/videos``: bounded, with expiry, owning the MP4 files it wrote.

A job is ``queued`` until its first denoising step, then ``in_progress`` (``progress`` in percent), and
ends ``completed`` (the MP4 is on disk until the job expires or is deleted), ``failed`` (``error`` says
why) or ``cancelled`` (its engine request was aborted). Finished jobs expire ``ttl_s`` after they end;
when the table is full the oldest finished job is evicted, and if every job is still running a new one
is refused (429).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
import threading
import time
from typing import Any

import attrs

from omni_core.serve.errors import APIError

QUEUED, IN_PROGRESS, COMPLETED, FAILED, CANCELLED = "queued", "in_progress", "completed", "failed", "cancelled"
STATUSES = (QUEUED, IN_PROGRESS, COMPLETED, FAILED, CANCELLED)
FINISHED = (COMPLETED, FAILED, CANCELLED)


@attrs.define(eq=False)
class VideoJob:
    id: str
    model: str
    prompt: str
    size: str
    seconds: str
    num_frames: int
    fps: int
    request_id: str
    status: str = QUEUED
    progress: int = 0
    created_at: int = attrs.field(factory=lambda: int(time.time()))
    completed_at: int | None = None
    expires_at: int | None = None
    error: dict | None = None
    seed: int | None = None
    #: the worker's peak memory when the job's request finished (vLLM-Omni's clients read it from the job)
    peak_memory_mb: float | None = None
    path: str | None = None
    task: Any = None
    #: what the model changed in the request as sent (a rounded ``num_frames``): omni's field, shown when set
    warnings: list = attrs.field(factory=list)

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    def finish(self, status: str, ttl_s: float, error: dict | None = None) -> None:
        now = time.time()
        self.status, self.error = status, error
        self.completed_at = int(now)
        self.expires_at = int(now + ttl_s)
        if status == COMPLETED:
            self.progress = 100

    def on_step(self, step: int, total: int) -> None:
        """The engine reported a denoising step (engine thread): the job is running, ``progress`` in percent."""
        if not self.finished:
            self.status = IN_PROGRESS
            self.progress = min(99, int(100 * step / max(total, 1)))

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's video object, plus omni's ``num_frames``, ``fps``, ``seed`` and ``peak_memory_mb``.

        OpenAI's statuses are queued, in_progress, completed and failed, and clients poll until completed or
        failed; so a cancelled job (its request aborted, e.g. at shutdown) reads ``failed`` with error code
        ``cancelled``, which ends every such client's polling."""
        status, error = self.status, self.error
        if status == CANCELLED:
            status, error = FAILED, error or {"code": "cancelled", "message": "the video job was cancelled"}
        job = {"id": self.id, "object": "video", "model": self.model, "status": status,
                "progress": self.progress, "created_at": self.created_at, "completed_at": self.completed_at,
                "expires_at": self.expires_at, "prompt": self.prompt, "size": self.size, "seconds": self.seconds,
                "quality": "standard", "error": error, "remixed_from_video_id": None,
                "num_frames": self.num_frames, "fps": self.fps, "seed": self.seed, "peak_memory_mb": self.peak_memory_mb}
        if self.warnings:
            job["warnings"] = list(self.warnings)
        return job


class VideoJobs:
    """Jobs by id. Files live in ``directory`` (a fresh temp dir, removed on close, when not given)."""

    def __init__(self, directory: str | None = None, *, max_jobs: int = 100, ttl_s: float = 3600.0) -> None:
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1, got {max_jobs}")
        self._own_dir = directory is None
        self.directory = directory or tempfile.mkdtemp(prefix="omni-videos-")
        os.makedirs(self.directory, exist_ok=True)
        self.max_jobs = max_jobs
        self.ttl_s = ttl_s
        self._jobs: dict[str, VideoJob] = {}
        self._lock = threading.Lock()

    @staticmethod
    def new_id() -> str:
        return f"video_{secrets.token_hex(12)}"

    def path_for(self, job_id: str) -> str:
        return os.path.join(self.directory, f"{job_id}.mp4")

    def add(self, job: VideoJob) -> None:
        """Insert ``job``; evicts the oldest finished job when full, refuses (429) if none is finished."""
        self.sweep()
        with self._lock:
            if len(self._jobs) >= self.max_jobs:
                done = [j for j in self._jobs.values() if j.finished]
                if not done:
                    raise APIError(429, f"the server holds {len(self._jobs)} unfinished video jobs (the maximum); "
                                        f"retry later", code="too_many_video_jobs", type="rate_limit_error",
                                   headers={"Retry-After": "5"})
                oldest = min(done, key=lambda j: (j.completed_at or 0, j.created_at))
                self._drop(oldest)
            self._jobs[job.id] = job

    def get(self, job_id: str) -> VideoJob:
        self.sweep()
        job = self._jobs.get(job_id)
        if job is None:
            raise APIError(404, f"no video job with id {job_id!r} (it may have expired or been deleted)",
                           param="video_id", code="video_not_found")
        return job

    def remove(self, job_id: str) -> VideoJob:
        """Forget the job and delete its file; a job still running is cancelled (its request aborted)."""
        job = self.get(job_id)
        with self._lock:
            self._drop(job)
        return job

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._jobs

    def list(self) -> list[VideoJob]:
        self.sweep()
        return sorted(self._jobs.values(), key=lambda j: j.created_at, reverse=True)

    def counts(self) -> dict[str, int]:
        with self._lock:
            counts = dict.fromkeys(STATUSES, 0)
            for job in self._jobs.values():
                counts[job.status] += 1
            return counts

    def sweep(self, now: float | None = None) -> int:
        """Drop finished jobs past ``expires_at``; returns how many."""
        now = time.time() if now is None else now
        with self._lock:
            expired = [j for j in self._jobs.values() if j.finished and j.expires_at is not None
                       and j.expires_at <= now]
            for job in expired:
                self._drop(job)
        return len(expired)

    def _drop(self, job: VideoJob) -> None:
        self._jobs.pop(job.id, None)
        if job.task is not None and not job.task.done():
            job.task.cancel()
        if job.path is not None:
            try:
                os.remove(job.path)
            except FileNotFoundError:
                pass

    async def close(self) -> None:
        """Cancel running jobs and delete every file (and the directory if it was made here)."""
        with self._lock:
            jobs = list(self._jobs.values())
            for job in jobs:
                self._drop(job)
        tasks = [j.task for j in jobs if j.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for job in jobs:  # a job that was writing its file when cancelled
            if os.path.exists(self.path_for(job.id)):
                os.remove(self.path_for(job.id))
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)
