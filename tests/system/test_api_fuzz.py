"""Bad input: schemathesis generates requests for every operation of the live server's `/api/openapi.json`, valid
ones and invalid ones, and sends them with valid API tokens to the production web server.

The promise under test (DESIGN, HTTP surface): errors are JSON `{error, detail}` with the right status, never a
500 for bad input, every answer is one the OpenAPI document declares, and the document promises no more than the
server takes. Each response goes through every check schemathesis has (`--checks all`): among them no 5xx
(`not_a_server_error`), a status the operation declares (`status_code_conformance`), a declared content type
(`content_type_conformance`) and headers (`response_headers_conformance`), a body that matches the declared
schema (`response_schema_conformance`), invalid input refused (`negative_data_rejection`), valid input accepted
(`positive_data_acceptance`: a 4xx other than 401/403/404/409/429 for a request the schema allows means the
document promised what the server refuses), and a request that succeeded refused without its token or with a
wrong one (`ignored_auth`). The others (`missing_required_header`, `unsupported_method`,
`allow_header_conformance`, `use_after_free`, `ensure_resource_availability`, `object_level_authorization`) judge
requests of schemathesis' coverage and stateful phases, or identities it was told of, which this test does not
make: they pass every case here.

One refusal of valid input is accepted, and only where the card explains it: whether a decision may carry
`agreement` and `done_by_hand` depends on whether the card is a shadow card, and whether an edit's payload is
allowed depends on the card's proposal, which no schema of the request can say; the operation documents both
(a 422). A 422 on a decision counts as accepted only when the card, read from the database, calls for it.

Every operation is run with the token of the identity that would call it (the agent for runs, the demo reviewer
for approvals, ops for kill switches; webhooks carry a signature instead, which the generator cannot make), once
with generated path parameters and, where an operation has them, once more on objects that exist (a run, a
pending card, a channel), so that the handlers behind the 404 are reached too. Failures are collected rather
than shrunk (no Hypothesis shrinking: the run stays bounded), and reported together, each with the request that
reproduces it as a curl command.

Sizes: FUZZ_MAX_EXAMPLES (25 per operation, mode and parameter set), FUZZ_BUDGET_SECONDS (150: operations not
reached by then fail the test), FUZZ_SEED.
"""

from __future__ import annotations

import functools
import json
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass

import hypothesis
import requests
import schemathesis
from django.conf import settings
from schemathesis import GenerationMode
from schemathesis.checks import CHECKS as CHECKS_REGISTRY
from schemathesis.checks import load_all_checks
from schemathesis.core.failures import FailureGroup
from schemathesis.openapi.checks import RejectedPositiveData
from schemathesis.specs.openapi.checks import positive_data_acceptance

from approvals import edits
from approvals.models import Approval
from tests.system.conftest import env_int, report

MAX_EXAMPLES = env_int("FUZZ_MAX_EXAMPLES", 25)
BUDGET_SECONDS = env_int("FUZZ_BUDGET_SECONDS", 150)
SEED = env_int("FUZZ_SEED", 20240601)
REQUEST_TIMEOUT = 10  # seconds: an answer slower than this is a failure too


def _refused_for_the_card(case, response) -> bool:
    """A 422 on a decision that the card, not the body, explains (the operation's documented 422)."""
    if response.status_code != 422 or case.operation.path != "/api/approvals/{card_id}/decision":
        return False
    card_id = (case.path_parameters or {}).get("card_id")
    card = Approval.objects.filter(pk=card_id).first() if isinstance(card_id, int) else None
    if card is None or not isinstance(case.body, dict):
        return False
    agreement, by_hand = case.body.get("agreement") or "", (case.body.get("done_by_hand") or "").strip()
    if (card.shadow and not agreement) or (not card.shadow and (agreement or by_hand)):
        return "shadow" in str(response.json().get("detail"))
    if case.body.get("decision") == "edit" and isinstance(case.body.get("payload"), dict):
        return bool(edits.edit_errors(card, case.body["payload"]))
    return False


@functools.wraps(positive_data_acceptance)
def positive_data_acceptance_but_the_card(ctx, response, case):
    try:
        return positive_data_acceptance(ctx, response, case)
    except RejectedPositiveData:
        if _refused_for_the_card(case, response):
            return None
        raise


load_all_checks()
# Every check schemathesis has, positive_data_acceptance narrowed as said above.
CHECKS = [
    positive_data_acceptance_but_the_card if check is positive_data_acceptance else check
    for check in CHECKS_REGISTRY.get_all()
]


