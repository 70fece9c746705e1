"""The control server's connections: one thread, one selector, CPU budgets and deadlines.

Every connection is served by one thread (the reactor) that never blocks on a client: sockets
are non-blocking, replies wait in a per-connection buffer, and a command that may take a
while (a save, a pause with wait, a sample) runs on a worker thread of its own while the
reactor goes on serving the others. What a client may cost the run is bounded twice:

- **CPU budgets.** Each request is charged the CPU time it took to answer (at least
  REQUEST_FLOOR: waking this thread costs the training thread a GIL hand-off too, plus
  BYTE_COST a byte sent: the client's side of the machine reads them) against its
  connection's budget (CLIENT_SHARE of one core); the server's budget (SERVER_SHARE) pays
  for everything this thread does, and for what the workers do while the loop trains (a
  save or sample of a paused run takes nothing from training). A connection over its
  budget has its next request delayed, not answered early; when the server's budget is spent every
  connection waits, served in turn: a flooding client slows itself down, and all clients
  together never take more than SERVER_SHARE of a core (and of the GIL) from the run.
  Nothing is refused for going fast.
- **Slots and deadlines.** At most MAX_CLIENTS connections talk to the run; when they are
  all taken, a newcomer (the owner's client: every Unix-socket peer is the owner, every
  TCP peer past the token is) takes the slot of the one idle longest, and is refused, with
  one line, only when every connection is in the middle of a command. TCP connections that
  have not presented the token (at most MAX_PENDING, the oldest dropped first) get
  HELLO_TIMEOUT seconds to do it; a request line must be finished within LINE_TIMEOUT of
  its first byte; a connection without a request for IDLE_TIMEOUT is closed (a subscribed
  one, which the server writes to, never is); a client that leaves SEND_TIMEOUT seconds of
  replies unread is dropped. A connection closed for any of these gets one line saying why
  (``{"id": null, "ok": false, "kind": "Closed", ...}``) when it can still be written to.
"""

from __future__ import annotations

import collections
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from workbench.control.protocol import MAX_LINE, encode

__all__ = ["Reactor", "Link", "Budget", "Deferred", "Final", "MAX_CLIENTS", "MAX_PENDING", "HELLO_TIMEOUT",
           "LINE_TIMEOUT", "IDLE_TIMEOUT", "SEND_TIMEOUT", "SERVER_SHARE", "CLIENT_SHARE", "REQUEST_FLOOR", "BYTE_COST"]

log = logging.getLogger("workbench")

MAX_CLIENTS = 128  # connections that may talk to the run at once
MAX_PENDING = 32  # TCP connections that have not presented the token yet
HELLO_TIMEOUT = 5.0  # seconds a TCP connection has to present the token
LINE_TIMEOUT = 15.0  # seconds a request line may take from its first byte to its newline
IDLE_TIMEOUT = 300.0  # seconds without a request before a connection is closed (a subscribed one never is)
SEND_TIMEOUT = 10.0  # seconds a client may leave replies unread before it is dropped
OUTBUF_LIMIT = 8 << 20  # bytes queued for one client before it counts as not reading
SERVER_SHARE = 0.03  # of one core: what all clients together may cost the run's process
CLIENT_SHARE = 0.015  # of one core: what one connection may cost
BURST_S = 0.03  # CPU seconds a quiet connection (or server) may spend at once before pacing starts
REQUEST_FLOOR = 100e-6  # seconds charged for a request, at least
BYTE_COST = 1e-9  # seconds charged per byte sent, on top: the client's side of the machine reads them too
_CHECK_S = 0.25  # how often the deadlines are looked at


class Deferred:
    """A request answered on a worker thread: ``work()`` returns the reply line."""

    __slots__ = ("work",)

    def __init__(self, work: Callable[[], bytes]) -> None:
        self.work = work


class Final(bytes):
    """A reply line after which the connection is closed (a refused token, a broken line)."""


