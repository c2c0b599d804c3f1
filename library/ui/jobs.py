"""The job queue: one SQLite file (<jobs_root>/jobs.sqlite) holding each job's config, state, times,
process and output folder, so jobs survive a restart of the UI.

A job's outputs live in its own folder, <jobs_root>/job-NNNN, which the job's config names as its
output_dir: one job's files never overwrite another's, and deleting a job removes that folder only.

States: draft (created, not queued) -> queued -> running -> done | stopped (a clean stop: LoRA and
state saved) | failed; stopping while the trainer saves after a stop request; interrupted when the
UI restarted and the trainer was gone.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import time
from contextlib import closing, contextmanager
from dataclasses import dataclass, fields

from library.text_files import toml_dumps

ACTIVE = ("running", "stopping")
FINISHED = ("done", "stopped", "failed", "interrupted")


class JobError(ValueError):
    """An action that the job's state or files do not allow; the message says why, in one line."""


@dataclass
class Job:
    id: int
    name: str
    config: str  # the TOML text as queued (output_dir set to the job's folder)
    state: str
    device: str | None
    output_dir: str
    output_name: str
    max_steps: int | None
    created: float
    queued: float | None = None
    started: float | None = None
    finished: float | None = None
    pid: int | None = None
    pid_started: int | None = None  # the process's start time (clock ticks since boot): tells a reused pid
    resume: str | None = None  # the state folder the next run resumes from
    last_step: int = 0
    exit_code: int | None = None
    message: str = ""
    peak_rss: int = 0  # bytes (the trainer's VmHWM)
    peak_vram: int = 0  # bytes (nvidia-smi, sampled), 0 off CUDA
    stop_sent: float | None = None  # when Stop's SIGINT went to the trainer: never twice (a second one quits unsaved)
    stop_now: float | None = None  # when a second Stop asked to kill the trainer (it had not acted on the SIGINT)

    @property
    def config_path(self) -> str:
        return os.path.join(self.output_dir, "config.toml")

    @property
    def log_path(self) -> str:
        return os.path.join(self.output_dir, "train.log")

    @property
    def csv_path(self) -> str:
        return os.path.join(self.output_dir, f"{self.output_name}_log.csv")

    @property
    def eval_csv_path(self) -> str:
        """An LLM job's evals (library/training/llm_task.py): its val_loss, which the log CSV lacks."""
        return os.path.join(self.output_dir, f"{self.output_name}_eval.csv")

    @property
    def state_dir(self) -> str:
        return os.path.join(self.output_dir, f"{self.output_name}-state")

    @property
    def lora_path(self) -> str:
        return os.path.join(self.output_dir, f"{self.output_name}.safetensors")