def identity(path: str) -> str | None:
    """Whose token an operation is called with."""
    if path.startswith("/api/approvals"):
        return "reviewer"
    if path.startswith(("/api/channels", "/api/kill-switch")):
        return "ops"
    if path.startswith("/api/webhooks"):
        return None  # signed deliveries, no token
    return "agent"


@dataclass
class Finding:
    operation: str
    mode: str
    check: str
    status: int | None
    message: str
    request: str  # a curl command that sends it again
    response: str
    server_error: str = ""
    count: int = 1

    def __str__(self) -> str:
        text = (
            f"[{self.check}] {self.operation} ({self.mode}), {self.count}x, e.g. status {self.status}\n"
            f"  {self.message.strip()}\n  request: {self.request}\n  response: {self.response}"
        )
        if self.server_error:
            text += f"\n  server log: {self.server_error}"
        return text


class Fuzzer:
    def __init__(self, system, schema, tokens: dict[str, str]):
        self.system = system
        self.schema = schema
        self.tokens = tokens
        self.session = requests.Session()
        self.findings: dict[tuple, Finding] = {}
        self.statuses: dict[str, Counter] = defaultdict(Counter)
        self.cases = 0
        self.seconds: Counter = Counter()  # per operation: generating, sending and checking

    def headers(self, path: str) -> dict[str, str]:
        who = identity(path)
        return {"Authorization": f"Bearer {self.tokens[who]}"} if who else {}

    def run(self, operation, mode: GenerationMode, path_parameters: dict | None = None) -> None:
        headers = self.headers(operation.path)
        label = f"{operation.method.upper()} {operation.path}"
        # The token is a fixed header of every case, so that schemathesis knows it is sent: a negative case
        # then never counts on its absence (it would expect a refusal that a valid token rightly does not get).
        strategy = operation.as_strategy(generation_mode=mode, path_parameters=path_parameters, headers=headers or None)

        @hypothesis.seed(SEED)
        @hypothesis.settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,  # bounded by REQUEST_TIMEOUT per request and FUZZ_BUDGET_SECONDS in all
            database=None,  # nothing written into the checkout
            phases=[hypothesis.Phase.generate],  # no shrinking: failures are collected, not minimised
            suppress_health_check=list(hypothesis.HealthCheck),
            verbosity=hypothesis.Verbosity.quiet,
        )
        @hypothesis.given(case=strategy)
        def send(case):
            self.cases += 1
            try:
                response = case.call(base_url=self.system.url, session=self.session, timeout=REQUEST_TIMEOUT)
            except requests.RequestException as exc:
                self._found(label, mode, "no answer", None, f"{exc.__class__.__name__}: {exc}", case, headers, "")
                return
            self.statuses[label][response.status_code] += 1
            try:
                case.validate_response(
                    response,
                    checks=CHECKS,
                    transport_kwargs={"base_url": self.system.url, "timeout": REQUEST_TIMEOUT},
                )
            except FailureGroup as group:
                for failure in group.exceptions:
                    self._found(
                        label, mode, failure.title, response.status_code, failure.message, case, headers, response
                    )

        started = time.monotonic()
        send()
        self.seconds[label] += time.monotonic() - started

    def _found(self, label, mode, check, status, message, case, headers, response) -> None:
        key = (label, mode.value, check, status, _cause(response))
        if key in self.findings:
            self.findings[key].count += 1
            return
        try:
            curl = case.as_curl_command(headers=headers, base_url=self.system.url)
        except Exception as exc:  # noqa: BLE001 - the finding matters more than its curl line
            curl = f"(no curl: {exc}) {case.method} {case.formatted_path} query={case.query} body={case.body!r}"
        body = response.text[:600] if response != "" else ""
        self.findings[key] = Finding(
            operation=label,
            mode=mode.value,
            check=check,
            status=status,
            message=message[:800],
            request=curl[:1500],
            response=body,
            server_error=self.system.server.errors(limit=1)[-1500:] if status and status >= 500 else "",
        )


def _cause(response) -> str:
    """What an error answer says, without the field names and values it quotes: findings of one operation that
    differ in this have different causes, and each is reported."""
    try:
        detail = response.json()["detail"]
    except (AttributeError, ValueError, KeyError, TypeError):
        return ""
    if isinstance(detail, list):
        kinds = {str(p.get("type") or p.get("msg")) if isinstance(p, dict) else str(p) for p in detail}
        return json.dumps(sorted(kinds))[:100]
    return str(detail)[:40]