class Budget:
    """CPU seconds refilled at ``rate`` per second, holding at most ``burst`` (a token bucket
    that may be overdrawn by the request that empties it: the next one waits for that)."""

    __slots__ = ("rate", "burst", "level", "stamp")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst, self.level, self.stamp = rate, burst, burst, now

    def wait(self, now: float) -> float:
        """Seconds until a request may be answered (0: now)."""
        self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        return 0.0 if self.level > 0 else -self.level / self.rate + 1e-4

    def charge(self, cost: float) -> None:
        self.level -= cost


class Link:
    """One client connection, as the reactor keeps it (touched by the reactor's thread only)."""

    def __init__(self, sock: socket.socket, authed: bool, now: float) -> None:
        self.sock = sock
        self.authed = authed  # Unix peers are the owner; TCP ones once they presented the token
        self.client = "remote"  # who it is, as its hello said (ctl, attach): stops and console lines name it
        self.subscribed = False
        self.cursor = 0  # a subscribed connection's position in the event history
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.opened = self.active = now
        self.partial_since: float | None = None  # the unfinished line's first byte
        self.stalled_since: float | None = None  # replies queued and not taken since
        self.busy = False  # a command of this connection runs on a worker
        self.final = False  # close once the queued replies are sent
        self.closed = False
        self.queued = False  # in the reactor's ready queue
        self.not_before = 0.0  # over its budget: not served before this time
        self.ready_at = 0.0  # when its next request was ready to be answered
        self.events = 0  # the selector events registered (0: not registered)
        self.budget = Budget(CLIENT_SHARE, BURST_S, now)

    def has_line(self) -> bool:
        return self.inbuf.find(b"\n") >= 0


def closed_line(why: str, kind: str = "Closed") -> bytes:
    """The one line a connection gets when the server closes it (``Busy``: it was refused a slot)."""
    return encode({"id": None, "ok": False, "error": why, "kind": kind})


