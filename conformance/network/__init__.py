"""Clauses NET-1..3: NetworkPolicy enforcement and what it does to collectives."""