def _seed(system) -> dict:
    """Objects that exist, for a second pass on the operations with path parameters: a run the agent started, and
    a pending card of another run (gated refunds, worked up to their gate by the system's workers), so that
    cancelling the one does not close the other."""
    refund = {"amount_cents": settings.AUTO_APPROVE_CENTS + 4_000, "currency": "EUR", "reason": "Item arrived damaged"}
    run_id = system.submit({**refund, "customer_id": "cus_fuzz_1"})
    carded = system.submit({**refund, "customer_id": "cus_fuzz_2"})
    deadline = time.monotonic() + 30
    while True:
        cards = [card for card in system.reviewer.get("/api/approvals?status=pending").body if card["run_id"] == carded]
        if cards:
            break
        assert time.monotonic() < deadline, f"no card within 30 s\n{system.workers.logs()}"
        time.sleep(0.2)
    return {"run_id": run_id, "card_id": cards[0]["id"], "name": "payments", "source": "demo"}


def test_the_api_answers_generated_input_as_its_schema_says(system):
    started = time.monotonic()
    known = _seed(system)
    with urllib.request.urlopen(system.url + "/api/openapi.json", timeout=10) as response:
        assert response.status == 200
    schema = schemathesis.openapi.from_url(system.url + "/api/openapi.json")
    tokens = {"agent": system.agent.token, "reviewer": system.reviewer.token, "ops": system.ops.token}
    fuzzer = Fuzzer(system, schema, tokens)

    operations, not_loaded, not_reached, nothing_to_negate = [], [], [], []
    for result in schema.get_all_operations():
        try:
            operations.append(result.ok())
        except Exception as exc:  # noqa: BLE001 - an operation schemathesis cannot read is reported
            not_loaded.append(f"{exc.__class__.__name__}: {exc}")
    passes = 0
    for operation in operations:
        label = f"{operation.method.upper()} {operation.path}"
        names = {parameter.name for parameter in operation.path_parameters}
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            parameter_sets = [None]
            if names:
                parameter_sets.append({name: known[name] for name in names if name in known})
            for path_parameters in parameter_sets:
                if time.monotonic() - started > BUDGET_SECONDS:
                    not_reached.append(f"{label} ({mode.value}, {path_parameters})")
                    continue
                try:
                    fuzzer.run(operation, mode, path_parameters)
                except hypothesis.errors.Unsatisfiable:
                    # No input of this operation can be made invalid (GET /api/me has none): nothing to send.
                    if mode is not GenerationMode.NEGATIVE:
                        raise
                    nothing_to_negate.append(f"{label}{' on existing objects' if path_parameters else ''}")
                    continue
                passes += 1
    elapsed = time.monotonic() - started

    # Server errors and unanswered requests first: they are the worst.
    findings = sorted(
        fuzzer.findings.values(),
        key=lambda f: (not (f.status is None or f.status >= 500), f.check, f.operation, f.mode, f.status or 0),
    )
    report(
        "bad input (schemathesis)",
        schemathesis=schemathesis.SCHEMATHESIS_VERSION,
        hypothesis=hypothesis.__version__,
        operations=len(operations),
        passes=passes,
        cases=fuzzer.cases,
        no_invalid_input_possible=nothing_to_negate,
        max_examples_per_pass=MAX_EXAMPLES,
        statuses={label: dict(sorted(counter.items())) for label, counter in sorted(fuzzer.statuses.items())},
        seconds={label: round(seconds, 1) for label, seconds in fuzzer.seconds.most_common()},
        server_errors=sum(n for counter in fuzzer.statuses.values() for status, n in counter.items() if status >= 500),
        findings_by_check=dict(Counter(f.check for f in findings)),
        findings_by_operation=dict(Counter(f.operation for f in findings)),
        elapsed_s=elapsed,
    )
    for finding in findings:
        print(f"\n{finding}")

    assert not not_loaded, not_loaded
    assert len(operations) >= 9, [f"{o.method.upper()} {o.path}" for o in operations]
    assert not not_reached, f"not reached within {BUDGET_SECONDS} s: {not_reached}"
    assert not findings, f"{len(findings)} findings:\n\n" + "\n\n".join(str(f) for f in findings)