class Reactor:
    """Serve every connection of a listener from one thread (``run``) until ``closing`` is set.

    ``handle(link, line)`` answers one request line: reply bytes, a Final reply, or a
    Deferred; ``push(link)`` returns the event lines a subscribed connection has not had yet
    and whether more are waiting."""

    def __init__(self, listener: socket.socket, tcp: bool, handle: Callable[[Link, bytes], Any],
                 push: Callable[[Link], tuple[bytes, bool]], closing: threading.Event, poll_s: float,
                 training: Callable[[], bool] = lambda: True) -> None:
        self.listener = listener
        self.training = training  # whether the run's loop is training now (a held loop has nothing to lose)
        self.tcp = tcp
        self.handle = handle
        self.push = push
        self.closing = closing
        self.poll_s = poll_s
        self.poll_events = False  # no doorbell: subscribed connections are looked at every poll_s
        self.links: set[Link] = set()
        self.budget = Budget(SERVER_SHARE, BURST_S, time.monotonic())
        self.stats = {"requests": 0, "delayed": 0, "evicted": 0, "refused": 0, "timed_out": 0, "charged_s": 0.0,
                      "running": 0}  # running: commands on worker threads now
        self.thread_id: int | None = None
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._done: collections.deque[tuple[Link, bytes, float]] = collections.deque()
        self._ready: collections.deque[Link] = collections.deque()
        self._rung = False
        self._served = 0  # requests answered in this round of the loop
        self._checked = 0.0
        self._polled = 0.0
        self._accept_after = 0.0

    # -- threads that are not the reactor --------------------------------------------------------

    def wake(self) -> None:
        """Make the reactor look at its queues now (thread-safe)."""
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # already rung (the pipe is full) or closing

    def ring(self) -> None:
        """An event was emitted: push it to the subscribed connections (thread-safe)."""
        self._rung = True
        self.wake()

    def cpu_seconds(self) -> float:
        """CPU time the reactor's thread has used so far (0 before it started)."""
        if self.thread_id is None:
            return 0.0
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self.thread_id))
        except OSError:
            return 0.0

    def connections(self) -> int:
        return len(self.links)

    # -- the loop ---------------------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until ``closing`` is set, then hand subscribed clients their last events and close."""
        self.thread_id = threading.get_ident()
        self.listener.setblocking(False)
        self._sel.register(self.listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, self)
        try:
            while not self.closing.is_set():
                events = self._sel.select(self._timeout(time.monotonic()))
                started, self._served = time.thread_time(), 0
                for key, mask in events:
                    if key.data is None:
                        self._accept()
                    elif key.data is self:
                        self._drain_wake()
                    else:
                        link = key.data
                        if mask & selectors.EVENT_WRITE:
                            self._flush(link)
                        if mask & selectors.EVENT_READ and not link.closed:
                            self._read(link)
                now = time.monotonic()
                self._finish_done()
                if self._rung or (self.poll_events and now - self._polled >= self.poll_s):
                    self._rung, self._polled = False, now
                    self._push_all()
                self._serve()
                if now - self._checked >= _CHECK_S:
                    self._checked = now
                    self._expire(now)
                # The server's budget pays for all of this thread's work, its own bookkeeping included.
                self.budget.charge(max(time.thread_time() - started, self._served * REQUEST_FLOOR))
        except Exception as exc:  # noqa: BLE001 - a bug: said in one line, the run trains on
            log.warning("control endpoint stopped answering (%s: %s); the run goes on without it",
                        type(exc).__name__, exc)
            log.debug("control: the reactor failed", exc_info=True)
        finally:
            self._shutdown()

    def _timeout(self, now: float) -> float:
        waits = [_CHECK_S]
        if self._ready:
            waits.append(max(self.budget.wait(now), min(l.not_before for l in self._ready) - now, 0.0))
        if self.poll_events and any(l.subscribed for l in self.links):
            waits.append(self.poll_s)
        if self._accept_after > now:
            waits.append(self._accept_after - now)
        return max(min(waits), 0.0)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _interest(self, link: Link) -> None:
        """Register what the reactor waits for on ``link``: readable unless its buffer is full
        of requests not served yet (the client's sends then block: backpressure), writable
        while replies wait."""
        wanted = 0
        if not link.closed and len(link.inbuf) <= MAX_LINE:
            wanted |= selectors.EVENT_READ
        if link.outbuf and not link.closed:
            wanted |= selectors.EVENT_WRITE
        if wanted == link.events:
            return
        if link.events == 0:
            self._sel.register(link.sock, wanted, link)
        elif wanted == 0:
            self._sel.unregister(link.sock)
        else:
            self._sel.modify(link.sock, wanted, link)
        link.events = wanted

    # -- connections -----------------------------------------------------------------------------------

    def _accept(self) -> None:
        now = time.monotonic()
        if now < self._accept_after:
            return
        for _ in range(64):
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of file descriptors, most likely: try again shortly
                self._accept_after = now + 0.1
                return
            sock.setblocking(False)
            link = Link(sock, authed=not self.tcp, now=now)
            self.links.add(link)
            self._interest(link)
            if self.tcp:
                pending = [l for l in self.links if not l.authed and l is not link]
                if len(pending) >= MAX_PENDING:
                    self._close(min(pending, key=lambda l: l.opened),
                                f"closed: {MAX_PENDING} connections were waiting to present the token; "
                                "this one waited longest")
            else:
                refusal = self.admit(link)
                if refusal is not None:
                    self._close(link, refusal, kind="Busy")

    def admit(self, link: Link) -> str | None:
        """Let an authenticated ``link`` take a slot: a free one, else the one idle longest
        (a connection waiting for its budget counts as idle: its request has not started).
        Returns why it was refused when every connection is in the middle of a command."""
        taken = [l for l in self.links if l.authed and l is not link and not l.closed]
        link.authed = True
        if len(taken) < MAX_CLIENTS:
            return None
        free = [l for l in taken if not l.busy and not l.outbuf]
        if not free:
            self.stats["refused"] += 1
            return (f"too many clients: all {MAX_CLIENTS} connections to this run are in the middle of a "
                    "command; try again shortly")
        victim = min(free, key=lambda l: (l.subscribed, l.has_line(), l.active))
        self.stats["evicted"] += 1
        self._close(victim, f"closed to make room for another client (at most {MAX_CLIENTS} connections; "
                            "this one was idle longest); reconnect to go on")
        return None

    def _close(self, link: Link, why: str | None = None, kind: str = "Closed") -> None:
        if link.closed:
            return
        if why is not None and not link.outbuf:
            try:
                link.sock.send(closed_line(why, kind))  # best effort: a client that is not reading misses it
            except OSError:
                pass
        link.closed = True
        if link.events:
            self._sel.unregister(link.sock)
            link.events = 0
        link.sock.close()
        self.links.discard(link)

    def _read(self, link: Link) -> None:
        try:
            data = link.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(link)
            return
        if not data:  # the client hung up (a partial line is dropped; a running command's reply too)
            self._close(link)
            return
        now = time.monotonic()
        had_line = link.has_line()
        link.inbuf += data
        if link.inbuf.endswith(b"\n"):
            link.partial_since = None
        elif link.partial_since is None or b"\n" in data:
            link.partial_since = now
        if len(link.inbuf) - (link.inbuf.rfind(b"\n") + 1) > MAX_LINE:
            self._send(link, Final(encode({"id": None, "ok": False, "kind": "ProtocolError",
                                           "error": f"line over the {MAX_LINE}-byte limit"})))
            link.inbuf.clear()
            return
        if not had_line and link.has_line():
            self._queue(link)
        self._interest(link)

    def _queue(self, link: Link) -> None:
        if not link.queued and not link.busy and not link.final and not link.closed:
            link.queued = True
            link.ready_at = time.monotonic()
            self._ready.append(link)

    # -- answering ---------------------------------------------------------------------------------------

    def _serve(self) -> None:
        """One request from each connection that has one, while the server's budget lasts."""
        for _ in range(len(self._ready)):
            now = time.monotonic()
            if self.budget.wait(now) > 0:
                return  # everyone waits for the server's budget (_timeout knows for how long)
            link = self._ready.popleft()
            link.queued = False
            if link.closed or link.busy or link.final or link.outbuf or not link.has_line():
                continue  # queued again when its command ends or its replies have left (_flush)
            if now < link.not_before:
                self._requeue(link)
                continue
            wait = link.budget.wait(now)
            if wait > 0:
                link.not_before = now + wait
                self._requeue(link)
                continue
            if now - link.ready_at > 0.001:  # it waited for a budget (its own or the server's)
                self.stats["delayed"] += 1
            end = link.inbuf.find(b"\n")
            line = bytes(link.inbuf[:end])
            del link.inbuf[:end + 1]
            self._interest(link)
            if line.strip():
                link.active = now
                self._answer(link, line)
            if link.has_line():
                self._queue(link)

    def _requeue(self, link: Link) -> None:
        link.queued = True
        self._ready.append(link)

    def _answer(self, link: Link, line: bytes) -> None:
        started = time.thread_time()
        self._served += 1
        try:
            reply = self.handle(link, line)
        except Exception:  # noqa: BLE001 - a bug answers one client, never ends the run or prints
            log.debug("control: a request failed", exc_info=True)
            reply = Final(closed_line("internal error answering the request"))
        if isinstance(reply, Deferred):
            link.busy = True
            self.stats["running"] += 1
            threading.Thread(target=self._work, args=(link, reply.work), name="workbench-control-command",
                             daemon=True).start()
        else:
            self._send(link, reply)
        self._charge(link, time.thread_time() - started)

    def _work(self, link: Link, work: Callable[[], bytes]) -> None:
        started, training = time.thread_time(), self._training()
        try:
            data = work()
        except BaseException:  # noqa: BLE001 - reported to the client, never to the run's stderr
            log.debug("control: a command failed", exc_info=True)
            data = closed_line("internal error answering the request")
        # A command's CPU is charged when the loop trained meanwhile: a save, a sample or an
        # inspection of a paused run takes nothing from training, and must not leave the
        # endpoint owing seconds of budget (every client would wait them out).
        cost = time.thread_time() - started if training or self._training() else 0.0
        self._done.append((link, data, cost))
        self.wake()

    def _training(self) -> bool:
        try:
            return bool(self.training())
        except Exception:  # noqa: BLE001 - a Session gone (its proxy dead) trains nothing
            return False

    def _finish_done(self) -> None:
        while self._done:
            link, data, cost = self._done.popleft()
            link.busy = False
            self.stats["running"] -= 1
            link.budget.charge(cost)  # a worker's CPU is its client's, and the server's
            self.budget.charge(cost)
            if not link.closed:
                link.active = time.monotonic()
                self._send(link, data)
                if link.has_line():
                    self._queue(link)

    def _charge(self, link: Link, cost: float) -> None:
        cost = max(cost, REQUEST_FLOOR)
        link.budget.charge(cost)
        self.stats["requests"] += 1
        self.stats["charged_s"] += cost

    def _send(self, link: Link, data: bytes) -> None:
        if link.closed:
            return
        cost = len(data) * BYTE_COST
        link.budget.charge(cost)
        self.budget.charge(cost)
        link.outbuf += data
        if isinstance(data, Final):
            link.final = True
        self._flush(link)

    def _flush(self, link: Link) -> None:
        if link.closed:
            return
        sent = 0
        if link.outbuf:
            try:
                sent = link.sock.send(link.outbuf)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._close(link)
                return
        if sent:
            del link.outbuf[:sent]
        if link.outbuf:
            if sent or link.stalled_since is None:
                link.stalled_since = time.monotonic()
        else:
            link.stalled_since = None
            if link.final:
                self._close(link)
                return
            if link.has_line():
                self._queue(link)
        self._interest(link)

    # -- events and deadlines -------------------------------------------------------------------------------

    def _push_all(self) -> None:
        more = False
        for link in list(self.links):
            if link.subscribed and not link.closed and len(link.outbuf) < OUTBUF_LIMIT // 2:
                data, rest = self.push(link)
                more = more or rest
                if data:
                    self._send(link, data)
        if more:
            self._rung = True  # the rest next round, once these are on their way

    def _expire(self, now: float) -> None:
        for link in list(self.links):
            why = None
            if not link.authed and now - link.opened > HELLO_TIMEOUT:
                why = f"no hello with the run's token within {HELLO_TIMEOUT:g} s; connection closed"
            elif link.partial_since is not None and now - link.partial_since > LINE_TIMEOUT:
                why = f"a request line left unfinished for {LINE_TIMEOUT:g} s; connection closed"
            elif link.stalled_since is not None and (now - link.stalled_since > SEND_TIMEOUT
                                                     or len(link.outbuf) > OUTBUF_LIMIT):
                why = ""  # it is not reading: nothing more can reach it
            elif (not link.subscribed and not link.busy and not link.outbuf and not link.inbuf
                  and now - link.active > IDLE_TIMEOUT):
                why = f"idle for {IDLE_TIMEOUT:g} s; connection closed (reconnect to go on)"
            if why is not None:
                self.stats["timed_out"] += 1
                self._close(link, why or None)

    def _shutdown(self) -> None:
        """The run's endpoint closes: subscribers get their last events, queued replies get a
        moment to leave, then every connection closes."""
        try:
            for _ in range(4):
                self._push_all()
                if not self._rung:
                    break
                self._rung = False
        except Exception:  # noqa: BLE001 - closing must finish
            log.debug("control: the last events could not be pushed", exc_info=True)
        deadline = time.monotonic() + 0.5
        for link in list(self.links):
            if link.outbuf and not link.closed:
                try:
                    link.sock.settimeout(max(deadline - time.monotonic(), 0.01))
                    link.sock.sendall(link.outbuf)
                except OSError:
                    pass
            link.outbuf.clear()
            self._close(link)
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()
