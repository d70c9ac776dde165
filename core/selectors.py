"""Kubernetes label selectors (metav1.LabelSelector as API JSON), matched
against a set of labels: shared by the embedded platform's policy engine and
the clauses that read which of the platform's policies select a pod."""
from __future__ import annotations

from typing import Any, Mapping


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """metav1.LabelSelector semantics: {} matches everything; all terms must hold.
    An operator other than In, NotIn, Exists, DoesNotExist is a ValueError."""
    selector = selector or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In":
            ok = key in labels and labels[key] in values
        elif op == "NotIn":
            ok = key not in labels or labels[key] not in values
        elif op == "Exists":
            ok = key in labels
        elif op == "DoesNotExist":
            ok = key not in labels
        else:
            raise ValueError(f"label selector operator {op!r} is not one of In, NotIn, Exists, DoesNotExist")
        if not ok:
            return False
    return True
