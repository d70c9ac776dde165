"""The conformance clauses: each test is one clause with an id and a MUST.

The catalogue of clause ids is read from these files by
:func:`core.catalogue.catalogue`.
"""
