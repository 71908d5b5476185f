"""Asking a run to stop: Ctrl-C, SIGTERM or a callback's `StopTraining` set one flag, which the loop
reads between calls of steps and evaluations read between their calls. A stopped run saves its
`latest` checkpoint and resumes as if it never stopped."""

import signal
import threading


class StopFlag:
    """Set by SIGINT/SIGTERM (while the run holds the main thread's handlers) or by `request()`, so
    the loop stops between steps; a second Ctrl-C aborts at once."""

    def __init__(self):
        self.set = False
        self.previous = {}

    def request(self) -> None:
        """Stop the run at the loop's next check (a callback's `StopTraining`)."""
        self.set = True

    def __call__(self) -> bool:
        """Whether the run was asked to stop."""
        return self.set

    def __enter__(self) -> "StopFlag":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.set and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.set = True

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
