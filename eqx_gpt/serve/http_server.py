"""Running the app with uvicorn so that it can be left running: `serve`.

uvicorn's own settings bound a header's size (`h11_max_incomplete_event_size`), idle keep-alive
connections (`timeout_keep_alive`), the connections open at once (`limit_concurrency`: beyond,
503) and how long responses may run after SIGTERM (`timeout_graceful_shutdown`). Two things it
lacks are added here:

- **A request deadline.** uvicorn holds a connection that sends half a request for ever (its
  keep-alive timer is reset by every byte, and no timer runs before the first response; see
  uvicorn#157). `DeadlineH11Protocol` closes a connection whose request (headers and body) has not
  all arrived `request_timeout_s` after the connection opened or its previous response ended.
- **A drain on SIGTERM.** The first SIGTERM or Ctrl-C stops admitting (uvicorn closes the
  listening socket; a request on an open connection gets a 503) and gives completions in flight
  `shutdown_timeout_s` to finish; then each still running ends with a final event (an error event
  and `[DONE]`, or a 503) and the process exits. A second signal ends them at once, with the same
  final events; a third exits without waiting. uvicorn's graceful timeout is set a little past the
  drain, so a client that reads nothing cannot hold the exit either.
"""

import asyncio
from dataclasses import dataclass
from types import FrameType

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_BYTES = 16 * 1024  # h11's default, set explicitly: headers still unended past this are refused
FINAL_EVENTS_S = 2.0  # past the drain, for the final events to be written


@dataclass(frozen=True)
class Limits:
    """How long a connection and a shutdown may take, in seconds."""

    request_timeout_s: float = 10.0  # to send a whole request (headers and body)
    keep_alive_s: float = 5.0  # an idle connection between requests
    shutdown_timeout_s: float = 5.0  # completions in flight may run after SIGTERM
    max_connections: int = 512  # open at once; beyond, uvicorn answers 503


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on receiving each request; `request_timeout_s` is set
    on the subclass that `deadline_protocol` makes."""

    request_timeout_s: float = Limits.request_timeout_s
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # the next request on this connection has its own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.request_timeout_s, self._expire)

    def _expire(self) -> None:
        # IDLE: the headers are incomplete (or nothing came); SEND_BODY: the body is.
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self.transport.close()  # a handler waiting for the body sees the client leave


def deadline_protocol(request_timeout_s: float) -> type[DeadlineH11Protocol]:
    """`DeadlineH11Protocol` with the deadline `request_timeout_s` seconds."""
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,), {"request_timeout_s": request_timeout_s})


class DrainingServer(uvicorn.Server):
    """uvicorn's server, calling `drain(grace_s)` on each SIGTERM or SIGINT before its own shutdown."""

    def __init__(self, config: uvicorn.Config, drain, shutdown_timeout_s: float):
        super().__init__(config)
        self.drain, self.shutdown_timeout_s, self.signals = drain, shutdown_timeout_s, 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.signals += 1
        self.drain(self.shutdown_timeout_s if self.signals == 1 else 0.0)
        if self.signals == 1:
            super().handle_exit(sig, frame)
        elif self.signals >= 3:
            self.force_exit = True


def uvicorn_config(app, *, host: str, port: int, limits: Limits) -> uvicorn.Config:
    """uvicorn's settings for `app` under `limits`."""
    return uvicorn.Config(
        app, host=host, port=port, log_level="warning", lifespan="on",
        http=deadline_protocol(limits.request_timeout_s),  # type: ignore[arg-type]
        h11_max_incomplete_event_size=HEADER_BYTES, limit_concurrency=limits.max_connections,
        timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
        timeout_graceful_shutdown=limits.shutdown_timeout_s + FINAL_EVENTS_S,  # type: ignore[arg-type]
    )  # fmt: skip


def serve(app, *, host: str, port: int, limits: Limits = Limits()) -> None:
    """Serve `app` (from `eqx_gpt.serve.create_app`) until SIGTERM or Ctrl-C, then drain and return."""
    server = DrainingServer(uvicorn_config(app, host=host, port=port, limits=limits),
                            app.state.server.drain, limits.shutdown_timeout_s)  # fmt: skip
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises the Ctrl-C it held back once it has shut down
        pass
