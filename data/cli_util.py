"""Small helpers shared by the data and bench scripts so every error is reported the same way: one line."""

import argparse
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