COLUMNS = [f.name for f in fields(Job)]
SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL, config TEXT NOT NULL, state TEXT NOT NULL,
    device TEXT, output_dir TEXT NOT NULL, output_name TEXT NOT NULL, max_steps INTEGER, created REAL NOT NULL,
    queued REAL, started REAL, finished REAL, pid INTEGER, pid_started INTEGER, resume TEXT,
    last_step INTEGER NOT NULL DEFAULT 0, exit_code INTEGER, message TEXT NOT NULL DEFAULT '',
    peak_rss INTEGER NOT NULL DEFAULT 0, peak_vram INTEGER NOT NULL DEFAULT 0, stop_sent REAL,
    stop_now REAL
)"""
# Columns added since the first release, for a queue an older UI made.
ADDED_COLUMNS = {"stop_sent": "REAL", "stop_now": "REAL"}


class JobStore:
    """The queue. Every call opens its own connection (the UI's handlers and the runner's threads
    call in parallel); claiming the next job is one IMMEDIATE transaction, so two callers never get
    the same job."""

    def __init__(self, root: str):
        self.root = os.path.realpath(root)
        os.makedirs(self.root, exist_ok=True)
        self.path = os.path.join(self.root, "jobs.sqlite")
        with self._connect() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(SCHEMA)
            have = {row["name"] for row in db.execute("PRAGMA table_info(jobs)")}
            for column, kind in ADDED_COLUMNS.items():
                if column not in have:
                    db.execute(f"ALTER TABLE jobs ADD COLUMN {column} {kind}")

    def hold(self) -> str | None:
        """Takes the queue for this process until it exits: one UI runs a queue (two would each run a
        job per device at once). None when taken; else who holds it, in words. The lock file's
        descriptor is not inherited, so a trainer outliving its UI does not keep the queue."""
        import fcntl

        fd = os.open(os.path.join(self.root, "ui.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 20).decode(errors="replace").strip()
            os.close(fd)
            return f"another UI (pid {holder})" if holder.isdigit() else "another UI"
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.held = fd
        return None

    @contextmanager
    def _connect(self):
        with closing(sqlite3.connect(self.path, timeout=30, isolation_level=None)) as db:
            db.row_factory = sqlite3.Row
            yield db

    @contextmanager
    def _transaction(self):
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    # -- reading -----------------------------------------------------------------------------
    def get(self, job_id: int) -> Job:
        with self._connect() as db:
            row = db.execute("SELECT * FROM jobs WHERE id = ?", (int(job_id),)).fetchone()
        if row is None:
            raise JobError(f"job {job_id}: no such job")
        return Job(**dict(row))

    def list(self) -> list[Job]:
        with self._connect() as db:
            return [Job(**dict(row)) for row in db.execute("SELECT * FROM jobs ORDER BY id")]

    def with_state(self, *states: str) -> list[Job]:
        return [job for job in self.list() if job.state in states]

    # -- writing -----------------------------------------------------------------------------
    def create(self, name: str, settings: dict, max_steps: int | None, queue: bool = False,
               device: str | None = None, logging_subdir: str | None = None) -> Job:
        """A new job and its output folder. settings: the config's keys (flat, as checked); its
        output_dir is replaced by the job's folder, and with logging_subdir its logging_dir by that
        folder inside the job's."""
        output_name = settings.get("output_name") or "lora"
        now = time.time()
        with self._transaction() as db:
            job_id = self._free_id(db)
            db.execute(
                "INSERT INTO jobs (id, name, config, state, device, output_dir, output_name, max_steps, created, queued) "
                "VALUES (?, ?, ?, ?, ?, '', ?, ?, ?, ?)",
                (job_id, name, "", "queued" if queue else "draft", device, output_name, max_steps, now,
                 now if queue else None))
            folder = self.job_folder(job_id)
            if os.path.exists(folder) and not os.path.isdir(folder):  # raised here: the new row is rolled back
                raise JobError(f"job {job_id}: its output folder {folder!r} is not a folder; remove what is there")
            moved = {"logging_dir": os.path.join(folder, logging_subdir)} if logging_subdir is not None else {}
            config = toml_dumps({**settings, "output_dir": folder, **moved})
            db.execute("UPDATE jobs SET output_dir = ?, config = ? WHERE id = ?", (folder, config, job_id))
        os.makedirs(folder, exist_ok=True)
        return self.get(job_id)

    def _free_id(self, db) -> int:
        """The next id whose job-NNNN folder holds nothing (or is not there): ids restart at 1 with a new jobs.sqlite beside the
        old folders, and a job given one of those showed the other run's curve, step and samples, and resumed
        from its state."""
        row = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'jobs'").fetchone()
        job_id = (row[0] if row else 0) + 1
        while os.path.exists(folder := self.job_folder(job_id)) and (not os.path.isdir(folder) or os.listdir(folder)):
            job_id += 1
        return job_id

    def job_folder(self, job_id: int) -> str:
        return os.path.join(self.root, f"job-{int(job_id):04d}")

    def update(self, job_id: int, **values) -> None:
        unknown = set(values) - set(COLUMNS)
        if unknown:
            raise KeyError(f"unknown job columns {sorted(unknown)}")
        if values:
            sets = ", ".join(f"{k} = ?" for k in values)
            with self._connect() as db:
                db.execute(f"UPDATE jobs SET {sets} WHERE id = ?", (*values.values(), int(job_id)))

    def transition(self, job_id: int, allowed: tuple[str, ...], action: str, first=None, **values) -> Job:
        """Set `values` if the job is in one of `allowed` states, atomically; else JobError. first(job):
        done before, in the same transaction (no other state change meanwhile); its error changes nothing."""
        with self._transaction() as db:
            row = db.execute("SELECT * FROM jobs WHERE id = ?", (int(job_id),)).fetchone()
            if row is None:
                raise JobError(f"job {job_id}: no such job")
            if row["state"] not in allowed:
                raise JobError(f"job {job_id} is {row['state']}: cannot {action} (only a job that is "
                               f"{' or '.join(allowed)})")
            if first is not None:
                first(Job(**dict(row)))
            sets = ", ".join(f"{k} = ?" for k in values)
            db.execute(f"UPDATE jobs SET {sets} WHERE id = ?", (*values.values(), int(job_id)))
        return self.get(job_id)

    def claim_next(self, device: str, served: tuple[str, ...] = ()) -> Job | None:
        """The oldest queued job for this device, for any, or for a device no longer `served` (a UI
        restarted with another --device list), now running on `device`; None if none."""
        others = ", ".join("?" * len(served))
        gone = f" OR device NOT IN ({others})" if served else ""
        with self._transaction() as db:
            row = db.execute(f"SELECT id FROM jobs WHERE state = 'queued' AND (device IS NULL OR device = ?{gone}) "
                             "ORDER BY queued, id LIMIT 1", (device, *served)).fetchone()
            if row is None:
                return None
            db.execute("UPDATE jobs SET state = 'running', device = ?, started = ?, finished = NULL, pid = NULL, "
                       "exit_code = NULL, message = '', stop_sent = NULL, stop_now = NULL "
                       "WHERE id = ?",
                       (device, time.time(), row["id"]))
        return self.get(row["id"])

    def delete(self, job_id: int) -> None:
        """The job's row and its output folder; refused while it runs. Only a folder that is the
        job's own (job-NNNN directly under the jobs root, not a link) is removed. The state is read
        in the deleting transaction: a queued job a runner claims meanwhile is not deleted under it."""
        job = self.get(job_id)
        folder = self.job_folder(job.id)
        if os.path.realpath(job.output_dir) != folder or os.path.islink(job.output_dir):
            raise JobError(f"job {job_id}: its output folder {job.output_dir!r} is not {folder!r}; not deleting it")
        with self._transaction() as db:
            row = db.execute("SELECT state FROM jobs WHERE id = ?", (job.id,)).fetchone()
            if row is None:
                raise JobError(f"job {job_id}: no such job")
            if row["state"] in ACTIVE:
                raise JobError(f"job {job_id} is {row['state']}: stop it before deleting it")
            db.execute("DELETE FROM jobs WHERE id = ?", (job.id,))
        if os.path.isdir(folder):
            shutil.rmtree(folder)

    def clear_outputs(self, job: Job) -> None:
        """Everything in the job's folder but its config (a retry starts from nothing); a removed
        folder is made again (the config is written into it at launch)."""
        folder = self.job_folder(job.id)
        if os.path.realpath(job.output_dir) != folder:
            raise JobError(f"job {job.id}: its output folder {job.output_dir!r} is not {folder!r}; not clearing it")
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise JobError(f"job {job.id}: its output folder {folder!r} is not a folder; remove what is there")
        os.makedirs(folder, exist_ok=True)
        for entry in os.listdir(folder):
            path = os.path.join(folder, entry)
            if entry == "config.toml":
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
