"""Small helpers shared by the data and bench scripts so every error is reported the same way: one line."""

import argparse
import contextlib
import errno
import itertools
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

try:
    import fcntl
except ImportError:   # Windows: no leftover clean-up
    fcntl = None


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad option is reported in one line (no usage dump), exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text):
    """argparse type: an integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_float(text):
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def fail(message, status=1):
    """Print a one-line error to stderr and exit with status."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(status)


def first_line(error):
    """'ExceptionType: first line of its message', for one-line reports of foreign exceptions."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def os_error_text(error):
    """'<file>: <what the system says>', for the one-line report of an OSError (a full disk, ...)."""
    return f"{error.filename}: {error.strerror or error}" if error.filename else str(error.strerror or error)


# An OSError with one of these is the disk's or the folder's to fix, not the network's
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}
INTERRUPTIONS = [signum for signum in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None))
                 if signum is not None]


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like Ctrl-C's KeyboardInterrupt so that clean-ups run."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def stopped_by_signals():
    """Meanwhile SIGTERM and SIGHUP (scancel, a closed terminal) raise Stopped, as Ctrl-C raises
    KeyboardInterrupt: `finally` blocks remove scratch files and main() reports it in one line,
    where the default action would end the script silently and leave them. Main thread only."""
    from shards import train_gpt  # the data tools import it anyway: its handler swap, not a second one
    from harness import launch as launcher
    owner = os.getpid()

    def stop(signum, frame):
        if os.getpid() != owner:  # a pool worker forked before its initializer ran: ends as by default
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise Stopped(signum)
    with launcher.signals_handled_by(stop, [signum for signum in INTERRUPTIONS if signum != signal.SIGINT]):
        yield


def exit_status(interruption):
    """128 + the signal's number, as a shell reports a process a signal ended (130 for Ctrl-C)."""
    return 128 + getattr(interruption, "signum", signal.SIGINT)


@contextlib.contextmanager
def interruptions_held():
    """Ctrl-C, SIGTERM and SIGHUP wait until the block is done, for a few renames that must not stop
    halfway; one that came meanwhile is raised at the end, marked came_while_held. (Handlers that
    take note, not a blocked signal mask: torch's threads would take a process's signal for it.)"""
    from shards import train_gpt  # the data tools import it anyway
    from harness import launch as launcher
    came = []
    with launcher.signals_handled_by(lambda signum, frame: came.append(signum), INTERRUPTIONS):
        yield
    if came:
        interruption = KeyboardInterrupt() if came[0] == signal.SIGINT else Stopped(came[0])
        interruption.came_while_held = True
        raise interruption


def leave_signals_to_the_parent():
    """Pool initializer: a worker ignores Ctrl-C and SIGHUP, which reach its parent too (at a terminal
    the whole process group gets them): the parent reports them once and stops the pool (the workers
    printed a traceback each, and one that died alone of a SIGHUP lost its task, leaving the build
    waiting for it forever). SIGTERM ends a worker as by default: it is how the pool stops them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class WorkerDied(RuntimeError):
    """A pool worker ended in the middle of the work (the kernel's OOM killer, a kill -9 or -TERM to
    it alone)."""


def _call_on_batch(func_and_batch):
    func, batch = func_and_batch
    return [func(item) for item in batch]


def imap_while_workers_live(pool, func, items, chunksize=1, poll_s=1.0, grace_s=10.0):
    """pool.imap(func, items, chunksize)'s results, in order, but WorkerDied where one of the pool's
    workers has ended and no result came for grace_s: the pool starts another worker, but a task
    the dead one held is lost, and imap would wait for it forever. (A worker that died idle lost
    nothing: the build goes on.) pool._pool, the pool's own list of its processes, is the one place
    a dead worker shows; the batches are made here because imap with a chunksize hides the timeout."""
    workers = list(pool._pool)
    items = iter(items)
    batches = iter(lambda: list(itertools.islice(items, chunksize)), [])
    results = pool.imap(_call_on_batch, ((func, batch) for batch in batches))
    waited = 0.0
    while True:
        try:
            batch = results.next(timeout=poll_s)
        except StopIteration:
            return
        except multiprocessing.TimeoutError:
            waited += poll_s
            dead = [worker for worker in workers if worker.exitcode is not None]
            if dead and waited >= grace_s:
                raise WorkerDied(f"a worker process (pid {dead[0].pid}) {how_it_ended(dead[0].exitcode)} during the "
                                 "build: out of memory? (the kernel's OOM killer sends SIGKILL; fewer --workers need "
                                 "less)") from None
            continue
        waited = 0.0
        yield from batch


def how_it_ended(exitcode):
    if exitcode >= 0:
        return f"exited with status {exitcode}"
    try:
        return f"was killed by {signal.Signals(-exitcode).name}"
    except ValueError:   # a real-time signal has no name
        return f"was killed by signal {-exitcode}"


def stop_pool(pool, seconds=5.0):
    """pool.terminate(), but bounded: a worker killed while it held one of the pool's locks (scancel
    and systemd signal every process, workers included) leaves terminate() waiting forever. After
    `seconds` the process's children (the pool's workers: the data tools start no others) are
    killed and terminate() is left behind in its daemon thread."""
    stopping = threading.Thread(target=pool.terminate, daemon=True)
    stopping.start()
    stopping.join(seconds)
    if stopping.is_alive():
        for child in multiprocessing.active_children():
            child.kill()


@contextlib.contextmanager
def scratch_folder(out_dir, prefix, log):
    """A new hidden folder in out_dir to build in, removed when the block ends. It holds a locked
    .lock file while it is in use; first, the folders named prefix* whose lock is free are removed
    (their build was killed outright: SIGKILL, the OOM killer; they can hold a whole set of
    shards). The kernel frees a dead process's lock, on any host and in any container; a folder
    without a .lock (not one of ours) is left alone."""
    out_dir = Path(out_dir)
    if fcntl is not None:
        for path in sorted(out_dir.glob(f"{prefix}*")):
            lock = path / ".lock"
            if path.is_symlink() or not path.is_dir() or not lock.is_file():
                continue
            try:
                with open(lock, "r+") as held:   # writable: NFS takes an exclusive lock only so
                    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)   # taken: its build is gone
            except OSError:   # held by a build still running, or not ours to open
                continue
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.lexists(path):
                log(f"{path}: removed, the scratch folder of an earlier build that was killed")
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=out_dir))
    try:
        with open(path / ".lock.new", "w") as lock:
            if fcntl is not None:   # locked before it gets the name other builds look for
                fcntl.flock(lock, fcntl.LOCK_EX)
                os.rename(path / ".lock.new", path / ".lock")
            yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
