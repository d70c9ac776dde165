"""The conformance clauses: each test is one clause with an id and a MUST."""
