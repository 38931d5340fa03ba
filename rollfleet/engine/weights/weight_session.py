"""Weight-update sessions (`/begin_weight_update`, `/end_weight_update`, SGLang >= 0.5.21) and the
one question they answer: may the engine serve the weights it holds?

Ordering, enforced here and by the engine thread (which runs begin, every update and end in the
order they were queued, each update only once the running batch has ended):
  1. begin opens a session. Calls inside it apply as outside (each all or none across ranks);
     the session records which checkpoint tensors arrived, and a `weight_version` given inside
     is held, not applied.
  2. From the first call that applied, generation is held: requests wait, no batch runs on a
     half-synced model.
  3. end commits when every tensor of the model arrived in the session and no call of it was
     refused: the held version becomes the label and generation resumes. With partial updates
     allowed (`--rollfleet-partial-weight-updates`, SGLang's own behaviour) a session that sent
     some tensors commits too: the others keep their values, and the answer says how many came.
  4. Otherwise end answers 400. If any call of the session applied, the weights are *mixed*:
     every unfinished request ends, new ones are refused (503), the old version label stays,
     until a later complete session commits or a disk load replaces the whole model (or the
     weights are released, which makes them "not loaded" instead). If none applied, the engine
     serves its old weights as before.
Outside a session, updates apply and set their version per call, as SGLang before 0.5.21 did.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from rollfleet.engine.runtime.scheduler import Scheduler

SELECTORS = ("all", "target", "draft")
SYNC_IN_PROGRESS = "a weight-update session is in progress: requests wait for end_weight_update"


class SessionError(ValueError):
    """A session route refused (HTTP 400)."""


@dataclass
class Session:
    number: int
    selector: str
    arrived: set[str] = field(default_factory=set)
    calls: int = 0
    applied: bool = False
    failure: str | None = None  # the first refused call
    version: str | None = None  # applied at a successful end


class WeightSessions:
    def __init__(self, scheduler: Scheduler, required_names: frozenset[str], *, allow_partial: bool = False):
        self._scheduler, self._required = scheduler, required_names
        self.allow_partial = allow_partial
        self.open: Session | None = None
        self.mixed: str | None = None  # why the weights may not be served
        self._count = 0
        self._lock = threading.Lock()

    def begin(self, selector: str, weights_released: bool) -> str:
        with self._lock:
            if self.open is not None:
                raise SessionError("a weight-update session is already open; call end_weight_update() first")
            if selector == "draft":
                raise SessionError("selector='draft': the embedded engine has no draft model; use 'all' or 'target'")
            if weights_released:
                raise SessionError(
                    "weights are released: call /resume_memory_occupation with tags ['weights'] "
                    "before begin_weight_update"
                )
            self._count += 1
            self.open = Session(self._count, selector)
            return f"weight-update session {self._count} opened (selector={selector!r})"

    def after_update(self, names: list[str], weight_version: str | None) -> None:
        """An update applied `names` (engine thread). A full model load outside a session ends mixed weights."""
        with self._lock:
            session = self.open
            if session is None:
                if weight_version is not None:
                    self._scheduler.weight_version = weight_version
                if self.mixed is not None and self._required <= set(names):
                    self._serve_again()
                return
            session.calls += 1
            session.arrived.update(names)
            if weight_version is not None:
                session.version = weight_version
            if not session.applied:
                session.applied = True
                self._scheduler.hold(SYNC_IN_PROGRESS)

    def after_refusal(self, route: str, message: str) -> None:
        """A weight-update call was refused (any thread); inside a session, the session fails."""
        with self._lock:
            session = self.open
            if session is None:
                return
            session.calls += 1
            if session.failure is None:
                session.failure = f"call {session.calls} of the session ({route}) was refused: {message}"

    def set_version(self, version: str) -> bool:
        """`/update_weight_version` (engine thread): applied now (True) or held for the end (False)."""
        with self._lock:
            if self.open is not None:
                self.open.version = version
                return False
            self._scheduler.weight_version = version
            return True

    def end(self) -> str:
        """Commit the open session, or refuse naming why (engine thread)."""
        with self._lock:
            session, self.open = self.open, None
            if session is None:
                raise SessionError("no weight-update session is open; call begin_weight_update() first")
            missing = sorted(self._required - session.arrived)
            problems = [session.failure] if session.failure else []
            partial = f" (partial: {len(self._required) - len(missing)} of {len(self._required)} tensors)"
            partial = partial if missing and self.allow_partial else ""
            if missing and not self.allow_partial:
                shown = ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else "")
                total = len(self._required)
                problems.append(f"{len(missing)} of the model's {total} tensors did not arrive in the session: {shown}")
            version = self._scheduler.weight_version
            if not problems:
                if session.version is not None:
                    self._scheduler.weight_version = version = session.version
                self._serve_again()
                return f"weight-update session {session.number} committed: weight_version {version!r}{partial}"
            self._scheduler.hold(None)
            why = "; ".join(problems)
            if not session.applied:
                still = f"; they are still mixed from before: {self.mixed}" if self.mixed else ""
                raise SessionError(
                    f"end_weight_update refused: {why}; no call of the session applied, so the weights "
                    f"are unchanged (weight_version {version!r}){still}"
                )
            self.mixed = (
                f"the engine's weights are mixed: weight-update session {session.number} ended incomplete "
                f"({why}); it keeps weight_version {version!r} but serves nothing until a complete sync "
                "commits: push every tensor in a new session (begin_weight_update ... end_weight_update) "
                "or load the full model with /update_weights_from_disk"
            )
            self._scheduler.refuse(self.mixed)
            raise SessionError(f"end_weight_update refused: {self.mixed}")

    def refuse_serving(self, reason: str) -> None:
        """Serve nothing (unfinished requests end) until a full load or a complete session: the
        weights may be part old, part new (an R-Fork receive that failed part-way)."""
        with self._lock:
            self.mixed = reason
            self._scheduler.refuse(reason)

    def check_release(self, tags: list[str]) -> None:
        if "weights" in tags and self.open is not None:
            raise SessionError(
                f"weight-update session {self.open.number} is open: releasing the weights would drop what "
                "it pushed; call end_weight_update first"
            )

    def after_release(self, tags: list[str]) -> None:
        """Released weights are not loaded (a stronger state than mixed, with its own fix)."""
        with self._lock:
            if "weights" in tags and self.mixed is not None:
                self._serve_again()

    def _serve_again(self) -> None:
        self.mixed = None
        self._scheduler.refuse(None)
        self._scheduler.hold(None)
