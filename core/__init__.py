"""The shared base every folder stands on: the certification profile and its
schema, named timeouts and the one wait, processes and their owners, locks
and the runtime directory, cgroups, Kueue's API, selectors, redaction, cost,
training events, the clause catalogue. It imports nothing of the suite's
other folders (`lint-imports` checks it)."""
