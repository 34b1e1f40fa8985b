"""Small helpers shared by the data and bench scripts so every error is reported the same way: one line."""

import argparse
import contextlib
import os
import signal
import sys


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

    def stop(signum, frame):
        raise Stopped(signum)
    signums = [signum for signum in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if signum is not None]
    with train_gpt.signals_handled_by(stop, signums):
        yield


def exit_status(interruption):
    """128 + the signal's number, as a shell reports a process a signal ended (130 for Ctrl-C)."""
    return 128 + getattr(interruption, "signum", signal.SIGINT)


def leave_signals_to_the_parent():
    """Pool initializer: a worker leaves the terminal's process group, so that Ctrl-C or a signal
    to the whole group reaches only its parent, which reports it once and stops the pool in order.
    (Workers that took the signal themselves printed a traceback each on Ctrl-C, and ended by a
    SIGTERM of their own they could leave the parent's clean-up waiting for them forever.)"""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # where there are no process groups
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the pool's own, to stop it: not the parent's handler
    if hasattr(os, "setpgid"):
        os.setpgid(0, 0)
