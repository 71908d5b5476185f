"""What a run shows while it trains: a one-line progress bar, redrawn in place."""

import sys
import time


class Progress:
    """A one-line progress bar on stderr, redrawn with \\r (or a plain line now and then off a TTY)."""

    def __init__(self, enabled: bool = True, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty()
        self.shown = False
        self.last_plain = 0.0

    def update(self, text: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + text.ljust(100)[:160])
            self.shown = True
        elif time.monotonic() - self.last_plain > 10:
            self.stream.write(text + "\n")
            self.last_plain = time.monotonic()
        self.stream.flush()

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()
            self.shown = False


def clock(seconds: float) -> str:
    """`m:ss` of a duration in seconds."""
    seconds = int(max(0, seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"
