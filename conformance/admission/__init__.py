"""Kueue admission clauses: gangs admitted whole or not at all, stragglers (ADM-*)."""
