"""Approval requests of external agents (docs/external-agents.md): an agent outside the console asks a person to
sign off one action, executes it at most once when it is approved, and reports what happened.

- api: the HTTP side (/api/approval-requests), the logic below as JSON; views: the outcome a person records from
  the run's page; waiters: who is waiting on a long-poll, and what wakes them.
- asks: opening a request (its step, its card, its SLA timer), and its card's gate (schemas: the JSON Schema the
  agent sent, which arguments and edits must fit).
- status: what the agent is told of its request, and what a closed card does; callbacks: the decision sent to the
  agent's callback URL.
- executions: its one execution (consume), and the outcome the agent reports or a person records; results: any
  JSON result, stored.
- errors: what is refused, and how it answers; models: ActionRequest; apps: the wiring at start-up.
"""
