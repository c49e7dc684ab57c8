"""What the console answers, as dataclasses parsed strictly from the contract's JSON.

Strictly: every field the contract names must be there with its type, or `UnexpectedResponse` is raised before
the client acts on the answer (a client that guessed a missing status could run an action nobody approved).
Fields the contract does not name are ignored, so a newer server that adds some does not break older clients.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import Any, TypeVar, cast

from hitl_client.errors import UnexpectedResponse

_E = TypeVar("_E", bound=Enum)


class RequestStatus(str, Enum):
    PENDING = "pending"
    APPROVED = "approved"
    REJECTED = "rejected"
    EXPIRED = "expired"
    CANCELLED = "cancelled"


class ExecutionStatus(str, Enum):
    NOT_STARTED = "not_started"
    # Consumed ("go" was given) and no result reported: the action may or may not have happened.
    PENDING = "pending"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass(frozen=True)
class Execution:
    """The receipt of the approved action: whether "go" was given and what the agent reported."""

    status: ExecutionStatus
    consumed_at: datetime | None
    completed_at: datetime | None
    result: Any
    error: str

    @classmethod
    def from_json(cls, data: object) -> Execution:
        fields = _Fields(data, "execution")
        return cls(
            status=fields.enum("status", ExecutionStatus),
            consumed_at=fields.time_or_none("consumed_at"),
            completed_at=fields.time_or_none("completed_at"),
            result=fields.any("result"),
            error=fields.string("error"),
        )


@dataclass(frozen=True)
class ApprovalRequest:
    """A request for sign-off and its decision (`GET /api/approval-requests/{id}`)."""

    id: str
    run_id: str | None
    card_id: str | None
    channel: str
    action: str
    status: RequestStatus
    # What to execute once approved: the reviewer's edit if there was one, else the arguments as asked.
    arguments: dict[str, Any] | None
    arguments_digest: str | None
    edited: bool
    decided_by: str | None
    decided_at: datetime | None
    comment: str
    reason: str
    expires_at: datetime | None
    execution: Execution
    # The request's address in the console's API, as the console gives it.
    url: str | None = None
    # A shadow card: the reviewer does the action by hand, and consume answers no go (the agent never runs it).
    shadow: bool = False
    # A compensation (its run is being undone): the request whose execution it undoes, and its place in the undo
    # (0 runs first). None on any other request.
    compensates: str | None = None
    undo_order: int | None = None

    @property
    def decided(self) -> bool:
        return self.status is not RequestStatus.PENDING

    @classmethod
    def from_json(cls, data: object) -> ApprovalRequest:
        fields = _Fields(data, "approval request")
        return cls(
            id=fields.ident("id"),
            run_id=fields.ident_or_none("run_id"),
            card_id=fields.ident_or_none("card_id"),
            channel=fields.string("channel"),
            action=fields.string("action"),
            status=fields.enum("status", RequestStatus),
            arguments=fields.object_or_none("arguments"),
            arguments_digest=fields.string_or_none("arguments_digest"),
            edited=fields.boolean("edited"),
            decided_by=fields.string_or_none("decided_by"),
            decided_at=fields.time_or_none("decided_at"),
            comment=fields.string("comment"),
            reason=fields.string("reason"),
            expires_at=fields.time_or_none("expires_at"),
            execution=Execution.from_json(fields.any("execution")),
            url=fields.optional_string("url"),
            shadow=fields.optional_boolean("shadow"),
            compensates=fields.ident_or_none("compensates") if "compensates" in fields.data else None,
            undo_order=fields.optional_int("undo_order"),
        )


@dataclass(frozen=True)
class Go:
    """A consume's answer. `go`: run exactly these arguments, once. On a shadow card the answer is no go
    (`go` False, `shadow` True): the console recorded the effect as shadow, a person does the action by hand, and
    the agent must not run it (`arguments` and `execution` are then what the console said, if it said)."""

    go: bool
    shadow: bool
    arguments: dict[str, Any] | None
    arguments_digest: str | None
    execution: Execution | None

    @classmethod
    def from_json(cls, data: object) -> Go:
        fields = _Fields(data, "go")
        go, shadow = fields.boolean("go"), fields.boolean("shadow")
        if go == shadow:
            # Either a go for a real action or a shadow's no-go: anything else is not an answer to act on.
            raise UnexpectedResponse(f"The consume answered 200 with go: {go} and shadow: {shadow}.", data)
        if not go:
            execution = fields.data.get("execution")
            return cls(
                go=False,
                shadow=True,
                arguments=fields.object_or_none("arguments") if "arguments" in fields.data else None,
                arguments_digest=fields.optional_string("arguments_digest"),
                execution=None if execution is None else Execution.from_json(execution),
            )
        arguments = fields.object_or_none("arguments")
        if arguments is None:
            raise UnexpectedResponse("The go has no arguments.", data)
        return cls(
            go=True,
            shadow=False,
            arguments=arguments,
            arguments_digest=fields.string("arguments_digest"),
            execution=Execution.from_json(fields.any("execution")),
        )


class _Fields:
    """Typed reads of one JSON object's fields, each raising UnexpectedResponse naming the field."""

    def __init__(self, data: object, what: str) -> None:
        if not isinstance(data, Mapping):
            raise UnexpectedResponse(f"The {what} is not a JSON object.", data)
        self.data, self.what = data, what

    def any(self, name: str) -> Any:
        if name not in self.data:
            raise UnexpectedResponse(f"The {self.what} has no {name!r}.", self.data)
        return self.data[name]

    def _typed(self, name: str, types: type | tuple[type, ...], expected: str, *, null: bool = False) -> Any:
        value = self.any(name)
        if value is None and null:
            return None
        # bool is an int in Python, never in JSON.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
            raise UnexpectedResponse(f"The {self.what}'s {name!r} is not {expected}: {value!r}.", self.data)
        return value

    def string(self, name: str) -> str:
        return cast(str, self._typed(name, str, "a string"))

    def string_or_none(self, name: str) -> str | None:
        return cast("str | None", self._typed(name, str, "a string or null", null=True))

    def optional_string(self, name: str) -> str | None:
        return self.string_or_none(name) if name in self.data else None

    def boolean(self, name: str) -> bool:
        return cast(bool, self._typed(name, bool, "true or false"))

    def optional_boolean(self, name: str) -> bool:
        return self.boolean(name) if name in self.data else False

    def optional_int(self, name: str) -> int | None:
        if name not in self.data:
            return None
        return cast("int | None", self._typed(name, int, "an integer or null", null=True))

    def object_or_none(self, name: str) -> dict[str, Any] | None:
        value = self._typed(name, Mapping, "an object or null", null=True)
        return None if value is None else dict(value)

    def ident(self, name: str) -> str:
        # The contract does not fix whether ids are numbers or strings (UUIDs): either, kept as text.
        value = self._typed(name, (str, int), "an id")
        if value == "":
            raise UnexpectedResponse(f"The {self.what}'s {name!r} is empty.", self.data)
        return str(value)

    def ident_or_none(self, name: str) -> str | None:
        return None if self.any(name) is None else self.ident(name)

    def enum(self, name: str, kind: type[_E]) -> _E:
        value = self.string(name)
        try:
            return kind(value)
        except ValueError:
            raise UnexpectedResponse(
                f"The {self.what}'s {name!r} is not one of the contract's: {value!r}.", self.data
            ) from None

    def time_or_none(self, name: str) -> datetime | None:
        value = self.string_or_none(name)
        if value is None:
            return None
        # Python 3.10's fromisoformat does not read the "Z" that Django and pydantic write for UTC.
        text = value[:-1] + "+00:00" if value.endswith(("Z", "z")) else value
        try:
            return datetime.fromisoformat(text)
        except ValueError:
            raise UnexpectedResponse(
                f"The {self.what}'s {name!r} is not an ISO 8601 time: {value!r}.", self.data
            ) from None


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)
